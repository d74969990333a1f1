"""The LLM's pipeline under Optimus (Optimus §4.1): Megatron-LM's plan of the LLM alone,
set on each rung of the memory ladder and priced once, as the bubble scheduler sees it.

- Megatron-LM's search (megatron.planner.choose_megatron, the typed API) runs once on
  the LLM alone, on the first rung of the ladder where the LLM alone fits (the fastest
  degrees that fit without recomputation or the distributed optimizer, where some do:
  they leave the colocated encoders the most memory once the rungs below shed the
  LLM's). Its candidates are ranked by their path bound (the simulation without the
  send and receive streams' serialisation), not simulated: the LLM's timeline below
  times the pick again, with the encoders' hand-off. Every rung keeps its degrees and
  schedule and sets the LLM's own recomputation and distributed optimizer.
- A recompute mode's pipeline is emitted and priced once: every schedule operation's
  cost from a short schedule that holds each (kind, chunk) once, GetEncLLMDep's deferred
  warm-ups (timeline.deferred_warmups), then the stages with their final orders. The
  distributed optimizer changes only a stage's tail (gradient reduce-scatter and
  parameter all-gather instead of an all-reduce), which each rung sets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import grad_bytes, memory_ladder, rank_memory, weight_bytes
from src.models.spec import ModelSpec
from src.errors import PlanError
from src.program import Collective, Compute, Instruction, Program, RankProgram, UnitPlan
from src.schedules.pipeline import build_schedule, interleaved, warmup_counts
from src.strategies.base import PlanRequest
from src.strategies.builders.emit import iteration_tail
from src.strategies.builders.layout import megatron_mesh
from src.strategies.builders.pipeline import PipelineEmitter, PipelineSettings, Stage
from src.strategies.megatron.estimate import PipelineEstimator
from src.strategies.megatron.planner import MegatronChoice, MegatronOptions, choose_megatron
from src.strategies.megatron.programs import pipeline_unit_plans
from src.strategies.optimus.programs import EncoderLinks
from src.strategies.optimus.timeline import (
    CostTable,
    LLMTimeline,
    costs_of,
    deferred_warmups,
    dependency_points,
    op_costs,
    stage_slots,
    time_pipeline,
)


@dataclass
class LLMBase:
    """The LLM's pipeline on one rung: its plan, Program (groups and routes), stages,
    timeline, memory per stage, and tails (gradient reduction, optimizer, gather)."""

    plan: UnitPlan
    program: Program
    stages: list[Stage]
    timeline: LLMTimeline
    memory: list[float]  # bytes per stage
    tails: tuple[list[float], list[float], list[float]]


@dataclass
class _Priced:
    """One recompute mode's pipeline: emitted, its operations priced and timed (with
    Megatron-LM's warm-ups, which the deferred ones keep as long); its stages in their
    final orders once a rung may win."""

    emitter: PipelineEmitter
    program: Program
    tables: list[CostTable]
    tails: list[list[Instruction]]  # per stage, under the emitter's distributed-optimizer setting
    bounds: list[tuple[float, float]]  # per stage: its first operation's start and its last's end
    final: tuple[list[Stage], list, list, list[int]] | None = None  # stages, times, orders, warm-ups


class LLMPipelines:
    """The LLM's pipeline on every rung of the memory ladder, each recompute mode priced once."""

    def __init__(
        self,
        request: PlanRequest,
        llm: str,
        encoders: list[str],
        megatron: MegatronOptions,
        defer_warmup: bool,
        compute: ComputeModel,
        comm: CommModel,
    ) -> None:
        self.request, self.llm, self.encoders = request, llm, encoders
        self.defer_warmup, self.compute, self.comm = defer_warmup, compute, comm
        model, train = request.model, request.train
        self.llm_model = replace(model, name=f"{model.name}-llm", units=(model.unit(llm),), flows=())
        self.choice = self._choose(PlanRequest(self.llm_model, request.cluster, train, {}, limits=request.limits), megatron)
        self.rungs = memory_ladder(megatron.recompute, megatron.zero_stage)
        self._estimator = PipelineEstimator(self.llm_model, request.cluster, train.precision, train.global_batch, compute)
        self._priced: dict[str, _Priced] = {}

    @staticmethod
    def _choose(request: PlanRequest, megatron: MegatronOptions) -> MegatronChoice:
        """Megatron-LM's plan of the LLM alone on the first rung where it fits."""
        rungs = memory_ladder(megatron.recompute, megatron.zero_stage)
        for recompute, zero in rungs:
            try:
                return choose_megatron(request, replace(megatron, recompute=recompute, zero_stage=zero), simulate=False)
            except PlanError:
                if (recompute, zero) == rungs[-1]:
                    raise
        raise AssertionError("the last rung raises")

    @property
    def microbatches(self) -> int:
        return self.choice.degrees.batch_layout(self.request.train.global_batch).microbatches

    def fits_alone(self, recompute: str, zero: int) -> tuple[bool, float]:
        """Whether the LLM alone fits every stage on this rung (Megatron-LM's memory model,
        its default warm-ups), and its fullest stage's bytes."""
        settings = replace(self.choice.settings, recompute=recompute, zero_stage=zero)
        need = max(m["total"] for m in self._estimator.memory(self.choice.degrees, settings, self.choice.virtual))
        return need <= self.request.cluster.usable_memory_bytes, need

    def alone_s(self, recompute: str, zero: int) -> float:
        """The LLM's iteration on this rung with no encoder, as the bubble scheduler counts
        it: its start after the parameter all-gather, its end after each stage's reduction
        and optimizer step; no Optimus schedule on the rung is faster. Timed with the
        deferred warm-ups once the recompute mode has them (the bubble scheduler's own
        sums, so exactly a lower bound), before with Megatron-LM's (the deferred ones keep
        the pipeline as long): its operations priced, its stages not built."""
        priced = self._priced.get(recompute) or self._price(recompute)
        reduce, optimizer, gather = self._tail_seconds(priced, zero)
        bounds = priced.bounds if priced.final is None else [(t.first, t.last) for t in priced.final[1]]
        delta = max(0.0, max(g - first for g, (first, _) in zip(gather, bounds)))
        return max(delta + last + rs + opt for (_, last), rs, opt in zip(bounds, reduce, optimizer))

    def base(self, recompute: str, zero: int) -> LLMBase:
        """The LLM's pipeline on one rung."""
        priced = self._priced.get(recompute) or self._price(recompute)
        stages, times, orders, warmups = priced.final or self._finish(priced)
        deg, cluster, train = self.choice.degrees, self.request.cluster, self.request.train
        model = self.request.model
        stages = [replace(st, tail=self._tail(priced, st.index, zero)) for st in stages]
        reduce, optimizer, gather = self._tail_seconds(priced, zero)
        forward, backward = dependency_points(orders, times[0], self.microbatches)
        timeline = LLMTimeline(
            orders,
            times,
            [stage_slots(t, cluster.kernel_overhead_s) for t in times],
            forward,
            backward,
            max(gather),
            reduce,
            optimizer,
            warmups,
        )
        settings = replace(self.choice.settings, recompute=recompute, zero_stage=zero)
        mesh = megatron_mesh(deg.tp, deg.dp, deg.pp)
        (plan,) = pipeline_unit_plans(self.llm_model, mesh, train.global_batch, deg, settings, self.choice.virtual)
        # Its gradient all-reduce (ZeRO-0) runs asynchronously under the encoders' backward.
        plan = replace(
            plan,
            overlap_comm=zero == 0 and deg.dp > 1,
            details={"schedule": settings.schedule, "warmups": ",".join(map(str, warmups))},
        )
        memory = [
            rank_memory(RankProgram(st.ranks, st.instructions()), {self.llm: plan}, model, train.precision, self.request.cluster.amp)[
                "total"
            ]
            for st in stages
        ]
        return LLMBase(plan, priced.program, stages, timeline, memory, (reduce, optimizer, gather))

    def _price(self, recompute: str) -> _Priced:
        """Emit the pipeline under one recompute mode and price its operations: every
        micro-batch's forward (backward) of a chunk costs the same, so a schedule of the
        fewest micro-batches that holds each chunk's operations prices them all."""
        deg, cfg = self.choice.degrees, self.choice.settings
        model, cluster, train = self.request.model, self.request.cluster, self.request.train
        settings = PipelineSettings(deg.micro_batch, recompute, cfg.sequence_parallel, 0, scatter_gather=cfg.scatter_gather)
        program = Program(world_size=deg.tp * deg.dp * deg.pp, classes=[])
        mesh = megatron_mesh(deg.tp, deg.dp, deg.pp)
        emitter = PipelineEmitter(
            model, cluster, train.precision, program, mesh, self.choice.virtual, settings, links=EncoderLinks(self.encoders)
        )
        sample = build_schedule(cfg.schedule, deg.pp, deg.pp if deg.vpp > 1 else 1, deg.vpp)
        built = [emitter.stage(s, sample[s]) for s in range(deg.pp)]
        tables: list[CostTable] = [op_costs(stage, program, model, self.compute, self.comm) for stage in built]
        default = build_schedule(cfg.schedule, deg.pp, self.microbatches, deg.vpp)
        bounds = [(t.first, t.last) for t in time_pipeline(default, costs_of(default, tables))]
        priced = self._priced[recompute] = _Priced(emitter, program, tables, [st.tail for st in built], bounds)
        return priced

    def _finish(self, priced: _Priced) -> tuple[list[Stage], list, list, list[int]]:
        """GetEncLLMDep's deferred warm-ups, the stages in their final orders, timed."""
        deg, cfg = self.choice.degrees, self.choice.settings
        default = build_schedule(cfg.schedule, deg.pp, self.microbatches, deg.vpp)
        warmups, orders = warmup_counts(default), default
        if self.defer_warmup and cfg.schedule != "gpipe":
            warmups = deferred_warmups(self.microbatches, deg.vpp, priced.tables, default)
            orders = interleaved(deg.pp, self.microbatches, deg.vpp, warmups)
        stages = [priced.emitter.stage(s, orders[s]) for s in range(deg.pp)]
        times = time_pipeline(orders, costs_of(orders, priced.tables))
        priced.final = (stages, times, orders, warmups)
        return priced.final

    def _tail_seconds(self, priced: _Priced, zero: int) -> tuple[list[float], list[float], list[float]]:
        model, program = self.request.model, priced.program
        tails = [self._tail(priced, stage, zero) for stage in range(len(priced.tails))]
        seconds = [[_seconds(tail, program, model, self.compute, self.comm, kind) for tail in tails] for kind in TAIL_PARTS]
        return seconds[0], seconds[1], seconds[2]

    def _tail(self, priced: _Priced, stage: int, zero: int) -> list[Instruction]:
        """A stage's end of iteration under a distributed-optimizer setting."""
        if zero == priced.emitter.cfg.zero_stage:
            return priced.tails[stage]
        emitter, precision = priced.emitter, self.request.train.precision
        return iteration_tail(
            self.request.model,
            emitter.segments_of(stage),
            emitter.sharding,
            emitter.dp_groups[stage],
            emitter.dp,
            zero,
            grad_bytes(precision),
            weight_bytes(precision, self.request.cluster.amp),
            emitter.pending[stage],
        )


TAIL_PARTS = ("reduce", "optimizer", "gather")


def _seconds(instructions: list, program: Program, model: ModelSpec, compute: ComputeModel, comm: CommModel, kind: str) -> float:
    """Seconds of a tail's gradient reduction, optimizer steps or parameter all-gather."""
    total = 0.0
    for i in instructions:
        if isinstance(i, Compute) and kind == "optimizer":
            total += compute.work_time(i.work, model)
        elif isinstance(i, Collective) and i.kind == "dp" and (i.op == "all_gather") == (kind == "gather") and kind != "optimizer":
            group = program.groups[i.group]
            total += i.count * comm.collective_time(i.op, group.ranks, i.bytes, group.sharing)
    return total
