"""Communication time: ring collectives and point-to-point transfers (alpha-beta model).

For a ring over g ranks moving a per-rank buffer of S bytes, each of the g-1 (all-gather,
reduce-scatter) or 2(g-1) (all-reduce) steps pays one link latency, and the data term is
(g-1)/g·S (resp. 2(g-1)/g·S) over the ring's bottleneck bandwidth (Par4D eqs. 1-3, plus
latency). Which link the ring crosses and how many rings share a node's NICs come from
ClusterSpec.bandwidth (Par4D eq. 10).
"""
from __future__ import annotations

from typing import Sequence

from src.cluster import ClusterSpec


class CommModel:
    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster

    def collective_time(self, op: str, ranks: Sequence[int], nbytes: float, sharing: int = 1) -> float:
        g = len(ranks)
        if g <= 1 or nbytes <= 0:
            return 0.0
        bandwidth = self.cluster.bandwidth(ranks, sharing)
        latency = self.cluster.latency(ranks)
        fraction = (g - 1) / g
        if op == "all_reduce":
            return 2 * (g - 1) * latency + 2 * fraction * nbytes / bandwidth
        if op in ("all_gather", "reduce_scatter", "all_to_all"):
            return (g - 1) * latency + fraction * nbytes / bandwidth
        if op == "broadcast":
            return (g - 1) * latency + nbytes / bandwidth
        raise ValueError(f"unknown collective {op!r}")

    def p2p_time(self, src: int, dst: int, nbytes: float, sharing: int = 1) -> float:
        if nbytes <= 0 or src == dst:
            return 0.0
        crosses = self.cluster.node_of(src) != self.cluster.node_of(dst)  # called per message: no sets
        return self.cluster.link_latency(crosses) + nbytes / self.cluster.link_bandwidth(crosses, sharing)
