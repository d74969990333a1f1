"""Programs of the Megatron-LM baseline for one fixed choice of degrees.

Two shapes, as the papers describe Megatron-LM on multimodal models:
- a pipeline (GPT/LLM units; MLLMs with the encoder and generator as extra stages or
  merged into the first/last stage), TP inside every stage, DP over replicas;
- colocated towers (CLIP/CoCa/LiT): every device runs both towers with the same TP and DP,
  and the contrastive loss all-gathers both modalities' features over DP (DistMM §7.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from src.cluster import ClusterSpec
from src.mesh import Mesh
from src.models.spec import ModelSpec
from src.program import Program, UnitPlan
from src.schedules.pipeline import build_schedule
from src.strategies.base import Degrees
from src.strategies.builders.colocated import ColocatedEmitter, ColocatedUnit
from src.strategies.builders.layout import megatron_mesh, replicated_mesh
from src.strategies.builders.pipeline import PipelineEmitter, PipelineSettings
from src.models.flows import unit_order
from src.strategies.builders.stages import Segment


@dataclass(frozen=True)
class MegatronSettings:
    schedule: str
    recompute: str
    sequence_parallel: bool
    zero_stage: int
    overlap_grad_reduce: bool
    modality_stages: str
    uneven_pp: bool
    scatter_gather: bool = True  # pipeline sends of 1/tp plus a TP all-gather (stages.stage_transfer)
    replicate: tuple[str, ...] = ()  # units replicated over their stage's TP group (stages.StageRun)
    overlap_param_gather: bool = False  # the distributed optimizer's all-gather chained into the next forward
    grad_reduce_dtype: str | None = None  # data parallelism's gradient type; None: Megatron-LM's (memory.grad_bytes)
    grad_all_reduce: bool = False  # the whole gradient all-reduced under a sharded optimizer (DeepSpeed's pipeline engine)
    grad_accum_dtype: str | None = None  # a second copy of the gradients accumulated in this type (memory.kept_grad_bytes)
    p2p: str = "eager"  # how stages exchange payloads (builders.pipeline.P2P_EXCHANGES)
    extra_warmup: int = 0  # warm-up forwards beyond 1F1B's on every stage but the last (schedules.pipeline)


def pipeline_program(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    precision: str,
    deg: Degrees,
    cfg: MegatronSettings,
    virtual: list[list[Segment]],
) -> tuple[Program, list[UnitPlan]]:
    """`virtual`: the pp x vpp virtual stages (stages.pipeline_segments, or a balanced cut)."""
    pp, vpp = deg.pp, deg.vpp
    mesh = megatron_mesh(deg.tp, deg.dp, pp)
    orders = build_schedule(cfg.schedule, pp, deg.batch_layout(global_batch).microbatches, vpp, cfg.extra_warmup)
    program = Program(world_size=mesh.size, classes=[])
    settings = PipelineSettings(
        deg.micro_batch,
        cfg.recompute,
        cfg.sequence_parallel,
        cfg.zero_stage,
        cfg.overlap_grad_reduce,
        scatter_gather=cfg.scatter_gather,
        replicate=cfg.replicate,
        overlap_param_gather=cfg.overlap_param_gather,
        grad_reduce_dtype=cfg.grad_reduce_dtype,
        grad_all_reduce=cfg.grad_all_reduce,
        p2p=cfg.p2p,
    )
    emitter = PipelineEmitter(model, cluster, precision, program, mesh, virtual, settings)
    for stage in range(pp):
        program.classes.append(emitter.rank_program(emitter.stage(stage, orders[stage]), f"stage {stage}"))
    return program, pipeline_unit_plans(model, mesh, global_batch, deg, cfg, virtual)


def pipeline_unit_plans(
    model: ModelSpec, mesh: Mesh, global_batch: int, deg: Degrees, cfg: MegatronSettings, virtual: list[list[Segment]]
) -> list[UnitPlan]:
    """Each unit's plan in a pipeline of the (tp, dp, pp) `mesh`: the stages that hold it
    and its layers on each (virtual) stage; a unit replicated over its stage's TP group has
    the rows axis where the others have tp (layout.replicated_mesh)."""
    pp, vpp = deg.pp, deg.vpp
    batch = deg.batch_layout(global_batch)
    unit_plans = []
    for name in unit_order(model):
        stages = sorted({v % pp for v, segs in enumerate(virtual) for s in segs if s.unit == name})
        ranges = tuple(s.layers for segs in virtual for s in segs if s.unit == name)
        chunks = 1
        if len(ranges) > len(stages):
            # Some stage holds several chunks of the unit: it spans the whole interleaved
            # pipeline, with an empty range where a virtual stage holds none of it (a
            # balanced cut's encoder-only stage).
            stages, ranges, chunks = list(range(pp)), _every_virtual_stage(name, virtual), vpp
        replicated = name in cfg.replicate and deg.tp > 1
        if replicated:
            unit_mesh = replicated_mesh(mesh, stages[0])
        else:
            ranks = tuple(r for st in stages for r in mesh.slice(pp=st))
            unit_mesh = Mesh((("tp", deg.tp), ("dp", deg.dp), ("pp", len(stages))), ranks)
        unit_plans.append(
            UnitPlan(
                unit=name,
                mesh=unit_mesh,
                micro_batch=batch.micro_batch,
                num_microbatches=batch.microbatches,
                batch_per_replica=batch.per_replica,
                stage_layers=ranges,
                sample_groups=batch.sample_groups,
                vpp=chunks,
                zero_stage=cfg.zero_stage,
                recompute=cfg.recompute,
                sequence_parallel=cfg.sequence_parallel and not replicated,
                overlap_comm=cfg.overlap_grad_reduce,
                param_gather="overlapped" if cfg.overlap_param_gather else "step_end",
                grad_reduce_dtype=cfg.grad_reduce_dtype,
                grad_accum_dtype=cfg.grad_accum_dtype,
                details={"pipeline_stages": stages},
            )
        )
    return unit_plans


def _every_virtual_stage(unit: str, virtual: list[list[Segment]]) -> tuple[tuple[int, int], ...]:
    """The unit's layer range on every virtual stage; (k, k) where it has none, k being
    where its layers stand at that point of the chain."""
    out, cursor = [], 0
    for segments in virtual:
        held = [s.layers for s in segments if s.unit == unit]
        if held:
            cursor = held[-1][1]
            out.append((held[0][0], cursor))
        else:
            out.append((cursor, cursor))
    return tuple(out)


def colocated_program(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, precision: str, deg: Degrees, cfg: MegatronSettings
) -> tuple[Program, list[UnitPlan]]:
    """Both towers on every device, same TP and DP; the contrastive loss sees the features
    of all DP replicas (all-gather over DP, reduce-scatter of their gradients back)."""
    assert not cfg.overlap_param_gather, "the planner refuses chained parameter gathers for colocated towers"
    mesh = Mesh.contiguous((("tp", deg.tp), ("dp", deg.dp)))
    batch = deg.batch_layout(global_batch)
    microbatches, mb = batch.microbatches, batch.micro_batch
    program = Program(world_size=mesh.size, classes=[])
    names = unit_order(model)
    emitter = ColocatedEmitter(
        model,
        cluster,
        precision,
        program,
        [
            ColocatedUnit(name, mesh, cfg.recompute, cfg.zero_stage, cfg.sequence_parallel, overlap_comm=cfg.overlap_grad_reduce)
            for name in names
        ],
        grad_reduce_dtype=cfg.grad_reduce_dtype,
    )
    emitter.replicated_step(microbatches, mb, deg.dp)
    unit_plans = [
        UnitPlan(
            unit=name,
            mesh=mesh,
            micro_batch=mb,
            num_microbatches=microbatches,
            batch_per_replica=batch.per_replica,
            stage_layers=((0, model.unit(name).num_layers),),
            sample_groups=batch.sample_groups,
            zero_stage=cfg.zero_stage,
            recompute=cfg.recompute,
            sequence_parallel=cfg.sequence_parallel,
            overlap_comm=cfg.overlap_grad_reduce,
            grad_reduce_dtype=cfg.grad_reduce_dtype,
            grad_accum_dtype=cfg.grad_accum_dtype,
        )
        for name in names
    ]
    return program, unit_plans
