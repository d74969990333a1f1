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
