"""DistTrain's disaggregated model orchestration (§5, Algorithm 1; ALGORITHMS.md §1.2-§1.5).

The encoder, the LLM and the generator are units on disjoint GPUs, each with its own TP,
DP and PP. The joint problem is not convex; for every choice of TP (1, 2, 4, 8 inside a
node) and DP (the LLM's a divisor of the batch, the encoder's and generator's divisors
of the LLM's, so a unit's micro-batch b_u = DP_lm / DP_u sequences is whole) the
remaining problem in the GPU counts (x, y, z) is convex, and is solved here exactly in
closed form:

    minimise  W + sum_u beta_u n_u + K max_u a_u / n_u
    s.t.      L_u <= n_u <= U_u,  sum_u n_u <= N

with W = sum_u F_u the warm-up (one micro-batch through every stage, F_u the unit's
forward+backward per micro-batch), a_u = F_u TP_u DP_u (a stage takes a_u / n_u),
beta_u n_u = PP_u times a boundary transfer (pipeline p2p), K = m - 1 for m = BS / DP_lm
micro-batches, L_u the fewest GPUs whose memory holds the unit (model states shard over
PP; with PP_u micro-batches in flight a stage keeps one micro-batch's activations per
TP rank), U_u the most (one block per stage).

Why the closed form is exact: for any feasible n let tau = max_u a_u / n_u; then
n'_u = max(L_u, a_u / tau) <= n_u is feasible, has the same maximum and costs no more
(beta >= 0). So the optimum is min over tau of the convex g(tau) = W + sum_u beta_u
max(L_u, a_u/tau) + K tau on tau >= tau_lo (the smallest tau whose n' fits N and U).
Between the breakpoints a_u / L_u, g = c + S/tau + K tau, minimised at sqrt(S/K); the
minimum of g is at tau_lo, a breakpoint, or such a stationary point, all evaluated.
Every sub-problem is solved at once with numpy.

Integer recovery (not in the surviving text; ours): PP_u = floor or ceil of n_u / (TP_u
DP_u) (within [1, blocks]), each of the eight roundings priced exactly: stages cut at
block boundaries with their own times, the 1F1B iteration sum(stages) + (m-1) max(stage)
+ p2p + the slowest gradient reduction, and every stage's memory with the micro-batches
the end-to-end 1F1B really keeps in flight there. Sub-problems are recovered in order of
their relaxed optimum until that bound exceeds the best exact time found (branch and
bound: the exact time of a choice is never below its relaxation).

The ratio-based baseline (`ratio`) fixes n_u in proportion to each unit's FLOPs and picks
the fastest TP/DP/PP within it the same way.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from src.cluster import GIB
from src.errors import ConfigError, PlanError
from src.metrics import unit_flops
from src.program import RECOMPUTE_MODES
from src.strategies.base import MAX_MICROBATCHES, check_microbatch_count, divisors
from src.strategies.disttrain.profile import Profiler

UNITS = ("encoder", "llm", "generator")
INF = float("inf")
# Branch and bound stops once the relaxed optimum of the next sub-problem is within this
# fraction of the best exact time: the choice is within 2% of the best recovered one.
TOLERANCE = 0.02


@dataclass(frozen=True)
class Fixed:
    """Degrees of one unit given by hand (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None


@dataclass(frozen=True)
class UnitChoice:
    unit: str
    tp: int
    dp: int
    pp: int
    recompute: str
    micro_batch: int

    @property
    def devices(self) -> int:
        return self.tp * self.dp * self.pp


@dataclass
class Orchestration:
    units: dict[str, UnitChoice]
    microbatches: int
    estimate_s: float
    relaxed_s: float
    search: dict = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return sum(u.devices for u in self.units.values())


@dataclass(frozen=True)
class _Option:
    """One unit at one (TP, DP, recompute) for one LLM DP: its relaxed coefficients."""

    tp: int
    dp: int
    recompute: str
    b: int
    F: float
    a: float
    low: float
    high: float
    beta: float


def _dominates(a: _Option, b: _Option) -> bool:
    return (
        a.F <= b.F
        and a.a <= b.a
        and a.low <= b.low
        and a.high >= b.high
        and a.beta <= b.beta
        and (a.F, a.a, a.low, a.high, a.beta) != (b.F, b.a, b.low, b.high, b.beta)
    )


class Orchestrator:
    def __init__(
        self,
        profiler: Profiler,
        batch: int,
        devices: int,
        fixed: dict[str, Fixed],
        recompute: str | None,
        mode: str,
        peak_load: dict[str, float] | None = None,
    ) -> None:
        """peak_load: the heaviest micro-batch's load per unit (data heterogeneity):
        memory is planned for its activations."""
        self.p, self.batch, self.N, self.fixed, self.mode = profiler, batch, devices, fixed, mode
        self.peak = peak_load or {u: 1.0 for u in UNITS}
        self.usable = profiler.cluster.usable_memory_bytes
        self.modes = RECOMPUTE_MODES if recompute is None else (recompute,)
        self.target = self._ratio_targets() if mode == "ratio" else {}
        self._summaries: dict[tuple, tuple] = {}
        self._limits: dict[tuple, float] = {}

    # ---- the search space --------------------------------------------------------------
    def _ratio_targets(self) -> dict[str, float]:
        """GPUs in proportion to each unit's FLOPs per iteration (the baseline of §8.2.1)."""
        model = self.p.model
        flops = {}
        for unit in UNITS:
            per_sample = unit_flops(model, model.unit(unit))
            flops[unit] = per_sample.fwd + per_sample.bwd
        total = sum(flops.values())
        return {u: self.N * f / total for u, f in flops.items()}

    def _tps(self, unit: str) -> list[int]:
        given = self.fixed[unit].tp
        allowed = self.p.tp_degrees(unit)
        if given is not None:
            if given not in allowed:
                raise ConfigError(f"strategy.{unit}.tp={given}: choose one of {allowed} (inside a node, dividing the unit's heads)")
            return [given]
        return allowed

    def llm_dps(self) -> list[int]:
        given = self.fixed["llm"].dp
        if given is not None:
            if self.batch % given:
                raise ConfigError(
                    f"strategy.llm.dp={given} does not divide the global batch {self.batch}: every LLM replica takes whole sequences"
                )
            check_microbatch_count(self.batch // given, 1, f"global batch {self.batch} over strategy.llm.dp={given}")
            return [given]
        # The LLM takes one sequence per micro-batch.
        return [dp for dp in divisors(self.batch) if self.batch // dp <= MAX_MICROBATCHES]

    def unit_dps(self, unit: str, dp_lm: int) -> list[int]:
        given = self.fixed[unit].dp
        if given is not None:
            return [given] if dp_lm % given == 0 else []
        return divisors(dp_lm)

    def _option(self, unit: str, tp: int, dp: int, b: int) -> _Option | None:
        """The cheapest recompute mode whose memory fits some PP of the unit; None if none."""
        blocks = self.p.blocks(unit)
        given_pp = self.fixed[unit].pp
        if tp * dp > self.N:
            return None
        for recompute in self.modes:
            # Activations grow linearly with b: skip what cannot fit before pricing it.
            if b * self.peak[unit] * self.p.whole(unit, tp, 1, recompute, dp).activations >= self.usable:
                continue
            cost = self.p.whole(unit, tp, b, recompute, dp)
            room = self.usable - self.peak[unit] * cost.activations
            if room <= 0:
                continue
            # Model states shard over PP: PP >= states / room (continuous).
            pp_low = max(1.0, cost.states / room)
            if pp_low > blocks:
                continue
            low, high = tp * dp * pp_low, float(tp * dp * blocks)
            if given_pp is not None:
                if given_pp < pp_low or given_pp > blocks:
                    continue
                low = high = float(tp * dp * given_pp)
            elif unit in self.target:
                pp = max(1, math.floor(self.target[unit] / (tp * dp)))
                if pp < pp_low or pp > blocks:
                    continue
                low = high = float(tp * dp * pp)
            beta = self.p.p2p(self.p.hop_bytes(unit, b)) / (tp * dp)
            return _Option(tp, dp, recompute, b, cost.fb, cost.fb * tp * dp, low, high, beta)
        return None

    def _options(self, unit: str, dp_lm: int) -> list[_Option]:
        """The unit's options at this LLM DP that no other option dominates (no worse in
        warm-up, stage coefficient, GPU bounds and p2p: its relaxed optimum can only be
        worse)."""
        out = []
        for tp in self._tps(unit):
            for dp in [dp_lm] if unit == "llm" else self.unit_dps(unit, dp_lm):
                b = 1 if unit == "llm" else dp_lm // dp
                option = self._option(unit, tp, dp, b)
                if option is not None:
                    out.append(option)
        return [o for o in out if not any(_dominates(other, o) for other in out if other is not o)]

    # ---- solve -----------------------------------------------------------------------------
    def solve(self) -> Orchestration:
        started = time.perf_counter()
        # Profiling (the paper's trial runs): every unit option's coefficients.
        spaces = [(dp_lm, {u: self._options(u, dp_lm) for u in UNITS}) for dp_lm in self.llm_dps()]
        spaces = [(dp_lm, options) for dp_lm, options in spaces if all(options.values())]
        profiled = time.perf_counter()
        blocks = []
        count = 0
        for dp_lm, options in spaces:
            values, taus = self._relax(options, self.batch // dp_lm - 1)
            blocks.append((dp_lm, options["encoder"], options["llm"], options["generator"], values, taus))
            count += values.size
        relaxed = time.perf_counter()
        best = self._recover(blocks) if blocks else None
        done = time.perf_counter()
        if best is None:
            raise self._no_plan()
        orchestration, recovered = best
        orchestration.search.update(
            {
                "orchestration": self.mode,
                "subproblems": count,
                "profile_s": profiled - started,
                "relax_s": relaxed - profiled,
                "recover_s": done - relaxed,
                "solve_s": done - profiled,
                "per_subproblem_us": 1e6 * (relaxed - profiled) / max(1, count),
                "recovered": recovered,
            }
        )
        return orchestration

    def _relax(self, options: dict[str, list[_Option]], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Closed-form optima of every (encoder, LLM, generator) option triple: relaxed
        times and taus, shaped (encoder options, LLM options, generator options)."""

        def column(unit: str, key: str) -> np.ndarray:
            return np.array([getattr(o, key) for o in options[unit]], dtype=float)

        shapes = [(-1, 1, 1), (1, -1, 1), (1, 1, -1)]
        a = [column(u, "a").reshape(s) for u, s in zip(UNITS, shapes)]
        low = [column(u, "low").reshape(s) for u, s in zip(UNITS, shapes)]
        high = [column(u, "high").reshape(s) for u, s in zip(UNITS, shapes)]
        beta = [column(u, "beta").reshape(s) for u, s in zip(UNITS, shapes)]
        warm = sum(column(u, "F").reshape(s) for u, s in zip(UNITS, shapes))
        full = np.broadcast_shapes(*(x.shape for x in a))
        a = [np.broadcast_to(x, full) for x in a]
        low = [np.broadcast_to(x, full) for x in low]
        high = [np.broadcast_to(x, full) for x in high]
        beta = [np.broadcast_to(x, full) for x in beta]
        return solve_relaxed(
            np.stack(a), np.stack(low), np.stack(high), np.stack(beta), np.broadcast_to(warm, full), float(k), float(self.N)
        )

    def _recover(self, blocks) -> tuple[Orchestration, int] | None:
        values = np.concatenate([b[4].ravel() for b in blocks])
        which = np.concatenate([np.full(b[4].size, i) for i, b in enumerate(blocks)])
        within = np.concatenate([np.arange(b[4].size) for b in blocks])
        finite = np.nonzero(np.isfinite(values))[0]
        order = finite[np.argsort(values[finite], kind="stable")]
        best: tuple[float, tuple[tuple, ...], int, float] | None = None
        recovered = 0
        for relaxed, index, flat in zip(values[order].tolist(), which[order].tolist(), within[order].tolist()):
            if best is not None and relaxed * (1 + TOLERANCE) >= best[0]:
                break
            dp_lm, enc, llm, gen, values, taus = blocks[index]
            e, l, g = np.unravel_index(flat, values.shape)
            m = self.batch // dp_lm
            picked, tau = (enc[e], llm[l], gen[g]), float(taus.flat[flat])
            if best is not None and self._llm_bound(picked, tau, m) * (1 + TOLERANCE) >= best[0]:
                continue
            recovered += 1
            found = self._round(picked, tau, m)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1], m, relaxed)
        if best is None:
            return None
        estimate, keys, m, relaxed = best
        units = {unit: UnitChoice(unit, tp, dp, pp, recompute, b) for unit, tp, dp, pp, recompute, b in keys}
        return Orchestration(units, m, estimate, relaxed), recovered

    def _llm_bound(self, picked: tuple[_Option, ...], tau: float, m: int) -> float:
        """A lower bound of every rounding of a sub-problem, cheaper than pricing them:
        the LLM's own exact share of the iteration (its stages, its slowest stage m-1
        more times, its p2p and gradient reduction) plus the encoder's and generator's
        warm-up."""
        keys = self._pp_keys("llm", picked[1], tau)
        own = min(s[0] + (m - 1) * s[1] + s[2] + s[3] for s in map(self._unit_summary, keys))
        return own + picked[0].F + picked[2].F

    def _pp_keys(self, unit: str, o: _Option, tau: float) -> list[tuple]:
        """The unit's floor and ceil roundings of its relaxed PP, keyed (unit, tp, dp, pp,
        recompute, micro-batch)."""
        n = max(o.low, o.a / tau) if tau > 0 else o.low
        pp, blocks = n / (o.tp * o.dp), self.p.blocks(unit)
        low, high = min(blocks, max(1, math.floor(pp + 1e-9))), min(blocks, max(1, math.ceil(pp - 1e-9)))
        keys = [(unit, o.tp, o.dp, low, o.recompute, o.b)]
        return keys if high == low else keys + [(unit, o.tp, o.dp, high, o.recompute, o.b)]

    def _round(self, picked: tuple[_Option, ...], tau: float, m: int) -> tuple[float, tuple[tuple, ...]] | None:
        """The best of the floor/ceil roundings of the relaxed PPs, priced exactly. A
        choice is keyed (unit, tp, dp, pp, recompute, micro-batch)."""
        best = None
        for keys in itertools.product(*(self._pp_keys(unit, o, tau) for unit, o in zip(UNITS, picked))):
            if sum(k[1] * k[2] * k[3] for k in keys) > self.N:
                continue
            estimate = self._time(keys, m)
            if estimate is not None and (best is None or estimate < best[0]):
                best = (estimate, keys)
        return best

    # ---- exact pricing of one integer choice ---------------------------------------------
    def exact(self, choices: dict[str, UnitChoice], m: int) -> float | None:
        return self._time(tuple((u, c.tp, c.dp, c.pp, c.recompute, c.micro_batch) for u, c in ((u, choices[u]) for u in UNITS)), m)

    def _time(self, keys: tuple[tuple, ...], m: int) -> float | None:
        """The 1F1B iteration time of an integer choice, or None if a stage does not fit:
        every micro-batch through every stage once, m-1 more at the slowest stage, the
        p2p transfers, and the slowest gradient reduction. Stage g of the end-to-end
        pipeline keeps min(depth - g, m) micro-batches in flight."""
        ke, kl, kg = keys
        e, l, g = self._unit_summary(ke), self._unit_summary(kl), self._unit_summary(kg)
        depth = ke[3] + kl[3] + kg[3]
        if depth > self._depth_limit(ke, m) or depth - ke[3] > self._depth_limit(kl, m) or kg[3] > self._depth_limit(kg, m):
            return None
        return e[0] + l[0] + g[0] + (m - 1) * max(e[1], l[1], g[1]) + e[2] + l[2] + g[2] + max(e[3], l[3], g[3])

    def _unit_summary(self, key: tuple) -> tuple[float, float, float, float, tuple[float, ...]]:
        """(sum of stage times, slowest stage, p2p, slowest gradient reduction, how many
        micro-batches each stage can keep in flight) of one unit's choice."""
        cached = self._summaries.get(key)
        if cached is None:
            unit, tp, dp, pp, recompute, b = key
            stages = self.p.stages(unit, tp, b, recompute, dp, pp)
            fb = stages.fb
            kept = stages.activations * self.peak[unit]
            with np.errstate(divide="ignore"):
                caps = np.where(kept > 0, (self.usable - stages.states) / kept, np.where(stages.states <= self.usable, INF, -INF))
            cached = self._summaries[key] = (
                float(fb.sum()),
                float(fb.max()),
                pp * self.p.p2p(self.p.hop_bytes(unit, b)),
                self.p.dp_reduce(float(stages.trainable.max()), dp),
                tuple(caps.tolist()),
            )
        return cached

    def _depth_limit(self, key: tuple, m: int) -> float:
        """The deepest pipeline (counted from the unit's first stage) whose in-flight
        micro-batches fit every stage of the unit: stage i keeps min(depth - i, m)."""
        cached = self._limits.get((key, m))
        if cached is None:
            cached = INF
            for i, cap in enumerate(self._unit_summary(key)[4]):
                if cap < 0:
                    cached = -INF
                    break
                if cap < m:
                    cached = min(cached, cap + i)
            self._limits[(key, m)] = cached
        return cached

    def memory_gib(self, choices: dict[str, UnitChoice], m: int) -> dict[str, float]:
        """Each unit's fullest GPU, as the orchestration estimates it."""
        depth = sum(c.pp for c in choices.values())
        out, offset = {}, 0
        for unit in UNITS:
            c = choices[unit]
            stages = self.p.stages(unit, c.tp, c.micro_batch, c.recompute, c.dp, c.pp)
            flight = np.minimum(depth - offset - np.arange(c.pp), m)
            out[unit] = float((stages.states + flight * self.peak[unit] * stages.activations).max()) / GIB
            offset += c.pp
        return out

    # ---- why nothing fits ----------------------------------------------------------------
    def _no_plan(self) -> ConfigError:
        """One line with the numbers: a unit no allocation holds, or too few GPUs."""
        usable = self.usable / GIB
        least: dict[str, float] = {}
        for unit in UNITS:
            fewest = INF
            closest = INF
            for tp in self._tps(unit):
                blocks = self.p.blocks(unit)
                for recompute in self.modes:
                    cost = self.p.whole(unit, tp, 1, recompute, 1)
                    kept = self.peak[unit] * cost.activations
                    need = cost.states / blocks + kept
                    closest = min(closest, need)
                    room = self.usable - kept
                    if room > 0 and cost.states / room <= blocks:
                        fewest = min(fewest, tp * max(1, math.ceil(cost.states / room)))
            if fewest == INF:
                return PlanError(
                    f"disttrain: unit {unit} fits no allocation: even at tp={max(self._tps(unit))} "
                    f"pp={self.p.blocks(unit)} (one block per stage) with {self.modes[-1]} recompute "
                    f"its fullest stage needs {closest / GIB:.1f} GiB for one sequence, a "
                    f"{self.p.cluster.device} has {usable:.1f} GiB usable"
                )
            least[unit] = fewest
        total = sum(least.values())
        if total > self.N:
            parts = ", ".join(f"{u} {int(n)}" for u, n in least.items())
            return PlanError(f"disttrain: {self.N} GPUs are fewer than the three units' minimum of {int(total)} ({parts})")
        fixed = ", ".join(f"{u}.{k}={v}" for u, f in self.fixed.items() for k, v in vars(f).items() if v is not None)
        return PlanError(
            f"disttrain: no orchestration of {self.p.model.name} fits {self.N} GPUs with global batch "
            f"{self.batch} (the LLM's DP must divide it, the encoder's and generator's the LLM's)"
            + (f" and the fixed degrees {fixed}" if fixed else "")
        )


def solve_relaxed(
    a: np.ndarray, low: np.ndarray, high: np.ndarray, beta: np.ndarray, warm: np.ndarray, k: float, n: float
) -> tuple[np.ndarray, np.ndarray]:
    """The closed-form optimum (module docstring) of many sub-problems at once. Arrays
    a, low, high, beta are (3, ...): one row per unit. Returns (optimal value, tau), inf
    where infeasible."""
    with np.errstate(divide="ignore", invalid="ignore"):
        feasible = (low.sum(axis=0) <= n + 1e-9) & np.all(low <= high + 1e-9, axis=0)
        breaks = a / low  # n_u = low_u for tau >= a_u / low_u
        order = np.argsort(-breaks, axis=0)  # descending breakpoints
        bp = np.take_along_axis(breaks, order, axis=0)
        a_s = np.take_along_axis(a, order, axis=0)
        low_s = np.take_along_axis(low, order, axis=0)
        ba_s = np.take_along_axis(beta * a, order, axis=0)
        zero = np.zeros_like(a[:1])
        top_a = np.concatenate([zero, np.cumsum(a_s, axis=0)])  # S_k: sum of a over the k active units
        rest_low = low_s.sum(axis=0, keepdims=True) - np.concatenate([zero, np.cumsum(low_s, axis=0)])
        top_ba = np.concatenate([zero, np.cumsum(ba_s, axis=0)])
        upper = np.concatenate([np.full_like(zero, INF), bp])  # piece k: [bp_(k+1), bp_(k))
        lower = np.concatenate([bp, zero])
        # tau_N: the smallest tau with sum_u max(low_u, a_u / tau) <= n, piece by piece.
        cross = np.where(n - rest_low > 1e-12, top_a / (n - rest_low), INF)
        start = np.maximum(cross, lower)
        start = np.where(start < upper * (1 + 1e-12), start, INF)
        tau_lo = np.maximum(start.min(axis=0), (a / high).max(axis=0))
        # Candidates: tau_lo, every breakpoint, every piece's stationary point sqrt(S_beta / K).
        stationary = np.sqrt(top_ba / k) if k > 0 else np.broadcast_to(bp[:1], top_ba.shape)
        candidates = np.concatenate([tau_lo[None], bp, stationary])
        candidates = np.maximum(candidates, tau_lo[None])
        counts = np.maximum(low[None], a[None] / candidates[:, None])
        values = warm[None] + (beta[None] * counts).sum(axis=1) + k * candidates
        best = values.argmin(axis=0)
        value = np.take_along_axis(values, best[None], axis=0)[0]
        tau = np.take_along_axis(candidates, best[None], axis=0)[0]
        ok = feasible & np.isfinite(tau_lo) & np.isfinite(value)
        return np.where(ok, value, INF), np.where(ok, tau, INF)
