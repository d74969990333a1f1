"""The Megatron-LM planner's search: the least memory saving each shape needs, then
branch and bound over simulations.

For every shape of the space (megatron.space), the memory ladder is walked cheapest
first: the least recomputation that fits, with and without the distributed optimizer
where both fit, are the shape's candidates. Pipeline candidates are
checked and priced without a Program (megatron.estimate: the memory rank_memory would
read off it, and a lower bound on its simulated time); colocated (contrastive)
candidates are few and are built. Candidates are then simulated in order of their bound
until the next bound exceeds the best simulated time, so the plan found is the one that
simulating every fitting candidate would find, tie-breaks included, while only those
that could win are built. Searches longer than a few seconds report progress on stderr.
"""

from __future__ import annotations

import heapq
from dataclasses import astuple, dataclass
from typing import Callable

from src.cluster import gib
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import memory_ladder, rank_memory
from src.errors import ConfigError
from src.metrics import layer_flops
from src.program import Plan
from src.progress import Progress
from src.sim.cores import speedup_limit
from src.sim.engine import compute_lower_bound, simulate
from src.strategies.base import Degrees, PlanRequest
from src.strategies.megatron.options import MegatronOptions
from src.strategies.megatron.estimate import MemoryTable, Passes, PipelineEstimator
from src.strategies.megatron.programs import MegatronSettings, colocated_program, pipeline_program
from src.strategies.base import MAX_MICROBATCHES
from src.strategies.megatron.space import MAX_PIPELINE_MICRO_BATCH, Shape, Space
from src.strategies.builders.stages import Segment, balanced_cuts, chain_segments, linear_chain, pipeline_segments

RANKING_SIZE = 5
# How far a candidate's time is known: the levels of bound tightened one after another.
WORK, STAGES, PATH = 0, 1, 2


@dataclass
class Candidate:
    """A shape with the memory settings it needs: how much memory each of its rank
    classes takes, how fast it can be at best, and (once simulated) how fast it is."""

    shape: Shape
    settings: MegatronSettings
    step: int  # position of its settings on the memory ladder
    virtual: list[list[Segment]] | None  # pipeline virtual stages; None when colocated
    memory: list[dict[str, float]]
    labels: list[str]
    bound: float = 0.0  # the first bound: work bound, or a built Program's
    passes: Passes | None = None  # pipeline prices the tighter bounds are made of
    stage_bound: float | None = None
    path_bound: float | None = None
    plan: Plan | None = None
    time: float | None = None

    def order(self) -> tuple:
        """Ties in time go to the smaller degrees, then the cheaper settings."""
        d = self.shape.degrees
        return (d.tp, d.pp, d.vpp, d.micro_batch, self.shape.sequence_parallel, self.step)

    def describe(self) -> str:
        return f"{self.shape.label()} recompute={self.settings.recompute} zero_stage={self.settings.zero_stage}"


@dataclass
class SearchStats:
    space: int = 0  # shapes x memory settings of the ladder
    shapes: int = 0
    invalid: int = 0  # choices of degrees left out by a rule (divisibility, stages)
    memory_checks: int = 0
    rejected_by_memory: int = 0  # memory checks that did not fit
    priced_analytically: int = 0  # fitting candidates bounded without a Program
    stage_bounds: int = 0  # of those, how many got the tighter stage bound,
    path_bounds: int = 0  # and the tightest, the path bound
    built: int = 0  # Programs built
    simulated: int = 0
    wall_time_s: float = 0.0


def _lead(best: Candidate | None) -> str:
    return f"best so far {best.time:.3f} s ({best.describe()})" if best and best.time else "no plan yet"


class MegatronSearch:
    """One planner call's search; candidates share the cost model's caches."""

    def __init__(self, request: PlanRequest, opts: MegatronOptions, contrastive: bool, searched: bool) -> None:
        self.request, self.opts, self.contrastive, self.searched = request, opts, contrastive, searched
        self.model, self.cluster = request.model, request.cluster
        self.precision = request.train.precision
        self.compute = ComputeModel(self.cluster, self.precision)
        self.estimator = PipelineEstimator(
            self.model,
            self.cluster,
            self.precision,
            request.train.global_batch,
            self.compute,
            opts.replicate,
            opts.grad_reduce_dtype,
            opts.grad_accum_dtype,
        )
        self.ladder = memory_ladder(opts.recompute, opts.zero_stage)
        self.stats = SearchStats()
        self.progress = Progress("megatron search")
        self.invalid: list[str] = []
        self.closest: tuple[float, Candidate] | None = None
        self.ranked: list[Candidate] = []  # path-bounded next best, not simulated
        self._heap: list = []  # what `fastest` left to rank: (bound, order, level, index)
        self.chain = linear_chain(self.model) if opts.balance else None
        self.even_cuts: dict[tuple[int, int], list[list[Segment]]] = {}
        self.chain_times: dict[tuple, tuple[float, ...]] = {}
        self.balanced: dict[tuple, list[list[Segment]]] = {}
        self.merged = False  # modality_stages=extra fell back to merged: the backend runs no extra-stage layout here
        self.backend = request.limits.backend

    # ---- memory: one candidate per shape ----------------------------------------------------
    def candidates(self, space: Space) -> list[Candidate]:
        self.stats.shapes += len(space.shapes)
        self.stats.space += len(space.shapes) * len(self.ladder)
        self.stats.invalid += len(space.invalid)
        self.invalid += space.invalid
        out: list[Candidate] = []
        fitted_tp: set[int] = set()
        for index, shape in enumerate(space.shapes):
            if self.progress.due():
                self.progress.show(f"memory checks of shapes {index}/{len(space.shapes)}, no plan yet")
            if self.contrastive and shape.degrees.tp in fitted_tp:
                continue  # the largest micro-batch that fits: accumulation only costs time here
            fitting = self._fitting(shape)
            if fitting:
                out += fitting
                fitted_tp.add(shape.degrees.tp)
        return out

    def _fitting(self, shape: Shape) -> list[Candidate]:
        """The shape under the least recomputation that fits, with and without the
        distributed optimizer where both fit. More recomputation adds compute to the
        same Program and never wins; the distributed optimizer moves fewer bytes and
        steps a shard of the optimizer, so it may."""
        tables: dict[tuple, MemoryTable] = {}
        out: list[Candidate] = []
        for step, (recompute, zero) in enumerate(self.ladder):
            if out and recompute != out[0].settings.recompute:
                break
            settings = MegatronSettings(
                shape.schedule,
                recompute,
                shape.sequence_parallel,
                zero,
                self.opts.overlap_grad_reduce,
                self.opts.modality_stages,
                self.opts.uneven_pp,
                self.opts.scatter_gather,
                self.opts.replicate,
                self.opts.overlap_param_gather,
                self.opts.grad_reduce_dtype,
                self.opts.grad_all_reduce,
                self.opts.grad_accum_dtype,
                self.opts.p2p,
                self.opts.extra_warmup,
            )
            try:
                candidate = self._check(shape, settings, step, tables)
            except ConfigError as err:
                if not self.searched:
                    raise
                self.invalid.append(str(err))
                self.stats.invalid += 1
                return []
            if candidate is not None:
                self._price(candidate)
                out.append(candidate)
        return out

    def _check(self, shape: Shape, settings: MegatronSettings, step: int, tables: dict[tuple, MemoryTable]) -> Candidate | None:
        """The shape under these settings if it fits memory; else None, the shortfall noted."""
        self.stats.memory_checks += 1
        usable = self.cluster.usable_memory_bytes
        candidate: Candidate | None = None
        if self.contrastive:
            candidate = Candidate(shape, settings, step, None, [], [])
            plan = self._build(candidate)
            units = {u.unit: u for u in plan.units}
            candidate.memory = [rank_memory(rp, units, self.model, self.precision, self.cluster.amp) for rp in plan.program.classes]
            candidate.labels = [rp.label for rp in plan.program.classes]
            worst = max(need["total"] for need in candidate.memory)
        else:
            virtual = self.virtual_stages(shape, settings)
            for unit in self.model.units:  # a backend that runs U-Nets whole: on one stage (a replicated one is whole on each rank)
                tp = 1 if unit.name in self.opts.replicate else shape.degrees.tp
                self.request.limits.whole_unet(unit, tp, sum(s.unit == unit.name for v in virtual for s in v))
            key = tuple(tuple(stage) for stage in virtual)
            table = tables.get(key)
            if table is None:
                table = tables[key] = self.estimator.memory_table(
                    shape.degrees, shape.schedule, shape.sequence_parallel, virtual, self.opts.extra_warmup
                )
            worst = table.worst(settings.recompute, settings.zero_stage)
            if worst <= usable or self.closest is None or worst - usable < self.closest[0]:
                candidate = Candidate(
                    shape,
                    settings,
                    step,
                    virtual,
                    table.need(settings.recompute, settings.zero_stage),
                    [f"stage {s}" for s in range(shape.degrees.pp)],
                )
        if worst <= usable:
            return candidate
        self.stats.rejected_by_memory += 1
        if candidate is not None and (self.closest is None or worst - usable < self.closest[0]):
            self.closest = (worst - usable, candidate)
        return None

    def virtual_stages(self, shape: Shape, settings: MegatronSettings) -> list[list[Segment]]:
        deg = shape.degrees
        if self.chain is None:
            key = (deg.pp, deg.vpp)
            if key not in self.even_cuts:
                self.even_cuts[key] = pipeline_segments(self.model, deg.pp, deg.vpp, settings.modality_stages, settings.uneven_pp)
            return self.even_cuts[key]
        # The cut depends on the layers' times (TP, its price, micro-batch, sequence
        # parallelism, recomputation; their FLOPs only on recomputation) and the number of
        # virtual stages only.
        if self.opts.balance_by == "flops":
            times_key: tuple = (settings.recompute,)
        else:
            times_key = (deg.tp, deg.dp, deg.pp, deg.micro_batch, settings.sequence_parallel, settings.recompute)
        times = self.chain_times.get(times_key)
        if times is None:
            times = self.chain_times[times_key] = tuple(self._chain_costs(deg, settings))
        cut_key = (times, deg.pp * deg.vpp)
        if cut_key not in self.balanced:
            self.balanced[cut_key] = chain_segments(self.chain, balanced_cuts(times, deg.pp * deg.vpp))
        return self.balanced[cut_key]

    def _chain_costs(self, deg: Degrees, settings: MegatronSettings) -> list[float]:
        """What the balanced cut equalises, layer by layer along the chain (strategy.balance_by):
        per-sample FLOPs of a layer's forward, backward and recomputation, as Optimus
        Appendix B estimates a layer's time, or its simulated seconds of one micro-batch."""
        assert self.chain is not None, "only a balanced cut prices its chain"
        if self.opts.balance_by == "time":
            return self.estimator.layer_times(self.chain, deg, settings)
        return [
            layer_flops(self.model, unit, index).hardware(settings.recompute, self.model.needs_backward(unit.name))
            for unit in self.chain
            for index in range(unit.num_layers)
        ]

    def memory_problem(self, candidate: Candidate) -> str:
        usable = self.cluster.usable_memory_bytes
        worst = max(range(len(candidate.memory)), key=lambda i: candidate.memory[i]["total"])
        need = candidate.memory[worst]
        parts = ", ".join(f"{k} {gib(need[k])}" for k in ("weights", "grads", "optimizer", "activations"))
        why = ""
        if (
            self.opts.micro_batch_size is None
            and not self.contrastive
            and candidate.shape.degrees.micro_batch > MAX_PIPELINE_MICRO_BATCH
        ):
            why = (
                f" (micro-batches of {candidate.shape.degrees.micro_batch}: the planner builds at most "
                f"{MAX_MICROBATCHES} per iteration)"
            )
        return (
            f"megatron {candidate.describe()}: {candidate.labels[worst]} needs "
            f"{gib(need['total'])} GiB ({parts}) but a {self.cluster.device} has "
            f"{gib(usable)} GiB usable, short by {gib(need['total'] - usable)} GiB{why}"
        )

    def closest_memory_problem(self) -> str | None:
        """Of the settings that did not fit, the one short by the least."""
        return self.memory_problem(self.closest[1]) if self.closest else None

    def _price(self, candidate: Candidate) -> None:
        if candidate.plan is not None:
            candidate.bound = compute_lower_bound(candidate.plan.program, self.model, self.compute)
            return
        candidate.bound = self.estimator.work_bound(candidate.shape.degrees, candidate.settings)
        self.stats.priced_analytically += 1

    # ---- time: best first -----------------------------------------------------------------
    def fastest(self, candidates: list[Candidate], build: bool = True, simulate: bool = True) -> Candidate:
        """Best first: take the candidate of least known bound and tighten it (work bound,
        then stage bound, then path bound, then the simulated time), until the least bound
        left exceeds the best simulated time: every candidate that could be faster, or as
        fast and first in order, was simulated. Then rank the next ones by path bound.
        `build`: whether the pick's Program is built when no simulation built it;
        `simulate=False` stops at the least path bound (for a planner that times the
        pipeline again its own way)."""
        best: Candidate | None = None
        if len(candidates) == 1:
            best = candidates[0]
        else:
            best_time = 0.0
            heap = [(c.bound, c.order(), WORK, i) for i, c in enumerate(candidates)]
            heapq.heapify(heap)
            # The bounds price compute at every device's share; where devices share cores a
            # candidate can run faster than that (src.sim.cores).
            limit = speedup_limit(self.cluster)
            while heap and (best is None or heap[0][0] * limit <= best_time):
                if self.progress.due():
                    self.progress.show(f"bounds and simulations: candidates left {len(heap)}/{len(candidates)}, {_lead(best)}")
                _, _, level, index = heapq.heappop(heap)
                candidate = candidates[index]
                if level < PATH and candidate.virtual is not None:
                    heapq.heappush(heap, (self._tighten(candidate, level), candidate.order(), level + 1, index))
                    continue
                if not simulate:
                    best = candidate
                    self.ranked.append(candidate)
                    break
                time = self._simulate(candidate)
                if best is None or (time, candidate.order()) < (best_time, best.order()):
                    best, best_time = candidate, time
            self._heap = heap
            self._rank(candidates, heap)
        assert best is not None, "every candidate is simulated while none is best"
        if best.plan is None and build:
            self._build(best)
        return best

    def _tighten(self, candidate: Candidate, level: int) -> float:
        deg, cfg = candidate.shape.degrees, candidate.settings
        if level == WORK:
            assert candidate.virtual is not None, "a colocated candidate is simulated, not bounded"
            candidate.passes = self.estimator.passes(deg, cfg, candidate.virtual)
            candidate.stage_bound = self.estimator.quick_bound(deg, cfg, candidate.passes)
            self.stats.stage_bounds += 1
            return candidate.stage_bound
        assert candidate.passes is not None, "the stage bound comes first"
        candidate.path_bound = self.estimator.path_bound(deg, cfg, candidate.passes)
        self.stats.path_bounds += 1
        return candidate.path_bound

    def _rank(self, candidates: list[Candidate], heap: list, enough: Callable[[], bool] | None = None) -> None:
        """Path-bound the next candidates until RANKING_SIZE are known (simulated, or
        path-bounded with no unbounded candidate below), or until `enough()`."""
        known = sum(1 for c in candidates if c.time is not None)
        while heap and (known < RANKING_SIZE if enough is None else not enough()):
            _, _, level, index = heapq.heappop(heap)
            candidate = candidates[index]
            if candidate.virtual is None:
                break  # colocated candidates are ranked by simulation only
            if level < PATH:
                heapq.heappush(heap, (self._tighten(candidate, level), candidate.order(), level + 1, index))
            else:
                self.ranked.append(candidate)
                known += 1

    def shape_leaders(self, candidates: list[Candidate], count: int) -> list[Candidate]:
        """After `fastest`: the fastest known candidate of each of the `count` fastest
        shapes (degrees and micro-batch; its memory settings the least ranked), ranking on
        as far as that takes."""

        def leaders() -> list[Candidate]:
            first: dict[tuple, Candidate] = {}
            for c in self._known(candidates):
                first.setdefault(astuple(c.shape.degrees), c)
            return list(first.values())[:count]

        self._rank(candidates, self._heap, lambda: len(leaders()) >= count)
        return leaders()

    def _simulate(self, candidate: Candidate) -> float:
        plan = self.plan_of(candidate)
        candidate.time = simulate(plan.program, self.model, self.cluster, self.precision, self.compute).iteration_time
        self.stats.simulated += 1
        return candidate.time

    def _build(self, candidate: Candidate) -> Plan:
        deg, cfg = candidate.shape.degrees, candidate.settings
        train = self.request.train
        if candidate.virtual is None:
            program, unit_plans = colocated_program(self.model, self.cluster, train.global_batch, self.precision, deg, cfg)
        else:
            program, unit_plans = pipeline_program(
                self.model, self.cluster, train.global_batch, self.precision, deg, cfg, candidate.virtual
            )
        self.stats.built += 1
        candidate.plan = Plan(
            strategy="megatron",
            devices=program.world_size,
            units=unit_plans,
            program=program,
            precision=self.precision,
            details={
                "tp": deg.tp,
                "pp": deg.pp,
                "dp": deg.dp,
                "vpp": deg.vpp,
                "micro_batch": deg.micro_batch,
                "schedule": cfg.schedule,
                "extra_warmup": cfg.extra_warmup,
                "recompute": cfg.recompute,
                "sequence_parallel": cfg.sequence_parallel,
                "zero_stage": cfg.zero_stage,
                "balance": self.chain is not None,
                "balance_by": self.opts.balance_by if self.chain is not None else None,
                "placement": "colocated" if self.contrastive else "pipeline",
            },
        )
        return candidate.plan

    # ---- the record ----------------------------------------------------------------------
    def record(self, candidates: list[Candidate], best: Candidate) -> dict:
        """plan.search: the space, what each stage of the search did, its wall time, and
        the best candidates (simulated, or else known by their path bound, a lower bound
        that the simulation reached within rounding in every case we checked)."""
        self.stats.wall_time_s = self.progress.elapsed_s
        known = self.leaders(candidates)
        self.progress.end(
            f"done: {self.stats.shapes} shapes, {len(candidates)} fit, {self.stats.simulated} simulated; best {best.describe()}"
        )
        return {
            "searched": self.searched,
            **({"modality_stages": f"merged (backend={self.backend} runs no extra-stage layout)"} if self.merged else {}),
            **{key: (round(value, 3) if isinstance(value, float) else value) for key, value in vars(self.stats).items()},
            "fitting": len(candidates),
            "ranking": [
                {
                    "tp": c.shape.degrees.tp,
                    "pp": c.shape.degrees.pp,
                    "dp": c.shape.degrees.dp,
                    "vpp": c.shape.degrees.vpp,
                    "micro_batch": c.shape.degrees.micro_batch,
                    "sequence_parallel": c.shape.sequence_parallel,
                    "recompute": c.settings.recompute,
                    "zero_stage": c.settings.zero_stage,
                    "simulated": c.time is not None,
                    "iteration_time_s": c.time if c.time is not None else c.path_bound,
                }
                for c in known
            ],
        }

    def leaders(self, candidates: list[Candidate]) -> list[Candidate]:
        """The ranking after `fastest`: the RANKING_SIZE fastest known candidates (simulated,
        or path-bounded with no unbounded candidate below), fastest first."""
        return self._known(candidates)[:RANKING_SIZE]

    def _known(self, candidates: list[Candidate]) -> list[Candidate]:
        """Every candidate whose time is known (simulated, or path-bounded by the ranking),
        fastest first."""
        known = [c for c in candidates if c.time is not None] + self.ranked
        known.sort(key=lambda c: (c.time if c.time is not None else c.path_bound, c.order()))
        return known

    def plan_of(self, candidate: Candidate) -> Plan:
        """The candidate's plan, built if no simulation built it."""
        return candidate.plan if candidate.plan is not None else self._build(candidate)
