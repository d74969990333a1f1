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
from src.errors import ConfigError
from src.mesh import Mesh
from src.program import Instruction, Plan, Program, UnitPlan
from src.strategies.base import PlanRequest
from src.strategies.colocated import ColocatedEmitter, ColocatedUnit
from src.models.flows import unit_order


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


def plan_ddp(request: PlanRequest) -> Plan:
    opts = options_from(DDPOptions, request.options)
    model = request.model
    dp = request.cluster.devices
    mb = _micro_batch(request, opts, dp)
    per_replica = request.train.global_batch // dp
    microbatches = per_replica // mb
    mesh = Mesh.contiguous((("dp", dp),))
    program = Program(world_size=dp, classes=[])
    names = unit_order(model)
    emitter = ColocatedEmitter(model, request.cluster, request.train.precision, program,
                               [ColocatedUnit(name, mesh, "none", opts.zero_stage) for name in names])
    towers = emitter.towers()
    contrastive = model.interaction is not None
    if contrastive:
        emitter.query_routes(microbatches, {t: mb for t in towers}, {t: mb for t in towers}, with_keys=dp == 1)
    instructions: list[Instruction] = []
    for j in range(microbatches):
        interaction = (emitter.contrastive(j, emitter.dp_group[towers[0]], mb * dp, len(towers) * mb, mb * dp)
                       if contrastive else [])
        instructions += emitter.microbatch(j, {t: mb for t in towers}, interaction)
    instructions += emitter.tail()
    program.classes.append(emitter.rank_program(instructions))
    unit_plans = [UnitPlan(unit=name, mesh=mesh, micro_batch=mb, num_microbatches=microbatches,
                           batch_per_replica=per_replica, stage_layers=((0, model.unit(name).num_layers),),
                           sample_groups=microbatches, zero_stage=opts.zero_stage)
                  for name in names]
    return Plan(strategy="ddp", devices=dp, units=unit_plans, program=program,
                details={"dp": dp, "micro_batch": mb, "zero_stage": opts.zero_stage})
