"""Communication time: a collective library's algorithms and protocols, and point-to-point
transfers.

Collectives follow the library's own tuning model (NVIDIA/nccl and ROCm/rccl
src/graph/tuning.cc, ncclTopoTuneModel and ncclTopoGetAlgoTime), with the constants the
cluster preset states for its library (ClusterSpec.ring_protocols, tree_protocols): each
(algorithm, protocol) prices a collective as latency + bytes / bandwidth, and the
collective takes the fastest, as the library does.

- Ring over g ranks on n nodes: all-gather and reduce-scatter take g-1 steps, all-reduce
  2(g-1). A chunk crosses a node boundary on n-1 of the g-1 steps (2(n-1) of 2(g-1)) at
  the network's per-step latency; the others pay the node's links' (no less than the
  host's cost of posting a network step, once the ring spans nodes). The data term is
  (g-1)/g·S (2(g-1)/g·S) over the protocol's share of the ring's bus bandwidth: the low-
  latency protocols (NCCL's LL, LL128) start fast and move data slowly, Simple the
  reverse, so the achieved bandwidth grows with the message size and the per-step latency
  makes a ring over thousands of ranks latency-bound unless its messages are large.
- Tree all-reduce (NCCL's double binary tree across nodes, a chain inside each node):
  latency 2·((g/n - 1)·intra + ⌈log2 n⌉·inter), data 2·S over the protocol's tree bus
  bandwidth, corrected by message size where the library corrects it. Only all-reduces
  that span nodes take it.
- All-to-all: every rank sends each other rank S/g at once; the node's NICs carry what
  leaves it, shared by its members in the group, so its data term is the larger of the
  NVLink part and the network part.

Where devices share a host's cores (CPU workers), they reach a collective further apart
than the model's clock says: the scheduler time-slices them, so one may lag the others by
up to about a scheduling period, more likely the longer they computed since the group last
synchronized, and the collective waits for the slowest (ClusterSpec.sync_skew_s and
sync_skew_build_s, measured over all of a node's devices; a group of g waits for the
expected maximum of g lags).

Which link a ring crosses and how many rings share a node's NICs come from
ClusterSpec.bandwidth (Par4D eq. 10); transfers of other families that share those NICs
at the same time are the simulator's to account for (src/sim/engine.py).

Where the preset has measurements of its library on the machine
(ClusterSpec.collective_measurements, src/costmodel/measured.py), they price what they
cover instead of the model: a group spanning nodes (or a whole node) by its size and
buffer, its latency the model's, the rest transfer, which `sharing` groups of a family
crossing a node's NICs at once divide among them (Par4D eq. 10, as its authors' own
model: the measured bandwidth over min(devices per node, the inner axes' product)); a
group inside a node, smaller than it, at the bus bandwidth measured for its placement.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

from src.cluster import ClusterSpec, Protocol
from src.costmodel.measured import measured_seconds, placement_bandwidth

# What the real backend's batch-sync exchange first tells the group (src/runtime/batch_rows.py):
# four int64 per rank (tower, first row, end row, wanted towers).
ROW_LAYOUT_BYTES = 4 * 8


class CommModel:
    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster

    def collective_time(self, op: str, ranks: Sequence[int], nbytes: float, sharing: int = 1) -> float:
        latency, transfer = self.collective_parts(op, ranks, nbytes, sharing)
        return latency + transfer

    def collective_parts(self, op: str, ranks: Sequence[int], nbytes: float, sharing: int = 1) -> tuple[float, float]:
        """(latency, transfer) seconds of a collective: its steps' latencies, and the time
        its data keeps the links busy, for the fastest algorithm and protocol."""
        g = len(ranks)
        if g <= 1 or nbytes <= 0:
            return 0.0, 0.0
        n = self.cluster.nodes_spanned(ranks)
        # The library's shortfall from its model for this op (gloo's reduce-scatter), if any.
        bus = self.cluster.bandwidth(ranks, sharing) * self.cluster.collective_efficiency.get(op, 1.0)
        if op == "all_to_all":
            return self._all_to_all(ranks, g, n, nbytes, bus)
        if op not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            raise ValueError(f"unknown collective {op!r}")
        best = self._modelled(op, g, n, nbytes, bus)
        per_node = self.cluster.devices_per_node
        for measured in self.cluster.collective_measurements:
            # The tables measured whole nodes: one node, or two and more; a group of fewer
            # ranks across nodes was not measured.
            whole = g == per_node if n == 1 else g >= 2 * per_node
            seconds = measured_seconds(measured, op, g, nbytes, sum(best)) if whole else None
            if seconds is not None:
                latency = min(best[0], seconds)
                return latency, (seconds - latency) * (sharing if n > 1 else 1)
            placed = placement_bandwidth(measured, ranks) if n == 1 else None
            if placed is not None:
                return self._modelled(op, g, n, nbytes, placed)
        return best

    def _modelled(self, op: str, g: int, n: int, nbytes: float, bus: float) -> tuple[float, float]:
        """The library's model: its fastest algorithm and protocol at bus bandwidth `bus`."""
        best = min((self._ring(p, op, g, n, nbytes, bus) for p in self.cluster.ring_table().values()), key=sum)
        if op == "all_reduce" and n > 1:
            trees = [self._tree(p, g, n, nbytes, bus) for p in self.cluster.tree_table().values()]
            best = min([best, *trees], key=sum)
        return best

    @staticmethod
    def _ring(p: Protocol, op: str, g: int, n: int, nbytes: float, bus: float) -> tuple[float, float]:
        passes = 2 if op == "all_reduce" else 1
        steps, inter = passes * (g - 1), passes * (n - 1)
        intra_step = max(p.intra_step_s, p.net_step_floor_s) if n > 1 else p.intra_step_s
        latency = p.base_s + (steps - inter) * intra_step + inter * p.inter_step_s
        if op == "all_reduce" and n > 1:
            latency *= p.allreduce_plateau
        moved = nbytes if op == "broadcast" else passes * (g - 1) / g * nbytes
        return latency, moved / p.bandwidth(bus, nbytes, n > 1)

    @staticmethod
    def _tree(p: Protocol, g: int, n: int, nbytes: float, bus: float) -> tuple[float, float]:
        latency = p.base_s + 2 * ((g / n - 1) * p.intra_step_s + math.ceil(math.log2(n)) * p.inter_step_s)
        return latency, 2 * nbytes / p.bandwidth(bus, nbytes, True)

    def _all_to_all(self, ranks: Sequence[int], g: int, n: int, nbytes: float, bus: float) -> tuple[float, float]:
        """Each rank sends S/g to every other rank at once (a group of point-to-point
        transfers, the libraries' all-to-all): the node's links carry the local part, its
        NICs what leaves the node, shared by the group's members there."""
        simple = _bulk(self.cluster.ring_table())
        members = _busiest_node(self.cluster, ranks)
        latency = simple.base_s + (g - n) * simple.intra_step_s + (n - 1) * simple.inter_step_s
        local = (members - 1) / g * nbytes / (self.cluster.intra_bandwidth * self.cluster.intra_efficiency)
        remote = 0.0
        if n > 1:
            nic_share = self.cluster.inter_bandwidth * self.cluster.inter_efficiency / members
            remote = (g - members) / g * nbytes / min(bus, nic_share)
        return latency, max(local, remote)

    def row_exchange_parts(self, ranks: Sequence[int], nbytes: float, sharing: int = 1) -> tuple[float, float]:
        """A batch-sync all-to-all as the real backend runs it: an all-gather of every
        rank's row layout, then the all-to-all of the padded pieces (`nbytes` each rank)."""
        layout_latency, layout_transfer = self.collective_parts("all_gather", ranks, ROW_LAYOUT_BYTES * len(ranks), sharing)
        latency, transfer = self.collective_parts("all_to_all", ranks, nbytes, sharing)
        return layout_latency + layout_transfer + latency, transfer

    def skew(self, group: int, computed_s: float) -> float:
        """The expected wait for the slowest of `group` ranks at a collective, each having
        computed `computed_s` seconds since they last synchronized (0 where devices do not
        share cores)."""
        cluster = self.cluster
        if group <= 1:
            return 0.0
        measured_over = max(2, cluster.devices_per_node)
        wait = lag_wait(cluster.sync_skew_s, cluster.sync_skew_build_s, computed_s)
        return wait * expected_maximum(group) / expected_maximum(measured_over)

    def p2p_time(self, src: int, dst: int, nbytes: float, sharing: int = 1) -> float:
        if nbytes <= 0 or src == dst:
            return 0.0
        crosses = self.cluster.node_of(src) != self.cluster.node_of(dst)  # called per message: no sets
        return self.cluster.link_latency(crosses) + nbytes / self.cluster.p2p_link_bandwidth(crosses, sharing)


def lag_wait(wait_s: float, build_s: float, computed_s: float) -> float:
    """The wait for the slowest of a node's time-sliced devices after `computed_s` seconds
    of compute since they last synchronized: `wait_s` once built up, over `build_s`."""
    if wait_s <= 0 or computed_s <= 0:
        return 0.0
    return wait_s if build_s <= 0 else -wait_s * math.expm1(-computed_s / build_s)


@functools.lru_cache(maxsize=None)
def expected_maximum(n: int) -> float:
    """The expected largest of n independent standard normal draws (0 for one): the
    integral of x · n·φ(x)·Φ(x)^(n-1), by the midpoint rule on [-8, 8 + √(2 ln n)]."""
    if n <= 1:
        return 0.0
    low, high = -8.0, 8.0 + math.sqrt(2.0 * math.log(n))
    steps = 4000
    width = (high - low) / steps
    total = 0.0
    for i in range(steps):
        x = low + (i + 0.5) * width
        density = math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        below = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        total += x * n * density * below ** (n - 1)
    return total * width


def _bulk(table: Mapping[str, Protocol]) -> Protocol:
    """The protocol that moves bulk data (the one with the largest share: NCCL's Simple)."""
    return max(table.values(), key=lambda p: (p.share, -p.base_s))


def _busiest_node(cluster: ClusterSpec, ranks: Sequence[int]) -> int:
    per_node: dict[int, int] = {}
    for r in ranks:
        node = cluster.node_of(r)
        per_node[node] = per_node.get(node, 0) + 1
    return max(per_node.values())
