"""Pure data parallelism with ZeRO stages 0-3 (DeepSpeed's): every rank holds every unit.

The baseline a real run can be checked against most simply. Each rank runs its
micro-batches through all units; a contrastive model's loss sees every replica's features
(all-gather over DP with a reduce-scatter of their gradients, as Megatron-LM's colocated
towers do). The end of an iteration reduces gradients (all-reduce at ZeRO-0, reduce-scatter
from ZeRO-1), steps the optimizer on the local shard and all-gathers the updated
parameters (ZeRO-1/2). ZeRO-3 holds only a shard of the weights, so it all-gathers each
layer's parameters before that layer's forward and again before its backward, and
reduce-scatters each layer's gradients after its backward (with `overlap_comm`, DeepSpeed's
stage-3 behaviour: asynchronously, with the next layer's parameters prefetched up to
`prefetch_bucket_size`).

How ZeRO-3 fetches parameters changed with DeepSpeed's releases (`zero3_fetch`, by default
that of the `deepspeed_version` a run names, the current one when it names none):
- per_tensor (before 0.5.5): every partitioned tensor an all-gather of its own, each
  launched after a torch.cuda.synchronize(), so no gather overlaps compute or another
  (deepspeed/runtime/zero/partition_parameters.py _allgather_param of v0.3.13-0.5.4; issue
  #1069: one all-gather per parameter, 0.5 ms each with a synchronize; PR #1188: "the async
  version is not async at all"). Prefetching them gained nothing: none is priced.
- coalesced (0.5.5 to 0.5.x, PR #1188): a module's tensors in one all-gather, synchronous.
  Both of these synchronize the device at every fetch, so a layer's gradients, reduce-scattered
  asynchronously with overlap_comm, are waited for by the next layer's fetch; and both
  reduce-scatter the gradients tensor by tensor (reduce_scatter_coalesced came with 0.6.0).
- prefetched (0.6.0 on, PR #1453): as above, the next module's prefetched on a side stream
  with `overlap_comm`.

Gradients are reduced in `grad_reduce_dtype`, by default DeepSpeed's: its
communication_data_type is the model's 16-bit type at every ZeRO stage unless a run sets one
(deepspeed/runtime/engine.py, `communication_data_type`, since 0.5.8; before it, a ZeRO stage
reduced its gradients in their own 16-bit type), and under PyTorch AMP
(`cluster.amp`) the fp32 weights' gradients are fp32. PyTorch FSDP reduces in its
MixedPrecision's reduce_dtype (Composer's DEFAULT: fp32; PURE: the 16-bit type).

Memory is checked: the micro-batch (the whole per-replica batch unless fixed or too big)
and recomputation (none, selective, full) are the least memory-saving that fit, as the
other planners choose them; a plan that fits nowhere is refused with its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from src.batch_layout import BatchLayout
from src.cluster import GIB, gib
from src.config import check_positive, options_from
from src.costmodel.memory import check_grad_dtype, deepspeed_reduce_dtype, rank_memory
from src.errors import ConfigError, PlanError
from src.mesh import Mesh
from src.program import DEEPSPEED_PERSISTENCE_THRESHOLD, RECOMPUTE_MODES, Plan, Program, UnitPlan
from src.strategies.builders.replicas import on_batches, on_the_data
from src.strategies.base import PlanRequest, check_microbatch_count, microbatch_sizes
from src.strategies.builders.colocated import ColocatedEmitter, ColocatedUnit
from src.strategies.spec import AutoVariant, StrategySpec
from src.models.flows import unit_order

# DeepSpeed's defaults (parameters): stage3_prefetch_bucket_size, stage3_max_reuse_distance.
DEEPSPEED_PREFETCH_BUCKET = 50_000_000
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000
# ZeRO-3's fetch by DeepSpeed release: the first release of each (git tag --contains of the
# merge commits of PR #1188, 2021-10-31, and PR #1453, 2022-01-20).
ZERO3_FETCHES = ("per_tensor", "coalesced", "prefetched")
ZERO3_FETCH_SINCE = ((0, 6, 0), "prefetched"), ((0, 5, 5), "coalesced")


@dataclass(frozen=True)
class DDPOptions:
    zero_stage: int = 0
    micro_batch_size: int | None = None  # null: the whole per-replica batch at once, unless it does not fit
    recompute: str | None = None  # none | selective | full; null: the least that fits
    overlap_comm: bool = False  # ZeRO-3: asynchronous reduce-scatters and parameter prefetch
    prefetch_bucket_size: int = DEEPSPEED_PREFETCH_BUCKET
    max_reuse_distance: int = DEEPSPEED_MAX_REUSE_DISTANCE  # ZeRO-3, full recomputation: what stays gathered for the backward
    param_persistence_threshold: int = DEEPSPEED_PERSISTENCE_THRESHOLD  # ZeRO-3: tensors this small stay whole on every rank
    deepspeed_version: str | None = None  # the DeepSpeed release the run names (X.Y.Z); null: the current one
    zero3_fetch: str | None = None  # per_tensor | coalesced | prefetched; null: the named release's
    grad_reduce_dtype: str | None = None  # fp32 | bf16 | fp16; null: the model's type (fp32 under cluster.amp)

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"strategy.zero_stage={self.zero_stage!r}; choose 0, 1, 2 or 3")
        for key in ("micro_batch_size", "prefetch_bucket_size", "max_reuse_distance"):
            check_positive(f"strategy.{key}", getattr(self, key), optional=True)
        threshold = self.param_persistence_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(f"strategy.param_persistence_threshold must be a non-negative integer (elements), got {threshold!r}")
        if self.recompute is not None and self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"strategy.recompute={self.recompute!r}; choose one of {list(RECOMPUTE_MODES)} or null")
        if not isinstance(self.overlap_comm, bool):
            raise ConfigError(f"strategy.overlap_comm must be true or false, got {self.overlap_comm!r}")
        if self.deepspeed_version is not None and _release(self.deepspeed_version) is None:
            raise ConfigError(f"strategy.deepspeed_version is a DeepSpeed release like 0.3.15, got {self.deepspeed_version!r}")
        if self.zero3_fetch is not None and self.zero3_fetch not in ZERO3_FETCHES:
            raise ConfigError(f"strategy.zero3_fetch={self.zero3_fetch!r}; choose one of {list(ZERO3_FETCHES)} or null")
        check_grad_dtype("grad_reduce_dtype", self.grad_reduce_dtype)

    @property
    def fetch(self) -> str:
        """ZeRO-3's fetch: the one set, else the named release's, else the current one's."""
        if self.zero3_fetch is not None:
            return self.zero3_fetch
        release = _release(self.deepspeed_version) if self.deepspeed_version is not None else None
        if release is None:
            return "prefetched"
        return next((fetch for since, fetch in ZERO3_FETCH_SINCE if release >= since), "per_tensor")


def _release(version: object) -> tuple[int, int, int] | None:
    parts = version.split(".") if isinstance(version, str) else []
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    major, minor, patch = (int(p) for p in parts)
    return major, minor, patch


def _micro_batches(request: PlanRequest, opts: DDPOptions, dp: int) -> list[int]:
    """Micro-batch sizes to try, largest first: the fixed one, or the whole per-replica
    batch and then its divisors (those the contrastive batch allows)."""
    train = request.train
    batch = BatchLayout(train.global_batch, dp)
    if opts.micro_batch_size is not None:
        fixed = replace(batch, micro_batch=opts.micro_batch_size)
        check_microbatch_count(fixed.per_replica, fixed.micro_batch, f"per-replica batch {fixed.per_replica}")
        choices = [fixed.micro_batch]
    else:
        choices = microbatch_sizes(batch.per_replica)
    if request.model.interaction is not None:
        fitting = [m for m in choices if m * dp >= train.contrastive_batch]
        if not fitting:
            raise ConfigError(
                f"micro-batch {choices[0]} x dp {dp} = {choices[0] * dp} samples per loss is below the "
                f"contrastive batch {train.contrastive_batch}"
            )
        choices = fitting
    return choices


def _build(
    request: PlanRequest, opts: DDPOptions, dp: int, mb: int, recompute: str, probe: bool = False
) -> tuple[Plan, dict[str, float]]:
    """The plan and its rank's memory. `probe` builds at most two micro-batches, an inner
    one and the last (whose backward overlaps the gradient reduction): each micro-batch's
    backward follows its forward, so their memory is the whole iteration's, priced before a
    Program of up to MAX_MICROBATCHES micro-batches is built."""
    model = request.model
    batch = BatchLayout(request.train.global_batch, dp, mb)
    microbatches = min(2, batch.microbatches) if probe else batch.microbatches
    mesh = Mesh.contiguous((("dp", dp),))
    program = Program(world_size=dp, classes=[])
    names = unit_order(model)
    # Only the current fetch prefetches (see the module's docstring).
    prefetch = float(opts.prefetch_bucket_size) if opts.fetch == "prefetched" else 0.0
    reduce_dtype = deepspeed_reduce_dtype(opts.grad_reduce_dtype, request.train.precision, request.cluster.amp)
    emitter = ColocatedEmitter(
        model,
        request.cluster,
        request.train.precision,
        program,
        [
            ColocatedUnit(
                name,
                mesh,
                recompute,
                opts.zero_stage,
                overlap_comm=opts.overlap_comm,
                prefetch_params=prefetch,
                reuse_distance=float(opts.max_reuse_distance),
                persistence_threshold=float(opts.param_persistence_threshold),
                fetch_per_tensor=opts.fetch == "per_tensor",
                synchronous_release=opts.fetch != "prefetched",
            )
            for name in names
        ],
        grad_reduce_dtype=reduce_dtype,
    )
    emitter.replicated_step(microbatches, mb, dp)
    unit_plans = [
        UnitPlan(
            unit=name,
            mesh=mesh,
            micro_batch=mb,
            num_microbatches=microbatches,
            batch_per_replica=batch.per_replica,
            stage_layers=((0, model.unit(name).num_layers),),
            sample_groups=microbatches,
            zero_stage=opts.zero_stage,
            recompute=recompute,
            gathered_params=emitter.gathered_params(name),
            overlap_comm=opts.overlap_comm,
            prefetch_params=prefetch if opts.overlap_comm and opts.zero_stage == 3 else 0.0,
            reuse_distance=float(opts.max_reuse_distance) if opts.zero_stage == 3 else 0.0,
            persistence_threshold=float(opts.param_persistence_threshold),
            zero3_fetch=opts.fetch if opts.zero_stage == 3 else "prefetched",
            grad_reduce_dtype=reduce_dtype,
        )
        for name in names
    ]
    plan = Plan(
        strategy="ddp",
        devices=dp,
        units=unit_plans,
        program=program,
        precision=request.train.precision,
        details={
            "dp": dp,
            "micro_batch": mb,
            "zero_stage": opts.zero_stage,
            "recompute": recompute,
            "overlap_comm": opts.overlap_comm,
            **({"zero3_fetch": opts.fetch} if opts.zero_stage == 3 else {}),
            "grad_reduce_dtype": reduce_dtype,
        },
    )
    memory = rank_memory(program.classes[0], {u.unit: u for u in unit_plans}, model, request.train.precision, request.cluster.amp)
    return plan, memory


def plan_ddp(request: PlanRequest) -> Plan:
    return on_the_data(_plan_at_mean(request), request)


def plan_ddp_batches(request: PlanRequest, batches: Sequence[int | None]) -> list[Plan]:
    return on_batches(_plan_at_mean(request), request, batches)


def _plan_at_mean(request: PlanRequest) -> Plan:
    """The first micro-batch and recomputation (least first) whose rank fits memory."""
    opts = options_from(DDPOptions, request.options)
    dp = request.cluster.devices
    usable = request.cluster.usable_memory_bytes
    closest: tuple[float, str] | None = None
    for mb in _micro_batches(request, opts, dp):
        for recompute in (r for r in RECOMPUTE_MODES if opts.recompute in (None, r)):
            _, memory = _build(request, opts, dp, mb, recompute, probe=True)
            if memory["total"] <= usable:
                plan, memory = _build(request, opts, dp, mb, recompute)
                plan.details["memory_gib"] = round(memory["total"] / GIB, 3)
                return plan
            short = memory["total"] - usable
            if closest is None or short < closest[0]:
                parts = ", ".join(
                    f"{k} {gib(memory[k])}" for k in ("weights", "grads", "optimizer", "gathered", "activations") if k in memory
                )
                closest = (
                    short,
                    f"ddp zero_stage={opts.zero_stage} dp={dp} micro-batch={mb} recompute={recompute}: "
                    f"a rank needs {gib(memory['total'])} GiB ({parts}) but each "
                    f"{request.cluster.device} has {gib(usable)} GiB usable, short by "
                    f"{gib(short)} GiB",
                )
    assert closest is not None, "_micro_batches yields a size or refuses the batch"
    raise PlanError(closest[1])


STRATEGY = StrategySpec(
    "ddp",
    plan_ddp,
    DDPOptions,
    batches=plan_ddp_batches,
    plan_fields={
        "micro_batch": "strategy.micro_batch_size",
        "recompute": "strategy.recompute",
        "zero_stage": "strategy.zero_stage",
        "blocking": "strategy.overlap_comm",
        "zero3_fetch": "strategy.zero3_fetch",
    },
    # DeepSpeed's stage-3 default overlaps the per-layer reduce-scatter and the prefetch.
    auto_variants=(AutoVariant("zero3", {"zero_stage": 3, "overlap_comm": True}),),
)
