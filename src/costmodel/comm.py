"""Communication time: NCCL's ring and tree collectives and point-to-point transfers.

The latency terms follow NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc,
ncclTopoTuneModel), which prices a collective as latency + bytes / bandwidth:

- Ring over g ranks on n nodes: all-gather and reduce-scatter take g-1 steps, all-reduce
  2(g-1) (a reduce-scatter then an all-gather). A chunk crosses a node boundary on n-1 of
  the g-1 steps (2(n-1) of the 2(g-1)), paying the network's per-step latency there and
  NVLink's on the others. So the latency grows with the number of ranks and, at the
  network's higher per-step cost, with the number of nodes. The data term is (g-1)/g·S
  (resp. 2(g-1)/g·S) over the ring's bottleneck bandwidth (Par4D eqs. 1-3).
- Tree all-reduce (NCCL's double binary tree across nodes, a chain inside each node):
  latency 2·((g/n - 1)·intra + ⌈log2 n⌉·inter); NCCL rates its algorithm bandwidth at
  half the bus bandwidth, so its data term is 2·S over the same bandwidth. Like NCCL, an
  all-reduce that spans nodes takes whichever of ring and tree is faster for its size, so
  small all-reduces at thousands of ranks are latency-logarithmic, large ones ring-bound.
- All-gather and reduce-scatter have only the ring (NCCL's tree is all-reduce only).

Which link the ring crosses and how many rings share a node's NICs come from
ClusterSpec.bandwidth (Par4D eq. 10); transfers of other families that share those NICs
at the same time are the simulator's to account for (src/sim/engine.py).
"""

from __future__ import annotations

import math
from typing import Sequence

from src.cluster import ClusterSpec


class CommModel:
    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster

    def collective_time(self, op: str, ranks: Sequence[int], nbytes: float, sharing: int = 1) -> float:
        latency, transfer = self.collective_parts(op, ranks, nbytes, sharing)
        return latency + transfer

    def collective_parts(self, op: str, ranks: Sequence[int], nbytes: float, sharing: int = 1) -> tuple[float, float]:
        """(latency, transfer) seconds of a collective: its steps' link latencies, and the
        time its data keeps the links busy."""
        g = len(ranks)
        if g <= 1 or nbytes <= 0:
            return 0.0, 0.0
        n = self.cluster.nodes_spanned(ranks)
        # The library's shortfall from the formula for this op (gloo's reduce-scatter), if any.
        bandwidth = self.cluster.bandwidth(ranks, sharing) * self.cluster.collective_efficiency.get(op, 1.0)
        intra, inter = self.cluster.intra_latency, self.cluster.inter_latency
        steps, fraction = (g - 1) - (n - 1), (g - 1) / g  # intra-node steps of a one-pass ring
        if op == "all_reduce":
            ring = (2 * (steps * intra + (n - 1) * inter), 2 * fraction * nbytes / bandwidth)
            if n == 1:
                return ring
            tree = (2 * ((g / n - 1) * intra + math.ceil(math.log2(n)) * inter), 2 * nbytes / bandwidth)
            return min(ring, tree, key=sum)
        latency = steps * intra + (n - 1) * inter
        if op in ("all_gather", "reduce_scatter", "all_to_all"):
            return latency, fraction * nbytes / bandwidth
        if op == "broadcast":
            return latency, nbytes / bandwidth
        raise ValueError(f"unknown collective {op!r}")

    def p2p_time(self, src: int, dst: int, nbytes: float, sharing: int = 1) -> float:
        if nbytes <= 0 or src == dst:
            return 0.0
        crosses = self.cluster.node_of(src) != self.cluster.node_of(dst)  # called per message: no sets
        return self.cluster.link_latency(crosses) + nbytes / self.cluster.link_bandwidth(crosses, sharing)
