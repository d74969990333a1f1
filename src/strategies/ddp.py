"""Pure data parallelism with ZeRO stages 0-3 (DeepSpeed's): every rank holds every unit.

The baseline a real run can be checked against most simply. Each rank runs its
micro-batches through all units; a contrastive model's loss sees every replica's features
(all-gather over DP with a reduce-scatter of their gradients, as Megatron-LM's colocated
towers do). The end of an iteration reduces gradients (all-reduce at ZeRO-0, reduce-scatter
from ZeRO-1), steps the optimizer on the local shard and all-gathers the updated
parameters (ZeRO-1/2). ZeRO-3 holds only a shard of the weights, so it all-gathers each
layer's parameters before that layer's forward and again before its backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from src.config import options_from
from src.costmodel.memory import element_bytes, grad_bytes
from src.errors import ConfigError
from src.models.spec import ModelSpec
from src.program import BatchSync, Collective, Compute, Instruction, Plan, Program, RankProgram, UnitPlan, Work
from src.strategies.base import PlanRequest
from src.strategies.emit import trainable_params
from src.strategies.layout import Grid, make_group
from src.strategies.stages import Segment, unit_order

DP_GROUP = "dp"


@dataclass(frozen=True)
class DDPOptions:
    zero_stage: int = 0
    micro_batch_size: int | None = None  # null: the whole per-replica batch at once

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"strategy.zero_stage={self.zero_stage!r}; choose 0, 1, 2 or 3")
        mb = self.micro_batch_size
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0):
            raise ConfigError(f"strategy.micro_batch_size must be a positive integer or null, got {mb!r}")


def _micro_batch(request: PlanRequest, opts: DDPOptions, dp: int) -> int:
    train = request.train
    if train.global_batch % dp:
        raise ConfigError(f"global batch {train.global_batch} is not divisible by dp={dp} devices")
    per_replica = train.global_batch // dp
    mb = opts.micro_batch_size or per_replica
    if per_replica % mb:
        raise ConfigError(f"per-replica batch {per_replica} (global {train.global_batch} / dp {dp}) is not "
                          f"divisible by strategy.micro_batch_size={mb}")
    if request.model.interaction is not None and mb * dp < train.contrastive_batch:
        raise ConfigError(f"micro-batch {mb} x dp {dp} = {mb * dp} samples per loss is below the contrastive "
                          f"batch {train.contrastive_batch}")
    return mb


def _layer_pass(model: ModelSpec, unit: str, phase: str, mb: int, j: int, zero_stage: int, dp: int,
                param_bytes: int) -> list[Instruction]:
    """One unit's forward or backward for micro-batch j: one Compute, or under ZeRO-3 one
    parameter all-gather + Compute per layer (backward in reverse layer order)."""
    spec = model.unit(unit)
    if zero_stage < 3 or dp == 1:
        return [Compute(Work(unit, phase, mb, (0, spec.num_layers)), microbatch=j)]
    out: list[Instruction] = []
    layers = range(spec.num_layers)
    for layer in (layers if phase == "fwd" else reversed(layers)):
        params = spec.layers[layer].params
        if params:
            out.append(Collective("all_gather", DP_GROUP, params * param_bytes, "dp"))
        out.append(Compute(Work(unit, phase, mb, (layer, layer + 1)), microbatch=j))
    return out


def _tail(model: ModelSpec, units: list[str], zero_stage: int, dp: int, precision: str) -> list[Instruction]:
    segments = [Segment(u, (0, model.unit(u).num_layers)) for u in units]
    params = trainable_params(model, segments, 1)
    if params == 0:
        return []
    out: list[Instruction] = []
    if dp > 1:
        op = "all_reduce" if zero_stage == 0 else "reduce_scatter"
        out.append(Collective(op, DP_GROUP, params * grad_bytes(precision), "dp"))
    shard = dp if zero_stage >= 1 else 1
    out += [Compute(Work(s.unit, "optimizer", 0, s.layers, shard=shard)) for s in segments
            if not model.unit(s.unit).frozen]
    if zero_stage in (1, 2) and dp > 1:
        out.append(Collective("all_gather", DP_GROUP, params * element_bytes(precision), "dp"))
    return out


def plan_ddp(request: PlanRequest) -> Plan:
    opts = options_from(DDPOptions, request.options)
    model, precision = request.model, request.train.precision
    dp = request.cluster.devices
    mb = _micro_batch(request, opts, dp)
    per_replica = request.train.global_batch // dp
    microbatches = per_replica // mb
    grid = Grid(1, dp, 1)
    program = Program(world_size=dp, classes=[])
    if dp > 1:
        program.add_group(make_group(request.cluster, DP_GROUP, grid.ranks, [grid.ranks]))
    pbytes = element_bytes(precision)
    towers = [u for u in unit_order(model) if u != model.interaction]
    instructions: list[Instruction] = []
    for j in range(microbatches):
        for unit in towers:
            instructions += _layer_pass(model, unit, "fwd", mb, j, opts.zero_stage, dp, pbytes)
        if model.interaction is not None:
            interaction = model.unit(model.interaction)
            feature_elems = sum(model.unit(u).output_elems for u in towers)
            volume = feature_elems * mb * dp * pbytes
            gather = Collective("all_gather", DP_GROUP, volume, "interaction") if dp > 1 else None
            work = Work(interaction.name, "interaction", len(towers) * mb, (0, interaction.num_layers),
                        contrastive_batch=mb * dp)
            instructions.append(BatchSync((j,), work, gather))
            if dp > 1:
                instructions.append(Collective("reduce_scatter", DP_GROUP, volume, "interaction"))
        for unit in reversed(towers):
            if model.needs_backward(unit):
                instructions += _layer_pass(model, unit, "bwd", mb, j, opts.zero_stage, dp, pbytes)
    units = towers + ([model.interaction] if model.interaction else [])
    instructions += _tail(model, units, opts.zero_stage, dp, precision)
    program.classes.append(RankProgram(ranks=grid.ranks, instructions=instructions, label="all ranks",
                                       units=tuple(units)))
    unit_plans = [UnitPlan(unit=u, dp=dp, tp=1, pp=1, ranks=grid.ranks, micro_batch=mb,
                           num_microbatches=microbatches, batch_per_replica=per_replica,
                           stage_layers=((0, model.unit(u).num_layers),),
                           details={"zero_stage": opts.zero_stage, "recompute": "none"})
                  for u in units]
    return Plan(strategy="ddp", devices=dp, units=unit_plans, program=program,
                details={"dp": dp, "micro_batch": mb, "zero_stage": opts.zero_stage})
