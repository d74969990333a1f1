"""DistTrain's disaggregated model orchestration (§5, Algorithm 1; docs/strategies.md, DistTrain).

The encoder, the LLM and the generator are units on disjoint GPUs, each with its own TP,
DP and PP and Megatron-LM's options (profile.Setting: sequence parallelism, the
pipeline's scatter/gather, the distributed optimizer, recomputation). The joint problem
is not convex; for every choice of TP (1, 2, 4, 8 inside a node), options and DP (the
LLM's a divisor of the batch, the encoder's and generator's divisors of the LLM's, so a
unit's micro-batch b_u = DP_lm / DP_u sequences is whole) the remaining problem in the
GPU counts (x, y, z) is convex, and is solved here exactly in closed form:

    minimise  W + sum_u beta_u n_u + K max_u a_u / n_u  (+ the LLM's tail, relaxation.py)
    s.t.      L_u <= n_u <= U_u,  sum_u n_u <= N

with W = sum_u F_u the warm-up (one micro-batch through every stage, F_u the unit's
forward+backward per micro-batch), a_u = F_u TP_u DP_u (a stage takes a_u / n_u),
beta_u n_u = PP_u times a boundary's transfers there and back (pipeline p2p), K = m - 1
for m = BS / DP_lm micro-batches, L_u the fewest GPUs whose memory holds the unit (model
states shard over PP; with PP_u micro-batches in flight a stage keeps one micro-batch's
activations per TP rank), U_u the most (one block per stage). A unit's options that no
other option beats in every coefficient are kept; the relaxation picks among them.

Why the closed form is exact: for any feasible n let tau = max_u a_u / n_u; then
n'_u = max(L_u, a_u / tau) <= n_u is feasible, has the same maximum and costs no more
(beta >= 0). So the optimum is min over tau of the convex g(tau) = W + sum_u beta_u
max(L_u, a_u/tau) + K tau on tau >= tau_lo (the smallest tau whose n' fits N and U).
Between the breakpoints a_u / L_u, g = c + S/tau + K tau, minimised at sqrt(S/K); the
minimum of g is at tau_lo, a breakpoint, or such a stationary point, all evaluated
(relaxation.py, with numpy, as far as the recovery below reaches: a bound of every
sub-problem's optimum, a few array operations each, spares the closed form of those it
shows the recovery would never reach).

Integer recovery (not in the surviving text; ours): PP_u = floor or ceil of n_u / (TP_u
DP_u) (within [1, blocks]), each rounding priced by the 1F1B model of `pipeline_time`:
each unit at the lightest recomputation whose stages hold what they keep in flight (the
relaxation sees one micro-batch a stage; a deeper pipeline keeps more at the units ahead
of the LLM), the first micro-batch there and back (every stage, every transfer), m - 1 more periods
of the steady state (its slowest stage, or the round trip a stage's in-flight
micro-batches must cover: 1F1B keeps depth - g of them at stage g), and the stage that
ends last with its gradient reduction; and every stage's memory with the micro-batches
the end-to-end 1F1B really keeps in flight there. Sub-problems are recovered in order of
their relaxed optimum until that bound exceeds the `keep`-th best time found (branch and
bound: the time of a choice is never below its relaxation; a rounding whose least time,
from its units alone, reaches that time is not priced), and the best `keep` choices are
returned, best first: the planner times them against the batch's data (timing.py)
and simulates the fastest.

The ratio-based baseline (`ratio`) gives each unit at most its FLOPs' share of the GPUs
(rounded, at least one: §8.2.1, "allocates GPUs according to the computational demands
(flops) of each module") and picks the fastest TP/DP/PP within it the same way.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from src.cluster import GIB, gib
from src.config import check_positive
from src.errors import ConfigError, PlanError
from src.metrics import unit_flops
from src.program import RECOMPUTE_MODES
from src.strategies.base import MAX_MICROBATCHES, Degrees, check_microbatch_count, divisors
from src.strategies.disttrain.profile import BrokerEnd, Profiler, Setting, StageArrays
from src.strategies.disttrain.relaxation import ROUNDING, RelaxedOption, Subproblems, undominated
from src.schedules.chain import Chain, Deadlock, chain_orders

UNITS = ("encoder", "llm", "generator")
INF = float("inf")
# Branch and bound stops once the relaxed optimum of the next sub-problem is within this
# fraction of the `keep`-th best time: the choices kept are within 2% of the best ones.
TOLERANCE = 0.02
MAX_VPPS = 3  # interleavings of the LLM offered per choice


@dataclass(frozen=True)
class Fixed:
    """A unit's degrees and options given by hand (strategy.encoder, .llm, .generator; None:
    searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    vpp: int | None = None  # virtual stages per pipeline stage (interleaved 1F1B)
    recompute: str | None = None
    zero_stage: int | None = None
    sequence_parallel: bool | None = None
    # Pipeline sends of 1/tp per TP rank plus a TP all-gather (the real backend needs rows tp divides).
    scatter_gather: bool | None = None

    def check(self, where: str) -> None:
        """`where`: the options' place in the config (strategy.llm), for the message."""
        for key in ("tp", "pp", "dp", "vpp"):
            check_positive(f"{where}.{key}", getattr(self, key), optional=True)
        for key in ("sequence_parallel", "scatter_gather"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{where}.{key} must be true, false or null, got {value!r}")
        if self.recompute not in (None, *RECOMPUTE_MODES):
            raise ConfigError(f"{where}.recompute={self.recompute!r}; choose one of {list(RECOMPUTE_MODES)} or null")
        if self.zero_stage not in (None, 0, 1):
            raise ConfigError(f"{where}.zero_stage={self.zero_stage!r}: 0, 1 (Megatron-LM's distributed optimizer) or null")


@dataclass(frozen=True)
class UnitChoice:
    unit: str
    dp: int
    pp: int
    micro_batch: int
    setting: Setting

    @property
    def tp(self) -> int:
        return self.setting.tp

    @property
    def recompute(self) -> str:
        return self.setting.recompute

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.tp, self.pp, self.dp, self.setting.vpp, self.micro_batch)

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp  # Degrees.devices, without building one per rounding

    def describe(self) -> str:
        return f"{self.unit} dp={self.dp} pp={self.pp} {self.setting.describe()}"


Choice = tuple[UnitChoice, UnitChoice, UnitChoice]


def broker_end(c: UnitChoice) -> BrokerEnd:
    """The unit's side of a hand-off, as the profile prices it."""
    return (c.unit, c.tp, c.dp, c.micro_batch, c.setting.replicated)


@dataclass(frozen=True)
class _Summary:
    """What the 1F1B model reads of one unit's choice, per pipeline stage, and what
    `pipeline_time` makes of the unit's stages alone (for `Orchestrator.least_time`)."""

    fb: list[float]
    bwd: list[float]
    tail: list[float]
    trips: list[float]  # a micro-batch's hops between its stages, there and back
    caps: list[float]  # micro-batches in flight each stage's memory holds
    way: float  # the first micro-batch through the unit's stages and hops, there and back
    slowest: float  # its slowest stage's forward and backward
    end: float  # the latest of its stages' tails, less the backwards and hops before them in the unit
    drain: float  # the backwards and hops of all its stages

    @classmethod
    def of(cls, fb: list[float], bwd: list[float], tail: list[float], trips: list[float], caps: list[float], vpp: int) -> _Summary:
        pp = len(fb)
        before, end = 0.0, -INF
        for j in range(pp):
            end = max(end, tail[j] - before)
            before += bwd[j] / vpp + (trips[j] / 2 if j < pp - 1 else 0.0)
        return cls(fb, bwd, tail, trips, caps, sum(fb) / vpp + sum(trips[: pp - 1]), max(fb), end, before)

    def depth_limit(self, m: int) -> float:
        """The deepest pipeline (counted from the unit's first stage) whose in-flight
        micro-batches fit every stage of the unit: stage i keeps min(depth - i, m)."""
        limit = INF
        for i, cap in enumerate(self.caps):
            if cap < 0:
                return -INF
            if cap < m:
                limit = min(limit, cap + i)
        return limit


@dataclass
class Orchestration:
    """The recovered choices, best first by the 1F1B model, with their model times."""

    choices: list[tuple[float, Choice]]
    microbatches: dict[Choice, int]
    relaxed_s: float
    search: dict = field(default_factory=dict)
    # Joined with a search without distinct shapes: the choices that one keeps, best first.
    alone: tuple[Choice, ...] = ()

    @property
    def best(self) -> Choice:
        return self.choices[0][1]

    def joined(self, other: Orchestration) -> Orchestration:
        """Both searches' choices, best first (this one's search record), `other`'s kept as
        `alone`."""
        times = dict((c, t) for t, c in other.choices) | dict((c, t) for t, c in self.choices)
        choices = sorted(((t, c) for c, t in times.items()), key=lambda x: x[0])
        relaxed = min(self.relaxed_s, other.relaxed_s)
        return Orchestration(choices, other.microbatches | self.microbatches, relaxed, self.search, tuple(c for _, c in other.choices))


class Orchestrator:
    def __init__(
        self,
        profiler: Profiler,
        batch: int,
        devices: int,
        fixed: dict[str, Fixed],
        mode: str,
        peak_load: dict[str, float] | None = None,
        keep: int = 1,
        shapes: int | None = None,
        replicate: tuple[str, ...] = (),
    ) -> None:
        """peak_load: the heaviest micro-batch's load per unit (data heterogeneity):
        memory is planned for its activations. keep: how many of the best integer
        choices to return; shapes: beside them, the best choice of each of this many best
        distinct LLM shapes (the best few can be near-copies of one LLM shape, differing only
        in the encoder's plan, which the data's skew slows alike), and the best `keep` as a
        search without shapes finds them. replicate: the units whose TP group replicates
        them (profile.Setting.replicated) instead of splitting them."""
        self.p, self.batch, self.N, self.fixed, self.mode = profiler, batch, devices, fixed, mode
        self.replicate = replicate
        self.peak = peak_load or {u: 1.0 for u in UNITS}
        self.usable = profiler.cluster.usable_memory_bytes
        self.keep, self.shapes = keep, shapes
        self.target = self._ratio_targets() if mode == "ratio" else {}
        self._summaries: dict[UnitChoice, _Summary] = {}
        self._choices: dict[tuple, list[UnitChoice]] = {}
        for unit, f in fixed.items():
            self._check_interleaving(unit, f)
        self.bases: dict[tuple, RelaxedOption | None] = {}

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
        allowed = self.p.tp_degrees(unit, unit in self.replicate)
        if given is not None:
            if given not in allowed:
                why = "inside a node" if unit in self.replicate else "inside a node, dividing the unit's heads"
                raise ConfigError(f"strategy.{unit}.tp={given}: choose one of {allowed} ({why})")
            allowed = [given]
        if self.fixed[unit].sequence_parallel and unit not in self.replicate:
            split = [t for t in allowed if self._splits_sequence(unit, t)]
            if len(split) < len(allowed) and max(split, default=1) == 1:
                raise ConfigError(
                    f"strategy.{unit}.sequence_parallel=true splits {unit}'s {self.p.model.unit(unit).seq_len} tokens "
                    f"evenly over TP (as Megatron-LM does), which no TP degree of {allowed} above 1 divides: set "
                    f"strategy.{unit}.sequence_parallel=false"
                )
            allowed = split
        return allowed

    def _splits_sequence(self, unit: str, tp: int) -> bool:
        """Whether Megatron-LM's sequence parallelism can split the unit's sequence over `tp`
        ranks: evenly (Megatron-Core's split along the sequence asserts it divides), a
        transformer's (a U-Net's has nothing to split)."""
        spec = self.p.model.unit(unit)
        return tp == 1 or spec.kind != "transformer" or spec.seq_len % tp == 0

    def settings(self, unit: str, tp: int, dp: int) -> list[Setting]:
        """Megatron-LM's options of a unit at this TP and DP, the given ones fixed. Sequence
        parallelism and scatter/gather change nothing without TP (Megatron-LM turns them
        off), and sequence parallelism needs a sequence TP divides (a ViT's 257 tokens: none
        does), the distributed optimizer nothing without DP (a single replica keeps
        ZeRO-1's whole shard). A unit replicated over its TP group splits nothing: its
        data-parallel replicas are its DP times its TP group's GPUs."""
        f = self.fixed[unit]
        modes = RECOMPUTE_MODES if f.recompute is None else (f.recompute,)
        if unit in self.replicate and tp > 1:
            if (f.pp or 1) > 1 or (f.vpp or 1) > 1:
                return []  # pipelined by hand: the unit runs at tp 1, where nothing is replicated
            zeros = [f.zero_stage] if f.zero_stage is not None else [0, 1]
            return [Setting(tp, recompute, False, zero, replicated=True) for recompute, zero in itertools.product(modes, zeros)]
        if tp == 1 or not self._splits_sequence(unit, tp):
            sps = [False]
        else:
            sps = [False, True] if f.sequence_parallel is None else [f.sequence_parallel]
        zeros = [f.zero_stage] if f.zero_stage is not None else ([0, 1] if dp > 1 else [1])
        out = []
        for recompute, sp, zero in itertools.product(modes, sps, zeros):
            sgs = [True] if tp == 1 or sp else [True, False] if f.scatter_gather is None else [f.scatter_gather]
            out += [Setting(tp, recompute, sp, zero, sg) for sg in sgs]
        return out

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

    def _option(self, unit: str, setting: Setting, dp: int, b: int) -> RelaxedOption | None:
        """The unit under these options if its memory fits some PP; None if none."""
        base = self._base(unit, setting, dp, b)
        if base is None:
            return None
        pp_low, blocks = base.low / (setting.tp * dp), self.p.blocks(unit)
        given_pp = self.fixed[unit].pp
        if setting.replicated:  # the whole unit on each GPU: one stage
            gpus = setting.tp * dp
            if pp_low > 1 + 1e-9 or (unit in self.target and max(1, round(self.target[unit])) < gpus):
                return None
            return replace(base, low=float(gpus), high=float(gpus))
        if given_pp is not None:
            if given_pp < pp_low or given_pp > blocks:
                return None
            return replace(base, low=float(setting.tp * dp * given_pp), high=float(setting.tp * dp * given_pp))
        if unit in self.target:
            # At most the unit's FLOPs share of the GPUs (at least one GPU): its TP x DP x PP
            # cannot exceed it, whatever DP the LLM's replicas would give the unit otherwise.
            pp = math.floor(max(1, round(self.target[unit])) / (setting.tp * dp))
            if pp < 1 or pp < pp_low or pp > blocks:
                return None
            return replace(base, low=float(setting.tp * dp * pp), high=float(setting.tp * dp * pp))
        return base

    def _base(self, unit: str, setting: Setting, dp: int, b: int) -> RelaxedOption | None:
        """The unit's relaxed coefficients under these options, any PP from the fewest
        stages that hold it to one block per stage; None if no PP holds it. Shared by the
        orchestrations of one request (the ratio baseline's restricts its GPUs)."""
        key = (unit, setting, dp, b)
        if key in self.bases:
            return self.bases[key]
        self.bases[key] = None
        blocks = self.p.blocks(unit)
        tp = setting.tp
        if tp * dp > self.N:
            return None
        # Activations grow linearly with b: skip what cannot fit before pricing it.
        one = self.p.whole(unit, setting, 1, dp)
        if b * self.peak[unit] * float(one.kept[0] + one.transient[0]) >= self.usable:
            return None
        cost = self.p.whole(unit, setting, b, dp)
        room = self.usable - self.peak[unit] * float(cost.kept[0] + cost.transient[0])
        if room <= 0:
            return None
        # Model states shard over PP: PP >= states / room (continuous).
        pp_low = max(1.0, float(cost.states[0]) / room)
        if pp_low > blocks:
            return None
        fb = float(cost.fb[0])
        beta = 2 * self.p.hop(unit, setting, b, dp) / (tp * dp)
        option = RelaxedOption(setting, dp, b, fb, fb * tp * dp, tp * dp * pp_low, float(tp * dp * blocks), beta, float(cost.tail[0]))
        self.bases[key] = option
        return option

    def _options(self, unit: str, dp_lm: int) -> list[RelaxedOption]:
        out = []
        for tp in self._tps(unit):
            for dp in [dp_lm] if unit == "llm" else self.unit_dps(unit, dp_lm):
                b = 1 if unit == "llm" else dp_lm // dp
                fitted: set[tuple] = set()
                for setting in self.settings(unit, tp, dp):
                    # More recomputation only adds compute once the fewest stages allowed hold
                    # the unit (an option it leaves is dominated).
                    rest = (setting.sequence_parallel, setting.zero_stage, setting.scatter_gather)
                    if rest in fitted:
                        continue
                    option = self._option(unit, setting, dp, b)
                    if option is not None:
                        out.append(option)
                        if option.low <= max(tp * dp, option.high - 1e-9):
                            fitted.add(rest)
        return undominated(out)

    def with_mode(self, mode: str, keep: int) -> Orchestrator:
        """The same request orchestrated another way, sharing what is priced (the options'
        bases, the integer choices and their summaries depend on neither)."""
        other = Orchestrator(self.p, self.batch, self.N, self.fixed, mode, self.peak, keep, replicate=self.replicate)
        other.bases, other._choices, other._summaries = self.bases, self._choices, self._summaries
        return other

    # ---- solve -----------------------------------------------------------------------------
    def solve(self) -> Orchestration:
        started, cpu = time.perf_counter(), time.process_time()
        # Profiling (the paper's trial runs): every unit option's coefficients.
        spaces = [(dp_lm, [self._options(u, dp_lm) for u in UNITS]) for dp_lm in self.llm_dps()]
        spaces = [(dp_lm, options) for dp_lm, options in spaces if all(options)]
        profiled, profiled_cpu = time.perf_counter(), time.process_time()
        subproblems = Subproblems(spaces, self.batch, float(self.N)) if spaces else None
        bounded = time.perf_counter()
        found = self._recover(subproblems) if subproblems else None
        if found is not None and subproblems is not None and self.shapes:
            # The shapes' looser bar keeps other best `keep` than the search for them alone
            # prunes to: both sets are returned, so asking for shapes drops none of the latter.
            alone = self.with_mode(self.mode, self.keep)._recover(subproblems)
            found = found if alone is None else found.joined(alone)
        done, done_cpu = time.perf_counter(), time.process_time()
        if found is None or subproblems is None:
            raise self._no_plan()
        found.search.update(
            {
                "orchestration": self.mode,
                "subproblems": subproblems.count,
                "solved": subproblems.solved,
                "profile_s": profiled - started,
                "bound_s": bounded - profiled,
                "recover_s": done - bounded,
                "solve_s": done - profiled,
                "profile_cpu_s": profiled_cpu - cpu,
                "solve_cpu_s": done_cpu - profiled_cpu,
            }
        )
        return found

    def _recover(self, subproblems: Subproblems) -> Orchestration | None:
        kept: list[tuple[float, int, Choice]] = []  # a max-heap of the best `keep` by (-time)
        shaped: dict[UnitChoice, tuple[float, int, Choice]] = {}  # the best choice per LLM shape
        seen: set[Choice] = set()
        microbatches: dict[Choice, int] = {}
        recovered, best_relaxed = 0, INF
        for relaxed, index, tau in subproblems.in_order():
            # A choice at `bar` or slower can join neither the best `keep` nor the best shapes.
            bar = -kept[0][0] if len(kept) == self.keep else INF
            if self.shapes:
                bar = max(bar, max(t for t, _, _ in shaped.values()) if len(shaped) == self.shapes else INF)
            if relaxed * (1 + TOLERANCE) >= bar:
                break
            dp_lm, picked = subproblems.locate(index)
            m = self.batch // dp_lm
            if self._llm_bound(picked, tau, m) * (1 + TOLERANCE) >= bar:
                continue
            recovered += 1
            best_relaxed = min(best_relaxed, relaxed)
            # A choice left unpriced takes `bar` or more: it could never be kept (bar only falls).
            for estimate, choice in self._roundings(picked, tau, m, bar):
                if choice in seen:
                    continue
                seen.add(choice)
                microbatches[choice] = m
                entry = (-estimate, -len(seen), choice)
                if len(kept) < self.keep:
                    heapq.heappush(kept, entry)
                elif entry > kept[0]:
                    heapq.heapreplace(kept, entry)
                if self.shapes and (choice[1] not in shaped or estimate < shaped[choice[1]][0]):
                    shaped[choice[1]] = (estimate, len(seen), choice)
                    if len(shaped) > self.shapes:
                        del shaped[max(shaped, key=lambda shape: shaped[shape][:2])]
        if not kept:
            return None
        found = {c: -t for t, _, c in kept} | {c: t for t, _, c in shaped.values()}
        ranked = sorted(((t, c) for c, t in found.items()), key=lambda x: x[0])
        return Orchestration(ranked, {c: microbatches[c] for _, c in ranked}, best_relaxed, {"recovered": recovered})

    def _llm_bound(self, picked: tuple[RelaxedOption, ...], tau: float, m: int) -> float:
        """A lower bound of every rounding of a sub-problem, cheaper than pricing them:
        the LLM's own stages and hops (all of them once there and back, its slowest stage
        m-1 more times) and its first stage's tail, which its last backward starts no
        earlier than the encoder's backward before it ends, plus the encoder's and
        generator's warm-up."""
        bound = INF
        for choice in self._pp_choices("llm", picked[1], tau, m):
            summary = self.summary(choice)
            bound = min(bound, summary.way + (m - 1) * summary.slowest + max(0.0, summary.tail[0] - picked[0].F))
        return bound + picked[0].F + picked[2].F

    def _pp_choices(self, unit: str, o: RelaxedOption, tau: float, m: int) -> list[UnitChoice]:
        """The unit's floor and ceil roundings of its relaxed PP, each with every
        interleaving Megatron-LM runs there (self.vpps)."""
        n = max(o.low, o.a / tau) if tau > 0 else o.low
        pp, blocks = n / (o.setting.tp * o.dp), self.p.blocks(unit)
        low, high = min(blocks, max(1, math.floor(pp + 1e-9))), min(blocks, max(1, math.ceil(pp - 1e-9)))
        return [choice for p in sorted({low, high}) for choice in self._at_pp(unit, o, p, m)]

    def _at_pp(self, unit: str, o: RelaxedOption, pp: int, m: int) -> list[UnitChoice]:
        """The unit's option on pp stages, with every interleaving Megatron-LM runs there;
        kept, as the sub-problems that share the option round it to the same PPs."""
        key = (unit, o.setting, o.dp, o.b, pp, m)
        found = self._choices.get(key)
        if found is None:
            settings = [o.setting if v == o.setting.vpp else replace(o.setting, vpp=v) for v in self.vpps(unit, pp, m)]
            found = self._choices[key] = [UnitChoice(unit, o.dp, pp, o.b, setting) for setting in settings]
        return found

    def _check_interleaving(self, unit: str, f: Fixed) -> None:
        """A given interleaving needs two stages or more of vpp chunks, a block each at least."""
        if f.vpp is None or f.vpp == 1:
            return
        blocks, least = self.p.blocks(unit), max(2, f.pp or 2)
        if f.pp == 1 or least * f.vpp > blocks:
            raise ConfigError(
                f"strategy.{unit}.vpp={f.vpp}: interleaving takes pp >= 2 stages of {f.vpp} chunks, a block each at least, "
                f"but {unit} has {blocks} blocks" + (f" and strategy.{unit}.pp={f.pp}" if f.pp is not None else "")
            )

    def vpps(self, unit: str, pp: int, m: int) -> list[int]:
        """A unit's interleaving at pp stages in the recovery: the given one, else none
        (self.interleavings offers the best choices' interleaved variants)."""
        given = self.fixed[unit].vpp
        if given is not None:
            if given > 1 and (pp == 1 or m % pp or pp * given > self.p.blocks(unit)):
                return []
            return [given]
        return [1]

    def interleavings(self, choice: Choice, m: int) -> list[tuple[float, Choice]]:
        """The choice with its LLM interleaved, where its vpp is searched: each vpp that
        Megatron-LM runs (pp > 1, m a multiple of pp, pp x vpp dividing the blocks), at
        most MAX_VPPS of them (the fewest chunks: each adds transfers), each unit at the
        lightest recomputation whose stages hold what the interleaved order keeps in flight
        there, priced by the 1F1B model. (The encoder and the generator, shallow, interleave
        by hand.)"""
        enc, llm, gen = choice
        out = []
        for v in self.interleaved_vpps(choice, m):
            variant = self._held((enc, replace(llm, setting=replace(llm.setting, vpp=v)), gen), m)
            if variant is not None:
                out.append((self.pipeline_time(variant, m), variant))
        return out

    def interleaved_vpps(self, choice: Choice, m: int) -> list[int]:
        """The vpps `interleavings` offers a choice: each Megatron-LM runs (pp > 1, m a
        multiple of pp, pp x vpp dividing the blocks), the fewest MAX_VPPS; none where the
        LLM's vpp is given or the choice is interleaved already."""
        llm = choice[1]
        if self.fixed["llm"].vpp is not None or llm.setting.vpp > 1 or llm.pp == 1 or m % llm.pp:
            return []
        blocks = self.p.blocks("llm")
        return [v for v in range(2, blocks // llm.pp + 1) if blocks % (llm.pp * v) == 0][:MAX_VPPS]

    def _held(self, choice: Choice, m: int) -> Choice | None:
        """`_recomputed` for an interleaved LLM: each unit's stages holding the forwards the
        chain's exact orders keep in flight there; None if none does, or the orders wait on
        each other. An interleaved stage s keeps (pp - s - 1) x 2 + (vpp - 1) x pp chunk
        forwards, two chunks' worth more for each stage after its unit, and the units ahead
        of it more for its deeper warm-up: more than 1F1B's depth count (`_depths`)."""
        try:
            orders = chain_orders(Chain(tuple((c.pp, c.setting.vpp) for c in choice)), m)
        except Deadlock:
            return None
        firsts = itertools.accumulate((c.pp for c in choice), initial=0)
        stage_orders = [orders[first : first + c.pp] for first, c in zip(firsts, choice)]
        return self._lightest(choice, lambda k, v: self.stages(v).holds(stage_orders[k], self.peak[v.unit], self.usable))

    def _roundings(self, picked: tuple[RelaxedOption, ...], tau: float, m: int, bar: float) -> list[tuple[float, Choice]]:
        """The floor/ceil roundings of the relaxed PPs that fit, priced by the 1F1B model,
        but for those whose `least_time` shows they take `bar` or more."""
        out = []
        enc, llm, gen = (self._pp_choices(unit, o, tau, m) for unit, o in zip(UNITS, picked))
        for rounded in itertools.product(enc, llm, gen):
            if sum(c.devices for c in rounded) > self.N or self.least_time(rounded, m) * (1 - ROUNDING) >= bar:
                continue
            choice = self._recomputed(rounded, m)
            if choice is not None:
                out.append((self.pipeline_time(choice, m), choice))
        return out

    def _recomputed(self, choice: Choice, m: int) -> Choice | None:
        """The choice with each unit's recomputation the lightest (where it is searched) whose
        stages hold the micro-batches 1F1B keeps in flight there; None if none does. The
        relaxation sees one micro-batch a stage: of a unit's options that hold it at the same
        fewest stages it keeps the least recomputation, which the deeper pipeline of an
        integer choice can overflow (the units ahead of the LLM keep up to its depth in
        flight); a heavier option there costs more compute, so the same sub-problem's
        relaxed optimum bounds it."""
        depths = _depths(choice)
        return self._lightest(choice, lambda k, v: depths[k] <= self.summary(v).depth_limit(m))

    def _lightest(self, choice: Choice, holds: Callable[[int, UnitChoice], bool]) -> Choice | None:
        """Each unit (the k-th of the chain) at the lightest recomputation (where it is
        searched) that `holds(k, unit)` accepts; None if a unit has none."""
        units = []
        for k, c in enumerate(choice):
            modes = RECOMPUTE_MODES if self.fixed[c.unit].recompute is None else (c.recompute,)
            variants = (c if mode == c.recompute else replace(c, setting=replace(c.setting, recompute=mode)) for mode in modes)
            fitting = next((v for v in variants if holds(k, v)), None)
            if fitting is None:
                return None
            units.append(fitting)
        return units[0], units[1], units[2]

    # ---- pricing one integer choice --------------------------------------------------------
    def stages(self, choice: UnitChoice) -> StageArrays:
        return self.p.stages(choice.unit, choice.setting, choice.micro_batch, choice.dp, choice.pp)

    def summary(self, choice: UnitChoice) -> _Summary:
        found = self._summaries.get(choice)
        if found is None:
            stages = self.stages(choice)
            kept = stages.kept * self.peak[choice.unit]
            # What a stage holds besides its forwards in flight: its model states and, for the
            # moment a backward recomputes, that block's whole activations.
            held = stages.states + stages.transient * self.peak[choice.unit]
            with np.errstate(divide="ignore"):
                caps = np.where(kept > 0, (self.usable - held) / kept, np.where(held <= self.usable, INF, -INF))
            hops = self.p.hops(choice.unit, choice.setting, choice.micro_batch, choice.dp, choice.pp)
            bwd = stages.bwd.reshape(-1, choice.pp).sum(axis=0)
            found = _Summary.of(
                stages.fb.tolist(), bwd.tolist(), stages.tail.tolist(), [2 * h for h in hops], caps.tolist(), choice.setting.vpp
            )
            self._summaries[choice] = found
        return found

    def least_time(self, choice: Choice, m: int) -> float:
        """A lower bound of `time`, from the units' summaries: pipeline_time's way of the
        first micro-batch, m - 1 periods of no less than the slowest stage (m - 1 / chunks
        >= m - 1), and the stage that ends last. It leaves out the hand-offs between the
        units: each adds b to the way and takes at most b / 2 off a later stage's end."""
        e, l, g = (self.summary(c) for c in choice)
        ends = max(0.0, e.end, l.end - e.drain, g.end - e.drain - l.drain)
        return e.way + l.way + g.way + (m - 1) * max(e.slowest, l.slowest, g.slowest) + ends

    def time(self, choice: Choice, m: int) -> float | None:
        """The 1F1B model's iteration time of an integer choice (module docstring), or None
        if a stage's memory does not hold the micro-batches in flight there."""
        if any(depth > self.summary(c).depth_limit(m) for c, depth in zip(choice, _depths(choice))):
            return None
        return self.pipeline_time(choice, m)

    def pipeline_time(self, choice: Choice, m: int) -> float:
        """The 1F1B model's iteration time of an integer choice that fits."""
        summaries = [self.summary(c) for c in choice]
        fb: list[float] = []
        bwd: list[float] = []
        tail: list[float] = []
        trips: list[float] = []
        chunks: list[int] = []
        # Transfers after each stage, there and back: the unit's own hops, then a broker.
        for c, summary, after in zip(choice, summaries, (*choice[1:], None)):
            fb += summary.fb
            bwd += summary.bwd
            tail += summary.tail
            trips += summary.trips[: c.pp - 1] + ([self.broker(c, after)] if after is not None else [])
            chunks += [c.setting.vpp] * c.pp
        return pipeline_time(fb, bwd, trips, tail, m, chunks)

    def broker(self, src: UnitChoice, dst: UnitChoice) -> float:
        """Seconds of one micro-batch's hand-off between two units there and back
        (programs.Broker): the side with fewer replicas sends or receives one message per
        replica of the other in turn, and a receiving replica's lead broadcasts what it
        got to its TP peers."""
        return self.p.broker(broker_end(src), broker_end(dst))

    def memory_gib(self, choice: Choice, m: int) -> dict[str, float]:
        """Each unit's fullest GPU, as the orchestration estimates it."""
        out = {}
        for c, depth in zip(choice, _depths(choice)):
            stages = self.stages(c)
            flight = np.minimum(depth - np.arange(c.pp), m)
            out[c.unit] = float((stages.states + self.peak[c.unit] * (flight * stages.kept + stages.transient)).max()) / GIB
        return out

    # ---- why nothing fits ----------------------------------------------------------------
    def _no_plan(self) -> PlanError:
        """One line with the numbers: a unit no allocation holds, or too few GPUs."""
        usable = self.usable / GIB
        least: dict[str, float] = {}
        for unit in UNITS:
            fewest = INF
            closest = INF
            blocks = self.p.blocks(unit)
            lightest = None
            for tp in self._tps(unit):
                for setting in self.settings(unit, tp, 1):
                    cost = self.p.whole(unit, setting, 1, 1)
                    kept = self.peak[unit] * float(cost.kept[0] + cost.transient[0])
                    need = float(cost.states[0]) / blocks + kept
                    if need < closest:
                        closest, lightest = need, setting
                    room = self.usable - kept
                    if room > 0 and float(cost.states[0]) / room <= blocks:
                        fewest = min(fewest, tp * max(1, math.ceil(float(cost.states[0]) / room)))
            if fewest == INF:
                assert lightest is not None, "every unit has a setting"
                return PlanError(
                    f"disttrain: unit {unit} fits no allocation: even at pp={blocks} (one block per stage) with "
                    f"{lightest.describe()} its fullest stage needs {gib(closest)} GiB for one sequence, a "
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


def _depths(choice: Choice) -> list[int]:
    """Per unit: the pipeline's depth from the unit's first stage on, which bounds what
    1F1B keeps in flight there."""
    total = sum(c.pp for c in choice)
    return [total - sum(c.pp for c in choice[:u]) for u in range(len(choice))]


def pipeline_time(
    fb: list[float], bwd: list[float], trips: list[float], tail: list[float], m: int, chunks: list[int] | None = None
) -> float:
    """One iteration of an end-to-end 1F1B pipeline of stages taking fb seconds per
    micro-batch (bwd of it backward), with trips[g] seconds of transfers there and back
    between stages g and g + 1, and tail[g] seconds of end-of-iteration work: the first
    micro-batch through every stage and back, then m - 1 periods of the steady state, in
    which stage g covers its micro-batch's round trip through the stages after it with
    the min(depth - g, m) micro-batches 1F1B keeps in flight there; then the stage whose
    tail ends last (stage g ends its last backward the stages' backwards and transfers
    before it earlier than stage 0). A stage of chunks[g] > 1 virtual stages (interleaved
    1F1B) fills and drains the pipeline a chunk at a time: it adds fb / chunks to the
    first micro-batch's way, and its steady state runs m - 1 / chunks periods. Plain
    Python: its lists are short, and the orchestration prices thousands of them."""
    depth = len(fb)
    chunks = chunks or [1] * depth
    period = after = way = 0.0
    slowest = 1
    for g in range(depth - 1, -1, -1):
        after += fb[g] + (trips[g] if g < depth - 1 else 0.0)
        way += fb[g] / chunks[g] + (trips[g] if g < depth - 1 else 0.0)
        flight = min(depth - g, m)
        here = max(fb[g], after / flight)
        if here > period:
            period, slowest = here, chunks[g]
    drain, ends = 0.0, 0.0
    for g in range(depth):
        ends = max(ends, tail[g] - drain)
        if g < depth - 1:
            drain += bwd[g] / chunks[g] + trips[g] / 2
    return way + (m - 1 / slowest) * period + ends
