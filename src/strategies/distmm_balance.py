"""DistMM's data load balancer (§5.2): how many devices each tower gets, hence its
replicas and per-replica batch, so that the slowest tower is as fast as possible.

The problem has optimal substructure (the best plan for towers 1..k on n devices extends
a best plan for towers 1..k-1 on fewer devices), and DistMM solves it by dynamic
programming. The recurrence (ALGORITHMS.md §2.2, reconstructed):

    OPT[0][n] = 0
    OPT[k][n] = min over feasible n_k <= n of max(OPT[k-1][n - n_k], T_k(n_k))

over each tower's feasible choices (device count n_k, time T_k). As reconstructed, the
base case OPT[0][n] = 0 for every n lets devices stay unused. With `fill`, only
OPT[0][0] = 0 (each row then says what the towers achieve on exactly n devices) and the
answer is the largest n the towers can fill, all N whenever replica counts allow: the
towers share out the whole cluster, as in the paper's examples (Figure 2; CoCa's 16 + 48
of 64 GPUs, §7.2.2). Cost O(K · N · choices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

Payload = TypeVar("Payload")
INF = float("inf")


@dataclass(frozen=True)
class Choice(Generic[Payload]):
    """One feasible size of one tower: its devices, its time, what it stands for."""

    devices: int
    time: float
    payload: Payload


def _min_max(choices: Sequence[Sequence[Choice[Payload]]], devices: int, exact: bool) -> list[float]:
    """OPT[K][n] for n = 0..devices: the least possible time of the slowest tower."""
    opt = [0.0 if n == 0 or not exact else INF for n in range(devices + 1)]
    for options in choices:
        opt = [min((max(opt[n - c.devices], c.time) for c in options if c.devices <= n), default=INF)
               for n in range(devices + 1)]
    return opt


def balance(choices: Sequence[Sequence[Choice[Payload]]], devices: int,
            fill: bool = False) -> list[Choice[Payload]] | None:
    """One choice per tower minimising the slowest tower's time on at most `devices`
    devices (with `fill`: on exactly the most devices some choices add up to); None if
    no combination fits.

    Many combinations share that optimum (the slowest tower is the same in all of them),
    so a second pass of the same dynamic program keeps every tower at or under it and
    minimises the towers' summed time, then the devices used: towers that are not the
    bottleneck still get the devices that make them faster instead of leaving them idle.
    """
    row = _min_max(choices, devices, fill)
    if fill:
        devices = max((n for n, t in enumerate(row) if t < INF), default=0)
    bound = row[devices]
    if bound == INF:
        return None
    # best[n] = ((summed time, devices used), picks) on n devices (at most n unless fill).
    best: list[tuple[tuple[float, int], tuple[int, ...]]] = [
        ((0.0 if n == 0 or not fill else INF, 0), ()) for n in range(devices + 1)]
    for options in choices:
        nxt: list[tuple[tuple[float, int], tuple[int, ...]]] = [((INF, 0), ())] * (devices + 1)
        for n in range(devices + 1):
            for index, choice in enumerate(options):
                if choice.devices > n or choice.time > bound:
                    continue
                (summed, used), picks = best[n - choice.devices]
                if summed == INF:
                    continue
                key = (summed + choice.time, used + choice.devices)
                if key < nxt[n][0]:
                    nxt[n] = (key, picks + (index,))
        best = nxt
    return [options[i] for options, i in zip(choices, best[devices][1])]
