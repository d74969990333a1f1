"""Routes between two units of different sizes, by sample (Megatron-Core's bridge
communicators, as explicit per-rank tables).

Each unit cuts the step's batch its own way: into `groups` contiguous groups, each split
over its data-parallel replicas, each replica's share cut into micro-batches in order.
A piece is the overlap of one producer micro-batch with one consumer micro-batch: the
producer replica's lead (its first TP rank; its TP peers hold the same tensor) sends it
to the consumer replica's lead, which shares it with its TP peers (a broadcast the
planner emits). A consumer micro-batch may take rows of several producer micro-batches
(fan-in) or part of one (fan-out). The gradient takes the same pieces back.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from src.cluster import ClusterSpec
from src.mesh import Mesh
from src.program import CommKind, Message, Payload, Table
from src.strategies.builders.layout import table


@dataclass(frozen=True)
class Side:
    """One end of a bridge: the unit's ranks at the boundary stage as a (tp, dp) mesh,
    how it cuts the batch, and the payload it sends or receives (named per micro-batch
    in this side's numbering)."""

    mesh: Mesh
    micro_batch: int
    microbatches: int  # per replica and group
    groups: int
    payload: Payload  # micro-batch 0's; rows are set per piece

    @property
    def replicas(self) -> int:
        return self.mesh.degree("dp")

    def share(self) -> int:
        return self.micro_batch * self.microbatches

    def first_row(self, global_batch: int, replica: int, microbatch: int) -> int:
        """Position in the step's batch of the first sample of a replica's micro-batch."""
        group, local = divmod(microbatch, self.microbatches)
        return group * (global_batch // self.groups) + replica * self.share() + local * self.micro_batch

    def lead(self, replica: int) -> int:
        return self.mesh.rank(dp=replica)

    def at(self, microbatch: int) -> Payload:
        p = self.payload
        return Payload(p.unit, p.layer, microbatch, p.tensor)


def pieces(src: Side, dst: Side, global_batch: int) -> list[tuple[int, int, int, int, int, int]]:
    """(producer replica, its micro-batch, consumer replica, its micro-batch, first
    sample, rows) of every overlap, in sample order within each producer micro-batch.
    The consumer's micro-batches tile the batch: each producer micro-batch finds the ones
    it overlaps by bisection (a bridge joins thousands of replicas)."""
    starts = sorted(
        (dst.first_row(global_batch, cd, cj), cd, cj) for cd in range(dst.replicas) for cj in range(dst.groups * dst.microbatches)
    )
    firsts = [start for start, _, _ in starts]
    out = []
    for pd in range(src.replicas):
        for pj in range(src.groups * src.microbatches):
            p0 = src.first_row(global_batch, pd, pj)
            overlaps = []
            for c0, cd, cj in starts[max(0, bisect.bisect_right(firsts, p0) - 1) : bisect.bisect_left(firsts, p0 + src.micro_batch)]:
                lo, hi = max(p0, c0), min(p0 + src.micro_batch, c0 + dst.micro_batch)
                if lo < hi:
                    overlaps.append((cd, cj, lo, hi - lo))
            out += [(pd, pj, cd, cj, first, rows) for cd, cj, first, rows in sorted(overlaps)]
    return out


def bridge(
    cluster: ClusterSpec, name: str, kind: CommKind, src: Side, dst: Side, global_batch: int, row_bytes: float
) -> tuple[Table, Table]:
    """The route from `src` to `dst` and the gradient's route back."""
    forward, backward = [], []
    for pd, pj, cd, cj, first, rows in pieces(src, dst, global_batch):
        p0, c0 = src.first_row(global_batch, pd, pj), dst.first_row(global_batch, cd, cj)
        sent = src.at(pj).part(first - p0, first - p0 + rows)
        received = dst.at(cj).part(first - c0, first - c0 + rows)
        forward.append(Message(src.lead(pd), dst.lead(cd), sent, received, rows * row_bytes))
        backward.append(Message(dst.lead(cd), src.lead(pd), received.gradient(), sent.gradient(), rows * row_bytes))
    return table(cluster, name, kind, forward), table(cluster, f"{name}.grad", kind, backward)
