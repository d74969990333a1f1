"""DistMM's data load balancer (§5.2): how many devices each tower gets, hence its
replicas and per-replica batch, so that the aligned iteration is as fast as possible.

The towers do not run independently: at every batch-sync each waits for the other's
features and for the gradients the other returns (§5.4: "schedules of different modal
submodules are aligned at the batch-sync points"). A tower's time is therefore cut into
phases that the towers share out in lockstep (distmm.towers.TowerCosts.phases): the work
before the first batch-sync, the batch-sync itself, the work between two batch-syncs and
the work after the last one. The iteration is

    sum over phases j of  weight_j * max over towers k of phase_k[j]

(the weights count a phase's repetitions: g batch-syncs, g - 1 periods between them).
Minimising each tower's own time (the sum of its phases) instead lets a tower that is
slow before the barrier and idle after it (LiT's frozen tower: forward only, no gradient
reduction) look as fast as one that is quick before it and slow after it (the trained
tower's backward and gradient reduction), while in the aligned run both wait for the
other's slow phase.

The paper states the optimal-substructure property and a dynamic program over towers and
devices (§5.2). With one phase (weight 1) the objective is its recurrence,
OPT[k][n] = min over n_k of max(OPT[k-1][n - n_k], T_k(n_k)). With several phases a
single number per (k, n) no longer suffices, since the best plan for towers 1..k-1 depends
on which phase tower k will dominate; the program keeps instead, per (k, n), the Pareto
front of the phase maxima of towers 1..k (with their summed time for the tie-break): a
plan dominated in every phase can never beat the one dominating it. Exact, and equal to
brute force over every combination; the fronts stay small because a tower has as many
choices as the divisors of the batch within the cluster.

`fill`: only combinations using the most devices some choices add up to (all N whenever
replica counts allow) compete: the towers share out the whole cluster, as in the paper's
examples (Figure 2; CoCa's 16 + 48 of 64 GPUs, §7.2.2). Without it, any total up to N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

Payload = TypeVar("Payload")


@dataclass(frozen=True)
class Choice(Generic[Payload]):
    """One feasible size of one tower: its devices, its time in phases (what the towers
    align on; weighted by the balancer's weights, their sum is the tower's own time),
    what it stands for."""

    devices: int
    phases: tuple[float, ...]
    payload: Payload


@dataclass(frozen=True)
class _Partial:
    """A combination of choices for the first towers: the phase maxima, the summed
    weighted time of its towers (the tie-break) and the picks."""

    maxima: tuple[float, ...]
    summed: float
    picks: tuple[int, ...]

    def dominates(self, other: "_Partial") -> bool:
        return self.summed <= other.summed and all(a <= b for a, b in zip(self.maxima, other.maxima))


def aligned_time(phases: Sequence[Sequence[float]], weights: Sequence[float]) -> float:
    """The iteration of towers with these phases aligned at every batch-sync."""
    return sum(w * max(p[j] for p in phases) for j, w in enumerate(weights))


def own_time(choice: Choice[Payload], weights: Sequence[float]) -> float:
    """The tower's time alone (no waiting on the other towers)."""
    return sum(w * p for w, p in zip(weights, choice.phases))


def _front(partials: list[_Partial]) -> list[_Partial]:
    """The partials no other one dominates (one of each set of equal ones)."""
    kept: list[_Partial] = []
    for p in sorted(partials, key=lambda p: (p.summed, p.maxima)):
        if not any(k.dominates(p) for k in kept):
            kept.append(p)
    return kept


def balance(
    choices: Sequence[Sequence[Choice[Payload]]], devices: int, weights: Sequence[float] = (1.0,), fill: bool = False
) -> list[Choice[Payload]] | None:
    """One choice per tower minimising the aligned iteration (`aligned_time`) on at most
    `devices` devices (with `fill`: on exactly the most devices some choices add up to);
    None if no combination fits. Ties go to the least summed time of the towers (towers
    that are not the bottleneck still get the devices that make them faster instead of
    leaving them idle), then to the fewest devices."""
    phases = len(weights)
    if any(len(c.phases) != phases for options in choices for c in options):
        raise ValueError(f"every choice needs {phases} phases, one per weight")
    # fronts[n]: the Pareto front of combinations of the towers so far on exactly n devices.
    fronts: dict[int, list[_Partial]] = {0: [_Partial((0.0,) * phases, 0.0, ())]}
    for options in choices:
        grown: dict[int, list[_Partial]] = {}
        for n, front in fronts.items():
            for index, choice in enumerate(options):
                total = n + choice.devices
                if total > devices:
                    continue
                extra = own_time(choice, weights)
                grown.setdefault(total, []).extend(
                    _Partial(tuple(max(a, b) for a, b in zip(p.maxima, choice.phases)), p.summed + extra, p.picks + (index,))
                    for p in front
                )
        fronts = {n: _front(partials) for n, partials in grown.items()}
    if not fronts:
        return None
    totals = [max(fronts)] if fill else sorted(fronts)

    def key(item: tuple[int, _Partial]) -> tuple[float, float, int]:
        n, p = item
        return sum(w * m for w, m in zip(weights, p.maxima)), p.summed, n

    _, best = min(((n, p) for n in totals for p in fronts[n]), key=key)
    return [options[i] for options, i in zip(choices, best.picks)]
