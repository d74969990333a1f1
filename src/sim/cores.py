"""Devices that share a host's cores (CPU workers): each computes at the share of the
cores that the workers computing at that moment leave it.

The cluster's `oversubscription` table gives a device's rate when k devices of its node
compute at once, relative to one alone (src.calibrate measures it). The compute model
prices every Work item at the share of all the node's devices computing; but a worker
blocked in communication or waiting on a pipeline peer sleeps in the kernel and leaves
its core to the others, so in a pipeline's warm-up and cool-down, or while a peer is
still in its collective, the workers that compute run faster than that.

The engine prices each compute span once, in issue order, not in time order, so the
number of workers computing beside a span is only known once every rank has run: the
simulation is repeated, each compute span scaled by the share its node gave it in the
previous run (the time-average of share(k(t)) over the span, k(t) the node's workers
computing then, itself included), until the iteration time settles. A worker that waits
less than cluster.core_handover_s between two spans counts as computing through the wait:
so briefly blocked, it keeps its core. Taken as they come the factors overshoot (spans
that ran alone are priced fast, then overlap and are priced slow): each run takes the mean
of the previous factor and the new one, which settles in a few runs. A compute span can so
run faster than its price at share(all): bounds built on that price are scaled by
speedup_limit to stay bounds.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

from src.cluster import ClusterSpec

# Repeats of the simulation at most, and the change of iteration time that ends them.
MAX_PASSES = 16
SETTLED = 1e-4


@dataclass(frozen=True)
class ComputeSpan:
    """One compute instruction as simulated: its rank class, its place in the class's
    list, when it ran, and how many of the class's ranks each node holds."""

    key: tuple[int, int]
    start: float
    end: float
    per_node: tuple[tuple[int, int], ...]


def shares_cores(cluster: ClusterSpec) -> bool:
    """Whether the node's devices share compute (an oversubscription table below 1)."""
    return cluster.compute_share(cluster.devices_per_node) < 1.0


def speedup_limit(cluster: ClusterSpec) -> float:
    """The least factor a compute span's price can take here: share(all) over the best
    share of fewer workers (1 where no cores are shared). A bound on compute priced at
    share(all) stays a bound once multiplied by it."""
    everyone = cluster.compute_share(cluster.devices_per_node)
    return everyone / max(cluster.compute_share(k) for k in range(1, cluster.devices_per_node + 1))


class _NodeRate:
    """The share of the cores one computing worker of a node gets, integrated over time:
    F(t) = integral of share(k(u)) du where k(u) workers compute, so that a span's
    average share is (F(end) - F(start)) / (end - start)."""

    def __init__(self, cluster: ClusterSpec, changes: dict[float, int]) -> None:
        self.times: list[float] = []
        self.integral: list[float] = []
        self.rate: list[float] = []
        computing, total, last = 0, 0.0, None
        for t in sorted(changes):
            if last is not None:
                total += (t - last) * self.rate[-1]
            computing += changes[t]
            self.times.append(t)
            self.integral.append(total)
            self.rate.append(cluster.compute_share(computing) if computing > 0 else 1.0)
            last = t

    def at(self, t: float) -> float:
        i = bisect_right(self.times, t) - 1
        if i < 0:
            return 0.0
        return self.integral[i] + (t - self.times[i]) * self.rate[i]

    def mean(self, start: float, end: float) -> float:
        return (self.at(end) - self.at(start)) / (end - start)


def relaxed(previous: dict[tuple[int, int], float], new: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """The mean of each span's previous factor (1 before any) and its new one."""
    return {key: 0.5 * (previous.get(key, 1.0) + scale) for key, scale in new.items()}


def occupancy(spans: list[ComputeSpan], handover_s: float) -> list[ComputeSpan]:
    """The time each rank class holds its cores: its compute spans, joined across the
    waits between them shorter than `handover_s` (a worker blocked that briefly keeps its
    core; cluster.core_handover_s)."""
    held: list[ComputeSpan] = []
    for span in sorted((s for s in spans if s.end > s.start), key=lambda s: (s.key[0], s.start)):
        last = held[-1] if held else None
        if last is not None and last.key[0] == span.key[0] and span.start - last.end < handover_s:
            held[-1] = ComputeSpan(last.key, last.start, max(last.end, span.end), last.per_node)
        else:
            held.append(span)
    return held


def span_scales(cluster: ClusterSpec, spans: list[ComputeSpan]) -> dict[tuple[int, int], float]:
    """Each span's time relative to the compute model's price (which assumes every
    device of the node computes): share(all) over the share its node gave it, on the
    node that gave it the least."""
    changes: dict[int, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    for held in occupancy(spans, cluster.core_handover_s):
        for node, ranks in held.per_node:
            changes[node][held.start] += ranks
            changes[node][held.end] -= ranks
    rates = {node: _NodeRate(cluster, dict(c)) for node, c in changes.items()}
    everyone = cluster.compute_share(cluster.devices_per_node)
    scales = {}
    for span in spans:
        if span.end > span.start:
            share = min(rates[node].mean(span.start, span.end) for node, _ in span.per_node)
            scales[span.key] = everyone / share
    return scales
