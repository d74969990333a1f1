"""Collective times from a library's measurements on the machine (ClusterSpec.collective_measurements).

A measured table gives the time of a collective over g consecutive ranks (whole nodes) on a
buffer of S bytes. Between measured points the time is interpolated linearly in
(log g, log S, log t), which keeps it monotone along each axis wherever the measured points
around it are; past the largest buffer the largest one's bandwidth holds (time in proportion
to S); below the smallest buffer the caller takes the library's model, capped by the
smallest buffer's measured time (a smaller message does not take longer). Outside the
measured group sizes, or next to a point the source has no usable time for, there is no
measured time and the library's model prices the collective. A reduce-scatter with no table of
its own takes the all-gather's: NCCL and RCCL run both on the same ring, n - 1 steps of S / n
bytes, the reduction done in each step's kernel, and their tuning models (NCCL's
src/graph/tuning.cc) and ours price the two alike, so a machine whose all-gathers run slower
than that model runs its reduce-scatters so too (NCCL 2.21 runs its all-gathers on that ring
alone where the machine has neither NVLink SHARP nor CollNet). An all-reduce with no table of
its own runs as a ring does where the reduce-scatter was measured: a reduce-scatter, then an
all-gather of the same buffer over the same ring, each phase priced as the measured
reduce-scatter, so that both come from one campaign. On Frontier, the one preset with both
tables, they are two campaigns', and the all-gather table's collapses where a rank's share is
64-256 KiB across nodes (16 MiB over 256 GCDs: 112 ms) where the reduce-scatter table's does
not (4.4 ms), nor a later all-gather campaign of the same artifact (data/all_gather_3 at
5a6353f, which its curated data of cfad79d leaves out: 2.7-3.8 ms at 4-32 MiB over 128 GCDs,
against the table's 4.3-51 ms): the collapse is a campaign's, which an all-reduce priced half
from each table took half of. Elsewhere the library's model, whose trees an all-reduce may
take.

A group inside one node, smaller than the node, takes the placement table instead: the bus
bandwidth measured for that many devices whose ranks are `stride` apart.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from src.cluster import CollectiveMeasurements, MeasuredCollective


def _log_between(x0: float, x1: float, y0: float, y1: float, x: float) -> float:
    """y at x on the straight line through (log x0, log y0) and (log x1, log y1)."""
    w = math.log(x / x0) / math.log(x1 / x0)
    return math.exp((1.0 - w) * math.log(y0) + w * math.log(y1))


def _row_seconds(table: MeasuredCollective, row: int, nbytes: float) -> float | None:
    sizes, times = table.sizes, table.seconds[row]
    if nbytes >= sizes[-1]:
        last = times[-1]
        return None if last is None else last * nbytes / sizes[-1]
    j = bisect.bisect_right(sizes, nbytes) - 1
    low, high = times[j], times[j + 1]
    if nbytes == sizes[j]:
        return low
    if low is None or high is None:
        return None
    return _log_between(sizes[j], sizes[j + 1], low, high, nbytes)


def table_seconds(table: MeasuredCollective, group: int, nbytes: float) -> float | None:
    """Seconds of the collective over `group` ranks on `nbytes` (at least the smallest
    measured buffer: the caller prices smaller ones), or None where the table does not
    cover it."""
    groups = table.groups
    if group < groups[0] or group > groups[-1]:
        return None
    nbytes = max(nbytes, table.sizes[0])
    i = bisect.bisect_left(groups, group)
    if groups[i] == group:
        return _row_seconds(table, i, nbytes)
    low, high = _row_seconds(table, i - 1, nbytes), _row_seconds(table, i, nbytes)
    if low is None or high is None:
        return None
    return _log_between(groups[i - 1], groups[i], low, high, group)


def measured_seconds(measured: CollectiveMeasurements, op: str, group: int, nbytes: float, modelled: float) -> float | None:
    """The measured time of `op` over `group` consecutive ranks on `nbytes`, None where
    the tables do not cover it; below the smallest measured buffer, the library's model
    (`modelled` seconds) up to that buffer's measured time."""
    table, phases = measured.collectives.get(op), 1
    if table is None and op == "reduce_scatter":
        # The same ring the other way: n - 1 steps of S / n bytes, each reduced on the fly in the
        # step's kernel; the libraries' tuning models, and ours, price the two alike.
        table = measured.collectives.get("all_gather")
    elif table is None and op == "all_reduce":
        # A ring's two phases, each what the measured reduce-scatter moves over the same ring, from
        # one campaign (the all-gather table's may be another's: see above).
        table, phases = measured.collectives.get("reduce_scatter"), 2
    if table is None:
        return None
    seconds = table_seconds(table, group, nbytes)
    if seconds is None:
        return None
    total = phases * seconds
    return min(total, modelled) if nbytes < table.sizes[0] else total


def placement_bandwidth(measured: CollectiveMeasurements, ranks: Sequence[int]) -> float | None:
    """The measured bus bandwidth of a group inside one node whose ranks are evenly
    spaced, None where no placement of its stride and size was measured."""
    if len(ranks) < 2:
        return None
    ordered = sorted(ranks)
    stride = ordered[1] - ordered[0]
    if any(b - a != stride for a, b in zip(ordered, ordered[1:])):
        return None
    for placement in measured.placements:
        if placement.stride == stride and placement.size == len(ordered):
            return placement.bus_bandwidth
    return None
