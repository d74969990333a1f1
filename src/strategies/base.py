"""What every strategy planner receives, and the registry from names to planners."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from src.cluster import ClusterSpec
from src.config import TrainSpec
from src.models.spec import ModelSpec
from src.program import Plan


@dataclass(frozen=True)
class PlanRequest:
    """A planner's whole input. Planners are pure functions of it: no I/O."""

    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    options: Mapping[str, Any]


Planner = Callable[[PlanRequest], Plan]

# A Program holds every micro-batch of the iteration: beyond this many per pipeline
# (Megatron-LM runs tens to hundreds) building and simulating one takes minutes.
MAX_MICROBATCHES = 1024


def divisors(n: int) -> list[int]:
    """Ascending; O(sqrt n), so an absurd batch costs nothing here."""
    small, large, d = [], [], 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]
