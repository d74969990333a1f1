"""The Optimus planner (Feng et al., "Optimus: accelerating large-scale multi-modal LLM
training by bubble exploitation"; docs/strategies.md, Optimus): separate plans for the encoders and the LLM,
colocated on every device, and the encoders' work scheduled into the LLM's bubbles.

Model planner (§4.1, Algorithm 1):
1. The LLM's plan is Megatron-LM's (strategies.megatron.planner on the LLM alone: searched, or the
   degrees given under `strategy.llm`, as the paper's Tables 11-12 give them).
2. Encoder plans: PP_enc | PP_llm and TP_enc | TP_llm over all devices, DP_enc =
   n/(PP_enc·TP_enc) (or `strategy.encoder.pp/tp` by hand). Multiple encoders share one
   plan, each cut into the same PP_enc stages (§4.4).
3. Memory pruning: the LLM's states and activations on the busiest device plus the
   encoders' states (Optimus: MEM_model = k·(DP_enc·φ_enc + DP_llm·φ_llm)/n plus the LLM's
   activations; encoder activations are ignored as in the paper, and reported in the
   run's memory figures).
4. Every split of each LLM pipeline's micro-batches among its m = DP_enc/DP_llm encoder
   pipelines (pipelines on the same devices share a block's split evenly); when there are
   more than `max_partitions` splits, a local search over them.
For each encoder plan and split the bubble scheduler (optimus.scheduler) estimates the
iteration; the `refine` splits with the best coarse schedules get the fine-grained stage
(in that order, until one ends at the plan's floor, which no schedule beats); the fastest
schedule of all is emitted (optimus.programs) and simulated as it is.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

from src.cluster import GIB, gib, family_sharing
from src.collector import collector_paused
from src.config import UnitCounts, check_positive, options_from
from src.progress import Progress
from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import grad_bytes, model_state_bytes, rank_memory, states_precision, weight_bytes, work_activation_bytes
from src.mesh import tensor_parallel
from src.errors import ConfigError, PlanError
from src.models.spec import ModelSpec
from src.program import Collective, Compute, Plan, Program, RankProgram, UnitPlan, Work
from src.strategies.base import PlanRequest, divisors
from src.strategies.megatron.options import MegatronChoices
from src.strategies.optimus.llm import LLMBase, LLMPipelines
from src.strategies.optimus.encoder import EncoderCosts, EncoderPlan, Layout, encoder_costs, encoder_stages
from src.strategies.builders.emit import iteration_tail
from src.strategies.builders.stages import Segment
from src.strategies.optimus.programs import ClassEmitter, add_encoder_routes, class_label, class_program
from src.strategies.optimus.data import Emission, on_batches
from src.strategies.optimus.parallel import Ahead, complete
from src.strategies.optimus.scheduler import BubbleScheduler, Candidate, Schedule, Tails, local_search, partitions
from src.strategies.spec import AutoVariant, StrategySpec


@dataclass(frozen=True)
class EncoderDegrees(UnitCounts):
    """One plan for every encoder (Optimus §4.4), set by hand (strategy.encoder); None: enumerated."""

    tp: int | None = None  # must divide the LLM's tp and the encoders' heads
    pp: int | None = None  # must divide the LLM's pp and the encoders' blocks


@dataclass(frozen=True)
class OptimusOptions:
    llm: MegatronChoices = field(default_factory=MegatronChoices)  # the LLM's (Optimus's Tables 11-12 give them)
    encoder: EncoderDegrees = field(default_factory=EncoderDegrees)
    encoder_zero_stage: int = 1
    fine_grained: bool = True
    defer_warmup: bool = True
    max_partitions: int = 500
    refine: int = 3

    def __post_init__(self) -> None:
        self.encoder.check("strategy.encoder")
        if self.encoder_zero_stage not in (0, 1):
            raise ConfigError(
                f"strategy.encoder_zero_stage={self.encoder_zero_stage!r}: 0 or 1 (the distributed optimizer, as the LLM's)"
            )
        for key in ("fine_grained", "defer_warmup"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"strategy.{key}={getattr(self, key)!r} must be true or false")
        for key in ("max_partitions", "refine"):
            check_positive(f"strategy.{key}", getattr(self, key))


def plan_optimus(request: PlanRequest) -> Plan:
    return plan_optimus_batches(request, (request.batch_index,))[0]


def plan_optimus_batches(request: PlanRequest, batches: Sequence[int | None]) -> list[Plan]:
    """The planner's plan, chosen once at the mean load, priced on each of `batches`."""
    with collector_paused():
        return _plan(request, batches)


def _plan(request: PlanRequest, batches: Sequence[int | None]) -> list[Plan]:
    opts = options_from(OptimusOptions, request.options)
    model, cluster, train = request.model, request.cluster, request.train
    llm, encoders = _llm_and_encoders(model)
    started = time.perf_counter()
    compute, comm = ComputeModel(cluster, train.precision), CommModel(cluster)
    pipelines = LLMPipelines(request, llm, encoders, opts.llm.options("strategy.llm"), opts.defer_warmup, compute, comm)
    rejected: list[tuple[float, str]] = []
    progress = Progress("optimus planner")
    # Every rung of the LLM's memory ladder whose LLM alone fits, and could beat the best
    # plan so far (no schedule is faster than its LLM alone), with every encoder plan; the
    # rung's schedules are emitted fastest first until one fits memory as the simulator
    # counts it. The rungs are tried fastest LLM alone first, so that the best plan rules
    # out the most rungs early; the plan kept is the fastest that fits over all rungs, on a
    # tie the one of the earlier rung of the ladder (as trying them in ladder order gives).
    chosen: list[Plan] | None = None
    best: tuple[float, int] = (math.inf, -1)  # the chosen plan's latency and rung
    scheduled = 0
    rungs: list[dict[str, Any]] = []
    ladder: list[tuple[float, int]] = []
    for index, (recompute, zero) in enumerate(pipelines.rungs):
        rungs.append({"recompute": recompute, "zero_stage": zero})
        fits, need = pipelines.fits_alone(recompute, zero)
        if not fits:
            rungs[index]["outcome"] = "the LLM alone does not fit"
            usable = cluster.usable_memory_bytes
            rejected.append(
                (
                    (need - usable) / GIB,
                    f"LLM recompute={recompute} zero_stage={zero}: the LLM alone needs {gib(need)} GiB on its fullest "
                    f"stage but a {cluster.device} has {gib(usable)} GiB usable, short by {gib(need - usable)} GiB",
                )
            )
            continue
        ladder.append((pipelines.alone_s(recompute, zero), index))
    for index in _trial_order(ladder):
        rung = rungs[index]
        recompute, zero = rung["recompute"], rung["zero_stage"]
        # Again: exact once the rung's recompute mode has its final timeline.
        rung["llm_alone_s"] = pipelines.alone_s(recompute, zero)
        if (rung["llm_alone_s"], index) >= best:
            rung["outcome"] = "the LLM alone is no faster than the best plan"
            continue
        base = pipelines.base(recompute, zero)
        layouts = []
        for enc_plan in _encoder_plans(request, opts, base.plan, encoders):
            layout = Layout(base.plan.mesh, enc_plan)
            problem = _encoder_plan_problem(request, layout, base, encoders, opts)
            if problem:
                rejected.append(problem)
            else:
                layouts.append(layout)
        jobs = _RungJobs(request, opts, base, encoders, compute, comm)
        ranked = _Ranked(jobs, layouts, index, best)
        with Ahead(ranked.schedule, len(layouts)) as ahead:
            for candidate in ranked.fastest_first(ahead):
                rung.setdefault("best_s", candidate.schedule.latency)
                if (candidate.schedule.latency, index) >= best:
                    break
                candidate = complete(ranked.reschedule, candidate)
                emitted = _emit(request, opts, base, candidate, encoders, ranked, rejected, time.perf_counter() - started, batches)
                if isinstance(emitted, list):
                    chosen, best = emitted, (candidate.schedule.latency, index)
                    break
                rejected.append(emitted)
        scheduled += len(ranked.scheduled)
        left = len(layouts) - len(ranked.scheduled)
        rung["outcome"] = f"{len(ranked.scheduled)} encoder plans scheduled" + (f", {left} could not be chosen" if left else "")
        if progress.due():
            progress.show(f"recompute={recompute} zero_stage={zero}: {scheduled} encoder plans scheduled, {len(rejected)} rejected")
    if chosen is None:
        raise PlanError(min(rejected)[1] if rejected else f"no LLM plan for {model.name}")
    progress.end(f"done: {scheduled} encoder plans scheduled")
    for plan in chosen:
        plan.details["llm"]["search"] = pipelines.choice.search
        plan.details["rungs"] = rungs
        plan.details["scheduler_s"] = time.perf_counter() - started
    return chosen


def _trial_order(ladder: list[tuple[float, int]]) -> list[int]:
    """The rungs (their LLM alone's seconds, their index in the ladder) in the order they
    are tried: the fastest LLM alone first, ties in ladder order."""
    return [index for _, index in sorted(ladder)]


def _class_memory_problem(
    request: PlanRequest, units: dict[str, UnitPlan], rank_program: RankProgram, what: str
) -> tuple[float, str] | None:
    """One emitted class's memory as the simulator counts it (an uneven split holds more
    encoder activations than the pruning's even one); `what`: the plan, for the message."""
    usable = request.cluster.usable_memory_bytes
    need = rank_memory(rank_program, units, request.model, request.train.precision, request.cluster.amp)["total"]
    if need <= usable:
        return None
    return (need - usable) / GIB, (
        f"{what}: {rank_program.label} needs {gib(need)} GiB but a {request.cluster.device} has "
        f"{gib(usable)} GiB usable, short by {gib(need - usable)} GiB"
    )


# ---- the LLM ---------------------------------------------------------------------------------
def _llm_and_encoders(model: ModelSpec) -> tuple[str, list[str]]:
    """The LLM is the unit every other unit feeds (chain flows); the others are encoders."""
    if model.interaction is not None:
        raise PlanError(
            f"optimus schedules encoders into an LLM's pipeline bubbles; {model.name} is a contrastive "
            f"model (its towers meet in {model.interaction}, which has no pipeline): use distmm"
        )
    consumers = {c for _, c in model.flows}
    encoders = [p for p, _ in model.flows]
    if len(consumers) != 1 or sorted(encoders + list(consumers)) != sorted(u.name for u in model.units):
        raise PlanError(
            f"optimus schedules encoders that all feed one LLM; model {model.name} has units "
            f"{[u.name for u in model.units]} and flows {list(model.flows)}"
        )
    return consumers.pop(), encoders


# ---- encoder plans ---------------------------------------------------------------------------
def _encoder_plans(request: PlanRequest, opts: OptimusOptions, llm: UnitPlan, encoders: list[str]) -> list[EncoderPlan]:
    given = opts.encoder
    for key, degree in (("pp", llm.pp), ("tp", llm.tp)):
        value = getattr(given, key)
        if value is not None and degree % value:
            raise ConfigError(
                f"strategy.encoder.{key}={value} does not divide the LLM's {key}={degree} "
                f"(Optimus needs PP_enc | PP_llm and TP_enc | TP_llm)"
            )
    heads = [request.model.unit(u).heads for u in encoders]
    tps = [given.tp] if given.tp else [t for t in divisors(llm.tp) if all(h % t == 0 for h in heads)]
    for t in tps:
        bad = [u for u, h in zip(encoders, heads) if h % t]
        if bad:
            raise ConfigError(
                f"strategy.encoder.tp={t} does not divide the heads of {bad}: {[request.model.unit(u).heads for u in bad]}"
            )
    pps = [given.pp] if given.pp else divisors(llm.pp)
    return [EncoderPlan(p, t) for p in pps for t in tps]


def _encoder_state_bytes(
    request: PlanRequest,
    layout: Layout,
    encoders: list[str],
    opts: OptimusOptions,
    stage: int,
    layers: dict[str, list[tuple[int, int]]],
) -> float:
    replicas = layout.encoder_mesh().degree("dp")
    total = 0.0
    for name in encoders:
        unit = request.model.unit(name)
        start, end = layers[name][stage]
        trainable = unit.trainable_params(start, end) / layout.plan.tp
        fixed = sum(layer.params for layer in unit.layers[start:end]) / layout.plan.tp - trainable
        for params, frozen in ((trainable, False), (fixed, True)):
            total += sum(
                model_state_bytes(
                    params, states_precision(request.train.precision, request.cluster.amp), frozen, opts.encoder_zero_stage, replicas
                ).values()
            )
    return total


def _encoder_activation_bytes(
    request: PlanRequest,
    layout: Layout,
    encoders: list[str],
    microbatches: int,
    samples: int,
    stage: int,
    layers: dict[str, list[tuple[int, int]]],
) -> float:
    """An encoder stage's activations for its share of an even split of the micro-batches:
    the coarse schedule holds every forward's until the backwards after the LLM. (Optimus's
    MEM_model leaves encoder activations out; the simulator holds them, so we count them.)"""
    share = -(-microbatches // layout.pipelines)
    sharding = tensor_parallel(layout.plan.tp)
    return share * sum(
        work_activation_bytes(request.model, Compute(Work(u, "fwd", samples, layers[u][stage], sharding=sharding)), "none")
        for u in encoders
        if request.model.needs_backward(u)
    )


def _encoder_plan_problem(
    request: PlanRequest, layout: Layout, base: LLMBase, encoders: list[str], opts: OptimusOptions
) -> tuple[float, str] | None:
    plan, n_mb = layout.plan, base.plan.num_microbatches
    label = f"encoder pp={plan.pp} tp={plan.tp}"
    blocks = [sum(1 for layer in request.model.unit(u).layers if layer.tp_allreduces > 0) for u in encoders]
    if any(b < plan.pp for b in blocks):
        return math.inf, f"{label}: more stages than the encoder blocks {blocks}"
    if layout.pipelines > n_mb:
        return math.inf, (
            f"{label}: {layout.pipelines} encoder pipelines per LLM pipeline but only {n_mb} micro-batches to share among them"
        )
    layers = {u: encoder_stages(request.model.unit(u), plan.pp) for u in encoders}
    usable = request.cluster.usable_memory_bytes
    worst = max(
        range(base.plan.pp),
        key=lambda s: (
            base.memory[s]
            + _encoder_state_bytes(request, layout, encoders, opts, s % plan.pp, layers)
            + _encoder_activation_bytes(request, layout, encoders, n_mb, base.plan.micro_batch, s % plan.pp, layers)
        ),
    )
    llm = base.memory[worst]
    enc = _encoder_state_bytes(request, layout, encoders, opts, worst % plan.pp, layers)
    acts = _encoder_activation_bytes(request, layout, encoders, n_mb, base.plan.micro_batch, worst % plan.pp, layers)
    if llm + enc + acts > usable:
        short = (llm + enc + acts - usable) / GIB
        return short, (
            f"{label}, LLM recompute={base.plan.recompute} zero_stage={base.plan.zero_stage}: "
            f"LLM stage {worst} needs {gib(llm + enc + acts)} GiB (LLM states and activations "
            f"{gib(llm)}, encoder states {gib(enc)}, encoder activations {gib(acts)}) "
            f"but a {request.cluster.device} has "
            f"{gib(usable)} GiB usable, short by {short:.1f} GiB"
        )
    return None


@dataclass(frozen=True)
class _RungJobs:
    """Scheduling the encoder plans of one rung of the LLM's memory ladder."""

    request: PlanRequest
    opts: OptimusOptions
    base: LLMBase
    encoders: list[str]
    compute: ComputeModel
    comm: CommModel

    def scheduler(self, layout: Layout) -> BubbleScheduler:
        """The bubble scheduler of one encoder plan: its encoders' costs and tails."""
        request, base = self.request, self.base
        model, train = request.model, request.train
        costs = encoder_costs(
            model, self.encoders, request.cluster, train.precision, layout, base.plan.micro_batch, self.compute, self.comm
        )
        reduce, optimizer, gather = base.tails
        tails = Tails(
            reduce, optimizer, gather, _encoder_tails(request, layout, costs, self.encoders, self.opts, self.compute, self.comm)
        )
        return BubbleScheduler(base.timeline, layout, costs, tails)

    def schedule(self, layout: Layout, scheduler: BubbleScheduler) -> Candidate:
        """One encoder plan's best schedule (`scheduler`: the plan's): its splits ranked by
        the coarse estimate, the first `refine` of them scheduled fine."""
        opts = self.opts
        n_mb = self.base.plan.num_microbatches
        cache: dict[tuple[int, ...], float] = {}

        def coarse(counts: list[int]) -> float:
            key = tuple(counts)
            if key not in cache:
                cache[key] = scheduler.evaluate(Schedule(list(counts), list(counts))).latency
            return cache[key]

        splits = partitions(n_mb, layout.blocks, layout.columns, opts.max_partitions)
        total = math.comb(n_mb - layout.pipelines + layout.blocks - 1, layout.blocks - 1)
        if splits is None:
            ranked, evaluated = local_search(n_mb, layout.blocks, layout.columns, coarse)
            search = "local search"
        else:
            ranked = sorted(splits, key=coarse)
            evaluated, search = len(splits), "exhaustive"
        coarse_best = scheduler.initial(ranked[0])
        best = scheduler.best(ranked[0], opts.fine_grained)
        for counts in ranked[1 : opts.refine]:
            # A split's schedule is kept only if strictly faster: none is faster than the
            # layout's floor, so once the best reaches it the remaining splits cannot win.
            if best.latency <= scheduler.floor:
                break
            refined = scheduler.best(counts, opts.fine_grained)
            if refined.latency < best.latency:
                best = refined
        return Candidate(
            layout.plan,
            layout,
            scheduler.costs,
            scheduler,
            best,
            scheduler.efficiency(coarse_best),
            scheduler.efficiency(best),
            coarse_best.latency,
            total,
            evaluated,
            search,
        )


class _Ranked:
    """A rung's encoder plans scheduled fastest first, each only while it could still be the
    plan chosen: a plan's scheduler knows its floor (no schedule of it ends sooner), so a plan
    whose floor is no faster than a schedule found (or than `best`, the plan chosen on the
    rungs tried before: its latency and rung) is not scheduled. The plan chosen is the one
    scheduling every plan would choose, ties broken alike (the plan whose encoder pipeline
    spans more devices first, then the plans' order)."""

    def __init__(self, jobs: _RungJobs, layouts: list[Layout], rung: int, best: tuple[float, int]) -> None:
        self.jobs, self.layouts, self.rung, self.best = jobs, layouts, rung, best
        self.schedulers = [jobs.scheduler(layout) for layout in layouts]
        self.order = sorted(range(len(layouts)), key=lambda i: self._key(i, self.schedulers[i].floor))
        self.scheduled: list[Candidate] = []

    def _key(self, i: int, seconds: float) -> tuple[float, int, int]:
        plan = self.layouts[i].plan
        return seconds, -plan.pp * plan.tp, i

    def schedule(self, k: int) -> Candidate:
        """The plan k-th by floor, scheduled (in this process or a forked worker)."""
        i = self.order[k]
        return self.jobs.schedule(self.layouts[i], self.schedulers[i])

    def fastest_first(self, ahead: Ahead) -> Iterator[Candidate]:
        """The rung's schedules by latency, each plan scheduled (by `ahead`) when it could be next."""
        found: list[tuple[tuple[float, int, int], Candidate]] = []
        for k, i in enumerate(self.order):
            floor = self.schedulers[i].floor
            while found and found[0][0] <= self._key(i, floor):
                yield heapq.heappop(found)[1]
            if (floor, self.rung) >= self.best:  # nor can any plan after it
                break
            candidate = ahead[k]
            self.scheduled.append(candidate)
            heapq.heappush(found, (self._key(i, candidate.schedule.latency), candidate))
        while found:
            yield heapq.heappop(found)[1]

    def not_scheduled(self) -> list[tuple[EncoderPlan, float]]:
        """The plans not scheduled and their floors."""
        return [(self.layouts[i].plan, self.schedulers[i].floor) for i in self.order[len(self.scheduled) :]]

    def reschedule(self, candidate: Candidate) -> Candidate:
        """A candidate scheduled in another process, with its whole schedule: its split's
        schedule again (the same as there: the scheduler's memos change no result)."""
        scheduler = self.schedulers[self.layouts.index(candidate.layout)]
        schedule = scheduler.best(candidate.schedule.counts, self.jobs.opts.fine_grained)
        return replace(candidate, scheduler=scheduler, schedule=schedule)


def _encoder_tails(
    request: PlanRequest,
    layout: Layout,
    costs: EncoderCosts,
    encoders: list[str],
    opts: OptimusOptions,
    compute: ComputeModel,
    comm: CommModel,
) -> list[float]:
    """Per encoder stage: its gradient reduction, optimizer step and parameter all-gather."""
    mesh = layout.encoder_mesh()
    replicas = mesh.degree("dp")
    sharing = family_sharing(request.cluster, mesh.family("dp")) if replicas > 1 else 1
    out = []
    for e in range(layout.plan.pp):
        group = mesh.group("dp", mesh.rank(pp=e))
        seconds = 0.0
        for name in encoders:
            tail = iteration_tail(
                request.model,
                [Segment(name, costs.layers[name][e])],
                tensor_parallel(layout.plan.tp),
                "dp" if replicas > 1 else None,
                replicas,
                opts.encoder_zero_stage,
                grad_bytes(request.train.precision),
                weight_bytes(request.train.precision, request.cluster.amp),
            )
            for i in tail:
                if isinstance(i, Compute):
                    seconds += compute.work_time(i.work, request.model)
                elif isinstance(i, Collective):
                    seconds += comm.collective_time(i.op, group, i.bytes, sharing)
        out.append(seconds)
    return out


# ---- the chosen plan -----------------------------------------------------------------------------
def _emit(
    request: PlanRequest,
    opts: OptimusOptions,
    base: LLMBase,
    best: Candidate,
    encoders: list[str],
    ranked: _Ranked,
    rejected: list[tuple[float, str]],
    scheduler_seconds: float,
    batches: Sequence[int | None],
) -> list[Plan] | tuple[float, str]:
    """The candidate's plan priced on each of `batches` (data.on_batches), or why it does
    not fit memory at the mean load: each class is checked as it is emitted, so that a
    schedule too big stops at its first class over (emitting every class of a 1024-GPU plan
    costs about a second)."""
    model, cluster, train = request.model, request.cluster, request.train
    layout, schedule = best.layout, best.schedule
    # A copy of the LLM's Program: the rung's other schedules may be emitted from it too.
    program = Program(base.program.world_size, [], dict(base.program.groups), dict(base.program.routes))
    samples = base.plan.micro_batch
    owner = {i: j for (j, _), i in schedule.mapping.items()}
    routes = {u: add_encoder_routes(model, cluster, train.precision, program, layout, best.costs, u, samples, owner) for u in encoders}
    emitter = ClassEmitter(
        model,
        layout,
        best.costs,
        schedule,
        base.timeline.backward_points,
        routes,
        samples,
        train.precision,
        cluster.amp,
        opts.encoder_zero_stage,
    )
    enc_mesh = layout.encoder_mesh()
    counts = schedule.counts
    partition = ",".join(map(str, counts))
    details = {
        "encoder_pipelines": layout.pipelines,
        "partition": partition,
        "eff_coarse": round(best.eff_coarse, 4),
        "eff_fine": round(best.eff_fine, 4),
    }
    unit_plans = [
        UnitPlan(
            unit=u,
            mesh=enc_mesh,
            micro_batch=samples,
            num_microbatches=max(counts),
            batch_per_replica=samples * max(counts),
            stage_layers=tuple(best.costs.layers[u]),
            sample_groups=max(counts),
            zero_stage=opts.encoder_zero_stage,
            samples_of=base.plan.unit,  # an encoder micro-batch is named by the LLM micro-batch it feeds
            details=details,
        )
        for u in encoders
    ] + [base.plan]
    units = {u.unit: u for u in unit_plans}
    what = (
        f"encoder pp={layout.plan.pp} tp={layout.plan.tp}, LLM recompute={base.plan.recompute} "
        f"zero_stage={base.plan.zero_stage}, partition {counts}"
    )
    placed = schedule.placed
    items: list[list] = [[] for _ in range(layout.classes)]
    for p in placed:
        items[p.klass].append(p)
    for g in range(layout.classes):
        rank_program = class_program(emitter, g, base.stages[layout.position(g)[0]], items[g], class_label(layout, g))
        problem = _class_memory_problem(request, units, rank_program, what)
        if problem is not None:
            return problem
        program.classes.append(rank_program)
    plan = Plan(strategy="optimus", devices=program.world_size, units=unit_plans, program=program, precision=request.train.precision)
    fine = [p for p in placed if not p.item.is_comm]
    plan.details = {
        "llm": {
            "tp": base.plan.tp,
            "pp": base.plan.pp,
            "dp": base.plan.dp,
            "vpp": base.plan.vpp,
            "micro_batch": samples,
            "microbatches": base.plan.num_microbatches,
            "schedule": base.plan.details["schedule"],
            "recompute": base.plan.recompute,
            "zero_stage": base.plan.zero_stage,
            "warmups": base.timeline.warmups,
        },
        "encoder": {
            "pp": layout.plan.pp,
            "tp": layout.plan.tp,
            "dp": enc_mesh.degree("dp"),
            "pipelines": layout.pipelines,
            "zero_stage": opts.encoder_zero_stage,
        },
        "partition": counts,
        "eff_coarse": best.eff_coarse,
        "eff_fine": best.eff_fine,
        "estimated_iteration_s": schedule.latency,
        "estimated_coarse_iteration_s": best.coarse_latency,
        "llm_start_delay_s": schedule.delta,
        "fine_forward_microbatches": len(schedule.fine_forward),
        "fine_backward_microbatches": len(schedule.fine_backward),
        "kernels_in_bubbles": len(fine),
        "scheduler_s": scheduler_seconds,
        "partitions": {"total": best.partitions_total, "evaluated": best.partitions_evaluated, "search": best.search},
        "candidates": [
            {
                "pp": c.plan.pp,
                "tp": c.plan.tp,
                "pipelines": c.layout.pipelines,
                "estimated_iteration_s": c.schedule.latency,
                "eff_coarse": c.eff_coarse,
                "eff_fine": c.eff_fine,
                "partition": c.schedule.counts,
            }
            for c in sorted(ranked.scheduled, key=lambda c: c.schedule.latency)
        ],
        # The encoder plans whose floor (no schedule of theirs ends sooner) was no faster
        # than a schedule found: not scheduled.
        "not_scheduled": [{"pp": p.pp, "tp": p.tp, "floor_s": floor} for p, floor in ranked.not_scheduled()],
        "rejected": [message for _, message in rejected],
    }
    return on_batches(plan, request, batches, Emission(emitter, base.stages, items))


STRATEGY = StrategySpec(
    "optimus",
    plan_optimus,
    OptimusOptions,
    plan_fields={
        "llm.tp": "strategy.llm.tp",
        "llm.pp": "strategy.llm.pp",
        "llm.micro_batch": "strategy.llm.micro_batch_size",
        "llm.recompute": "strategy.llm.recompute",
        "llm.zero_stage": "strategy.llm.zero_stage",
        "llm.sequence_parallel": "strategy.llm.sequence_parallel",
        "tp": "strategy.encoder.tp",
        "pp": "strategy.encoder.pp",
        "zero_stage": "strategy.encoder_zero_stage",
        "kernels": "strategy.fine_grained",
    },
    auto_variants=(AutoVariant("optimus"),),
    batches=plan_optimus_batches,
)
