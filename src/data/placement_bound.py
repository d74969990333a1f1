"""The shortest iteration any placement of a batch can reach under 1F1B, in the balancing's
own cost model: how much of skew's cost balancing could win back at best.

A balancing policy only permutes the batch's sequences over the replicas' micro-batch
positions. Where every micro-batch holds one sequence and the pipeline runs plain 1F1B, one
pair of stages sets a floor that no permutation moves: the last stage (s + 1) and the stage
before it (s), one warm-up forward ahead of it. Let sigma_i be when stage s starts the backward
of its i-th micro-batch, g_i when the last stage ends it, G_i the last stage's forward plus
backward of micro-batch i, and c stage s's backward of one micro-batch plus its forward of the
one after next (1F1B's steady state on stage s). The last stage runs the forward and backward
of micro-batch i + 1 back to back once it has ended the backward of i and stage s has sent it
that forward, which stage s did before sigma_i: g_(i+1) = sigma_i + G_(i+1). Stage s starts
the backward of i + 1 once that gradient is back and it has run its own backward of i and
forward of i + 2: sigma_(i+1) >= sigma_i + max(c, G_(i+1)). Each micro-batch thus costs the
slower of the two stages, whatever the order: a heavy one is not made up for by a light one
after it (nothing is queued in front of the last stage for it to catch up on). Summed over a
replica's micro-batches, with the first micro-batch's way down to the last stage and the last
one's backward back up to the first stage added, and the cool-down's backwards of stage s
without a forward between them taken off:

    replica >= F_path + B_path + sum_i max(c, G_i) - max(0, c - min G) - max f_s

The slowest replica is at least the replicas' mean, and the sum over all replicas of
max(c, G_i) is the batch's whatever the placement: hence a floor for every placement. It holds
for the balancing's recurrence (src.data.reorder.IntervalSim, communication left out) and for
a schedule that runs as it (the simulator adds transfers, which only lengthen it). With more
warm-up forwards (`strategy.extra_warmup`) the stages before the last run further ahead and
light micro-batches can drain what heavy ones held up; with several sequences a micro-batch
the placement chooses G_i itself: no floor is given there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from src.data.balance import Balancer


def why_no_bound(balancer: Balancer) -> str | None:
    """Why the floor does not apply to this pipeline, or None where it does."""
    if balancer.extra_warmup:
        return f"{balancer.extra_warmup} warm-up forwards beyond 1F1B's let the stages run ahead of the last"
    if balancer.layout.micro_batch != 1:
        return f"micro-batches of {balancer.layout.micro_batch} sequences: the placement chooses their loads"
    if len(balancer.stages) < 2:
        return "a pipeline of one stage"
    return None


@dataclass(frozen=True)
class Floor:
    """The floor (module docstring) and what it is made of: `seconds` under every placement;
    `steady` (c), the stage before the last's backward and forward a steady-state step; `last`
    (G_i), each sequence's forward and backward on the last stage, in data order."""

    seconds: float
    steady: float
    last: tuple[float, ...]


def placement_bound(balancer: Balancer, loads: Mapping[str, Sequence[float]]) -> Floor | None:
    """The floor under every placement of the batch of these loads, in seconds of the
    balancer's recurrence; None where `why_no_bound` gives a reason."""
    if why_no_bound(balancer) is not None:
        return None
    import numpy as np

    forward, backward = balancer.times_alone(loads)
    last, before = len(balancer.stages) - 1, len(balancer.stages) - 2
    pair = forward[:, last] + backward[:, last]
    steady = backward[:, before].min() + forward[:, before].min()
    ends = forward[:, : before + 1].sum(axis=1).min() + backward[:, : before + 1].sum(axis=1).min()
    edges = max(0.0, steady - pair.min()) + forward[:, before].max()
    seconds = ends - edges + np.maximum(steady, pair).sum() / balancer.layout.dp
    return Floor(float(seconds), float(steady), tuple(pair.tolist()))
