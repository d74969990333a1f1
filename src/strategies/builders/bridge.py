"""Routes between two units of different sizes, by sample (Megatron-Core's bridge
communicators, as explicit per-rank tables).

Each unit cuts the step's batch its own way (its BatchLayout: into contiguous sample
groups, each split over its data-parallel replicas, each replica's share cut into
micro-batches in order).
A piece is the overlap of one producer micro-batch with one consumer micro-batch: the
producer replica's lead (its first TP rank; its TP peers hold the same tensor) sends it
to the consumer replica's lead, which shares it with its TP peers (a broadcast the
planner emits). A consumer micro-batch may take rows of several producer micro-batches
(fan-in) or part of one (fan-out). The gradient takes the same pieces back.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from src.batch_layout import BatchLayout
from src.cluster import ClusterSpec
from src.mesh import Mesh
from src.program import CommKind, Message, Payload, Table
from src.strategies.builders.layout import table


@dataclass(frozen=True)
class Side:
    """One end of a bridge: the unit's ranks at the boundary stage as a (tp, dp) mesh,
    how it cuts the batch (over the mesh's dp replicas), and the payload it sends or
    receives (named per micro-batch in this side's numbering)."""

    mesh: Mesh
    batch: BatchLayout
    payload: Payload  # micro-batch 0's; rows are set per piece

    def lead(self, replica: int) -> int:
        return self.mesh.rank(dp=replica)

    def at(self, microbatch: int) -> Payload:
        p = self.payload
        return Payload(p.unit, p.layer, microbatch, p.tensor)


def pieces(src: Side, dst: Side) -> list[tuple[int, int, int, int, int, int]]:
    """(producer replica, its micro-batch, consumer replica, its micro-batch, first
    sample, rows) of every overlap, in sample order within each producer micro-batch.
    The consumer's micro-batches tile the batch: each producer micro-batch finds the ones
    it overlaps by bisection (a bridge joins thousands of replicas)."""
    made, taken = src.batch, dst.batch
    starts = sorted((taken.first_sample(cd, cj), cd, cj) for cd in range(taken.dp) for cj in range(taken.microbatches))
    firsts = [start for start, _, _ in starts]
    out = []
    for pd in range(made.dp):
        for pj in range(made.microbatches):
            p0 = made.first_sample(pd, pj)
            overlaps = []
            for c0, cd, cj in starts[max(0, bisect.bisect_right(firsts, p0) - 1) : bisect.bisect_left(firsts, p0 + made.micro_batch)]:
                lo, hi = max(p0, c0), min(p0 + made.micro_batch, c0 + taken.micro_batch)
                if lo < hi:
                    overlaps.append((cd, cj, lo, hi - lo))
            out += [(pd, pj, cd, cj, first, rows) for cd, cj, first, rows in sorted(overlaps)]
    return out


def bridge(cluster: ClusterSpec, name: str, kind: CommKind, src: Side, dst: Side, row_bytes: float) -> tuple[Table, Table]:
    """The route from `src` to `dst` and the gradient's route back."""
    forward, backward = [], []
    for pd, pj, cd, cj, first, rows in pieces(src, dst):
        p0, c0 = src.batch.first_sample(pd, pj), dst.batch.first_sample(cd, cj)
        sent = src.at(pj).part(first - p0, first - p0 + rows)
        received = dst.at(cj).part(first - c0, first - c0 + rows)
        forward.append(Message(src.lead(pd), dst.lead(cd), sent, received, rows * row_bytes))
        backward.append(Message(dst.lead(cd), src.lead(pd), received.gradient(), sent.gradient(), rows * row_bytes))
    return table(cluster, name, kind, forward), table(cluster, f"{name}.grad", kind, backward)
