"""The DistTrain planner (Zhang et al., arXiv 2408.04275 v2): disaggregated training of
multimodal LLMs. Every component can be switched off for the paper's ablations:

- orchestration: `disaggregated` (Algorithm 1, strategies.disttrain.orchestration) or
  `ratio` (GPUs in proportion to each unit's FLOPs, §8.2.1's baseline);
- data: `interleaved` (LAION-like sequences whose image count and sizes vary,
  src/data/interleaved.py) or `uniform` (every sequence alike);
- reorder: none | intra (Algorithm 2) | inter (Algorithm 3) | both;
- tp_overlap_chunks: StepCCL's TP overlap, 1 = off.

The encoder, LLM and generator take their degrees from the orchestration (or by hand:
strategy.llm.tp=8 ...); the Program is strategies.disttrain.programs'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from src.cluster import GIB
from src.config import options_from
from src.costmodel.memory import check_memory_options, rank_memory
from src.data.interleaved import InterleavedData, encoder_cost, generator_cost, relative_loads
from src.data.reorder import StageTimes
from src.errors import ConfigError, PlanError
from src.models.spec import ModelSpec
from src.program import Plan, UnitPlan, compress_ranks
from src.strategies.base import PlanRequest, check_microbatch_count
from src.strategies.disttrain.data import REORDERS, Assignment, assign, unit_loads
from src.strategies.disttrain.orchestration import UNITS, Fixed, Orchestration, Orchestrator
from src.strategies.disttrain.profile import Profiler
from src.strategies.disttrain.programs import UnitLayout, disttrain_program, place

ORCHESTRATIONS = ("disaggregated", "ratio")
DATA = ("interleaved", "uniform")
UNIT_KEYS = ("tp", "pp", "dp")


@dataclass(frozen=True)
class DistTrainOptions:
    orchestration: str = "disaggregated"
    data: str = "interleaved"
    reorder: str = "both"
    tp_overlap_chunks: int = 4
    recompute: str | None = None
    zero_stage: int = 1
    encoder: Mapping[str, Any] | None = field(default=None)
    llm: Mapping[str, Any] | None = field(default=None)
    generator: Mapping[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        for key, allowed in (("orchestration", ORCHESTRATIONS), ("data", DATA), ("reorder", REORDERS)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"strategy.{key}={getattr(self, key)!r}; choose one of {list(allowed)}")
        chunks = self.tp_overlap_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"strategy.tp_overlap_chunks must be a positive integer (1 = no overlap), got {chunks!r}")
        check_memory_options(self.recompute, self.zero_stage, "DistTrain shards the optimizer with ZeRO-1")
        if self.zero_stage is None:
            raise ConfigError("strategy.zero_stage must be 0 or 1 (DistTrain uses ZeRO-1)")

    def fixed(self, unit: str) -> Fixed:
        given = dict(getattr(self, unit, None) or {})
        unknown = sorted(set(given) - set(UNIT_KEYS))
        if unknown:
            raise ConfigError(f"strategy.{unit} has unknown key(s) {unknown}; valid: {list(UNIT_KEYS)}")
        for key, value in given.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"strategy.{unit}.{key} must be a positive integer or null, got {value!r}")
        return Fixed(**{key: given.get(key) for key in UNIT_KEYS})


def _check_model(model: ModelSpec) -> None:
    names = tuple(u.name for u in model.units)
    if names != UNITS or model.flows != (("encoder", "llm"), ("llm", "generator")):
        raise ConfigError(
            f"strategy=disttrain trains an encoder -> llm -> generator MLLM (model=mllm_9b, mllm_15b, "
            f"mllm_72b); model {model.name} has units {list(names)}"
        )


@dataclass(frozen=True)
class BatchLoads:
    """Each sequence of the step's batch: its encoder and generator loads (against the
    batch's mean sequence) and its size (encoder + generator seconds at nominal)."""

    encoder: tuple[float, ...]
    generator: tuple[float, ...]
    images: tuple[int, ...]

    @property
    def peak(self) -> dict[str, float]:
        return {"encoder": max(self.encoder), "llm": 1.0, "generator": max(self.generator)}


def _batch_loads(model: ModelSpec, seed: int, batch: int, data: str) -> BatchLoads:
    if data == "uniform":
        ones = (1.0,) * batch
        return BatchLoads(ones, ones, (model.extras["images_per_sequence"],) * batch)
    encoder = model.unit("encoder")
    side = round(model.extras["image_tokens"] ** 0.5)
    layouts = InterleavedData(seed, model.unit("llm").seq_len, model.extras["images_per_sequence"], side).batch(batch)
    # FLOPs per token and per token squared of one nominal image, from the unit's kernels.
    linear = quadratic = 0.0
    tokens = encoder.seq_len / model.extras["images_per_sequence"]
    for layer in encoder.layers:
        for kernel in layer.kernels:
            if kernel.attention_core:
                quadratic += kernel.flops() / tokens**2
            else:
                linear += kernel.flops() / tokens
    return BatchLoads(
        tuple(relative_loads([encoder_cost(l, linear, quadratic) for l in layouts])),
        tuple(relative_loads([generator_cost(l) for l in layouts])),
        tuple(l.images for l in layouts),
    )


def plan_disttrain(request: PlanRequest) -> Plan:
    opts = options_from(DistTrainOptions, request.options)
    model, cluster, train = request.model, request.cluster, request.train
    _check_model(model)
    # Before drawing a layout per sequence: the LLM takes one sequence per micro-batch.
    check_microbatch_count(
        -(-train.global_batch // cluster.devices), 1, f"global batch {train.global_batch} over at most {cluster.devices} LLM replicas"
    )
    loads = _batch_loads(model, train.seed, train.global_batch, opts.data)
    profiler = Profiler(model, cluster, train.precision, opts.zero_stage, opts.tp_overlap_chunks)
    orchestrator = Orchestrator(
        profiler,
        train.global_batch,
        cluster.devices,
        {u: opts.fixed(u) for u in UNITS},
        opts.recompute,
        opts.orchestration,
        loads.peak,
    )
    orchestration = orchestrator.solve()
    assignment = _assignment(opts.reorder, orchestration, profiler, loads)
    layouts = place([_layout(orchestration, profiler, u, assignment, loads, opts.zero_stage) for u in UNITS])
    program, brokers = disttrain_program(
        model, cluster, train.precision, train.global_batch, orchestration.microbatches, layouts, opts.tp_overlap_chunks
    )
    by_unit = {u.unit: u for u in layouts}
    units = [_unit_plan(cluster, by_unit[u], orchestration) for u in UNITS]
    memory = _check_memory(request, program, units)
    search = orchestration.search
    details = {
        "orchestration": opts.orchestration,
        "data": opts.data,
        "reorder": opts.reorder,
        "tp_overlap_chunks": opts.tp_overlap_chunks,
        "microbatches": orchestration.microbatches,
        "brokers": [b.as_dict() | {"ranks": compress_ranks(b.ranks)} for b in brokers],
        "estimate_s": round(orchestration.estimate_s, 6),
        "relaxed_s": round(orchestration.relaxed_s, 6),
        "search": search,
        "images_per_sequence": {"mean": sum(loads.images) / len(loads.images), "max": max(loads.images)},
        "sample_order": list(assignment.positions),
        "memory_gib": memory,
        "idle_devices": cluster.devices - program.world_size,
    }
    return Plan(
        strategy="disttrain",
        devices=program.world_size,
        units=units,
        program=program,
        precision=request.train.precision,
        details=details,
        sample_order=assignment.positions,
    )


def _assignment(reorder: str, orchestration: Orchestration, profiler: Profiler, loads: BatchLoads) -> Assignment:
    units = orchestration.units
    stages = {u: profiler.stages(u, c.tp, c.micro_batch, c.recompute, c.dp, c.pp) for u, c in units.items()}
    per_sequence = {u: float(stages[u].fb.sum()) / units[u].micro_batch for u in ("encoder", "generator")}
    sizes = [per_sequence["encoder"] * e + per_sequence["generator"] * g for e, g in zip(loads.encoder, loads.generator)]

    def slot_times(enc: float, gen: float) -> StageTimes:
        scale = {"encoder": enc, "llm": 1.0, "generator": gen}
        fwd = tuple(f * scale[u] for u in UNITS for f in stages[u].fwd.tolist())
        bwd = tuple(b * scale[u] for u in UNITS for b in stages[u].bwd.tolist())
        return StageTimes(fwd, bwd)

    return assign(
        reorder, sizes, loads.encoder, loads.generator, units["llm"].dp, units["encoder"].dp, units["generator"].dp, slot_times
    )


def _layout(
    orchestration: Orchestration, profiler: Profiler, unit: str, assignment: Assignment, loads: BatchLoads, zero_stage: int
) -> UnitLayout:
    c = orchestration.units[unit]
    per_sequence = {"encoder": loads.encoder, "generator": loads.generator}.get(unit)
    m = orchestration.microbatches
    unit_load = ((1.0,) * m,) * c.dp if per_sequence is None else unit_loads(assignment, per_sequence, c.dp, m)
    return UnitLayout(unit, c.tp, c.dp, c.pp, c.micro_batch, profiler.layers(unit, c.pp), c.recompute, zero_stage, 0, unit_load)


def _unit_plan(cluster, layout: UnitLayout, orchestration: Orchestration) -> UnitPlan:
    mesh = layout.mesh
    m = orchestration.microbatches
    return UnitPlan(
        unit=layout.unit,
        mesh=mesh,
        micro_batch=layout.micro_batch,
        num_microbatches=m,
        batch_per_replica=m * layout.micro_batch,
        stage_layers=layout.stages,
        sample_groups=m,
        zero_stage=layout.zero_stage,
        recompute=layout.recompute,
        details={
            "nodes": compress_ranks(tuple(sorted({cluster.node_of(r) for r in mesh.ranks}))),
            "max_load": round(max(max(row) for row in layout.loads), 3),
        },
    )


def _check_memory(request: PlanRequest, program, units: list[UnitPlan]) -> dict[str, float]:
    """Every rank class's memory as the Program holds it (loads included); a plan that
    does not fit is an error with its numbers."""
    by_name = {u.unit: u for u in units}
    worst: dict[str, tuple[float, str]] = {}
    for rank_program in program.classes:
        need = rank_memory(rank_program, by_name, request.model, request.train.precision)["total"]
        unit = rank_program.units[0]
        if need > worst.get(unit, (0.0, ""))[0]:
            worst[unit] = (need, rank_program.label)
    usable = request.cluster.usable_memory_bytes
    for unit, (need, label) in worst.items():
        if need > usable:
            raise PlanError(
                f"disttrain: {label} needs {need / GIB:.1f} GiB but a {request.cluster.device} has "
                f"{usable / GIB:.1f} GiB usable, short by {(need - usable) / GIB:.1f} GiB"
            )
    return {unit: round(need / GIB, 3) for unit, (need, _) in worst.items()}
