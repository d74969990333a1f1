"""Device memory of one rank: model states by precision and ZeRO stage, and the
activations its schedule keeps alive at once, read off its instruction order."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Iterable, Mapping, Sequence

from src.errors import ConfigError
from src.mesh import Sharding
from src.models.spec import LayerSpec, ModelSpec
from src.program import RECOMPUTE_MODES, Compute, RankProgram, UnitPlan


def check_memory_options(recompute: str | None, zero_stage: int | None, zero_note: str) -> None:
    """The memory options a planner accepts: a recompute mode and ZeRO 0 or 1 (null:
    searched along memory_ladder); `zero_note` says why stages 2-3 are not offered."""
    if recompute is not None and recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"strategy.recompute={recompute!r}; choose one of {list(RECOMPUTE_MODES)} or null")
    if zero_stage not in (None, 0, 1):
        raise ConfigError(f"strategy.zero_stage={zero_stage!r}: {zero_note}; use 0, 1 or null")


def memory_ladder(recompute: str | None = None, zero_stage: int | None = None) -> tuple[tuple[str, int], ...]:
    """Memory-saving settings (recompute mode, ZeRO stage) to try, cheapest first: the
    distributed optimizer before recomputation, selective before full. Every strategy
    turns them on only as far as memory requires; a value fixed by the user pins it."""
    return tuple((r, z) for r in RECOMPUTE_MODES for z in (0, 1) if recompute in (None, r) and zero_stage in (None, z))


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state (mixed-precision Adam, Megatron-style)."""

    weights: float
    grads: float
    optimizer: float


def element_bytes(precision: str) -> int:
    """Bytes of one activation or 16/32-bit weight element at a training precision."""
    return 4 if precision == "fp32" else 2


def weight_bytes(precision: str, amp: bool) -> int:
    """Bytes of one weight element as a collective moves it (ZeRO-3's gathers, the updated
    parameters' all-gather): 16-bit weights', or fp32 under PyTorch AMP, which keeps fp32
    weights and casts them at each use."""
    return 4 if amp else element_bytes(precision)


# The types a data-parallel reduction may send gradients in (a strategy's grad_reduce_dtype).
REDUCE_DTYPES = ("fp32", "bf16", "fp16")


def states_precision(precision: str, amp: bool) -> str:
    """The precision whose model states a run keeps: PyTorch AMP keeps fp32 weights, fp32
    gradients and two fp32 moments (no master copy), fp32 training's states."""
    return "fp32" if amp else precision


def check_grad_dtype(option: str, dtype: str | None) -> None:
    """A strategy's gradient-type option (grad_reduce_dtype, grad_accum_dtype): one of
    REDUCE_DTYPES or null."""
    if dtype is not None and dtype not in REDUCE_DTYPES:
        raise ConfigError(f"strategy.{option}={dtype!r}; choose one of {list(REDUCE_DTYPES)} or null")


def deepspeed_reduce_dtype(grad_reduce_dtype: str | None, precision: str, amp: bool) -> str:
    """The type DeepSpeed reduces (and keeps) gradients in: the one a run sets, else its
    communication_data_type, the model's type (fp32 under PyTorch AMP: fp32 weights'
    gradients)."""
    if grad_reduce_dtype is not None:
        return grad_reduce_dtype
    return "fp32" if amp else precision


def reduce_bytes(precision: str, grad_reduce_dtype: str | None) -> int:
    """A gradient element's bytes as data parallelism reduces it: the type a strategy sets,
    else as Megatron-LM keeps and reduces them (grad_bytes)."""
    return grad_bytes(precision) if grad_reduce_dtype is None else element_bytes(grad_reduce_dtype)


def deepspeed_bf16_optimizer(precision: str, amp: bool) -> bool:
    """Whether DeepSpeed runs a model under its BF16_Optimizer (every bf16 pipeline from 0.6.2):
    a bf16 model, not PyTorch AMP's fp32 weights."""
    return precision == "bf16" and not amp


def deepspeed_accum_dtype(grad_accum_dtype: str | None, precision: str, amp: bool) -> str | None:
    """The type DeepSpeed accumulates gradients in beside the model's 16-bit `.grad`s: the one
    a run sets, else its BF16_Optimizer's fp32 for a bf16 model (data_types.grad_accum_dtype;
    the optimizer every bf16 pipeline runs, 0.6.2 on), none otherwise (fp16's `.grad`s are
    the accumulation; AMP's fp32 weights' too)."""
    if grad_accum_dtype is not None:
        return grad_accum_dtype
    return "fp32" if deepspeed_bf16_optimizer(precision, amp) else None


def kept_grad_bytes(precision: str, grad_reduce_dtype: str | None, grad_accum_dtype: str | None = None) -> int:
    """A gradient element's bytes as kept through a step: in the type it is reduced in
    (reduce_bytes), plus a second copy where a framework accumulates in another type beside it
    (DeepSpeed's BF16_Optimizer: each micro-batch's bf16 `.grad` added into an fp32 copy of every
    gradient, neither sharded: 2 + 4 bytes)."""
    extra = 0 if grad_accum_dtype is None else element_bytes(grad_accum_dtype)
    return reduce_bytes(precision, grad_reduce_dtype) + extra


def grad_bytes(precision: str) -> int:
    """Bytes per gradient element as kept and reduced: Megatron-LM accumulates and
    all-reduces bf16 models' gradients in fp32 (it forces this for bf16), fp16 models'
    in fp16 (its default), fp32 models' in fp32."""
    return 2 if precision == "fp16" else 4


def state_bytes(precision: str, frozen: bool, grads: int | None = None) -> StateBytes:
    """16-bit training keeps 16-bit weights, gradients of `grads` bytes (None: as
    grad_bytes() says), and fp32 master weights + two Adam moments; fp32 training keeps fp32
    weights and gradients and two moments. A frozen unit keeps only its weights."""
    weights = float(element_bytes(precision))
    if frozen:
        return StateBytes(weights, 0.0, 0.0)
    if precision == "fp32":
        return StateBytes(4.0, 4.0, 8.0)
    return StateBytes(weights, float(grad_bytes(precision) if grads is None else grads), 12.0)


@dataclass(frozen=True)
class ZeroShards:
    """How many data-parallel ranks share each model state of a parameter."""

    weights: int
    grads: int
    optimizer: int


def zero_shards(dp: int, zero_stage: int) -> ZeroShards:
    """ZeRO-1 (Megatron's distributed optimizer) shards the optimizer state over the `dp`
    replicas, ZeRO-2 also the gradients, ZeRO-3 also the weights."""
    return ZeroShards(dp if zero_stage >= 3 else 1, dp if zero_stage >= 2 else 1, dp if zero_stage >= 1 else 1)


def model_state_bytes(
    params: float, precision: str, frozen: bool, zero_stage: int, dp: int, grads: int | None = None
) -> dict[str, float]:
    """Per-device bytes of weights, gradients (`grads` bytes each, None: grad_bytes) and
    optimizer state for `params` parameters held by one model-parallel shard replicated `dp`
    times, sharded as zero_shards says."""
    per, shards = state_bytes(precision, frozen, grads), zero_shards(dp, zero_stage)
    return {
        "weights": params * per.weights / shards.weights,
        "grads": params * per.grads / shards.grads,
        "optimizer": params * per.optimizer / shards.optimizer,
    }


def work_activation_bytes(model: ModelSpec, compute: Compute, recompute: str, per_sample: dict[tuple, float] | None = None) -> float:
    """Activations one forward Work leaves alive until its backward. A layer run as
    several kernel ranges keeps its activations once, counted on the range that starts it.
    `per_sample`: a memo of one sample's bytes by layer range, sharding and recompute mode
    (a rank's micro-batches repeat the same few)."""
    work = compute.work
    if work.kernels is not None and work.kernels[0] > 0:
        return 0.0
    key = (work.unit, work.layers, work.sharding, recompute)
    sample = per_sample.get(key) if per_sample is not None else None
    if sample is None:
        unit = model.unit(work.unit)
        start, end = work.layers
        sample = sum(
            layer.kept_activations(work.sharding, recompute)
            for index, layer in enumerate(unit.layers[start:end], start)
            if not layer.forward_only and (unit.trains(layer) or model.needs_input_grad(work.unit, index))
        )
        if per_sample is not None:
            per_sample[key] = sample
    return sample * work.samples * work.fraction * work.load


def rematerialised_bytes(layers: Sequence[LayerSpec], sharding: Sharding) -> float:
    """One sample's bytes that full recomputation brings back for a moment in a backward: its
    largest block's whole activations (the layers around the blocks keep theirs anyway)."""
    return max((layer.activations.per_device(sharding, "none") for layer in layers if layer.block), default=0.0)


def peak_activation_bytes(computes: Iterable[Compute], model: ModelSpec, recompute: Mapping[str, str]) -> float:
    """Peak of live activations over a rank's computations in instruction order: a forward
    adds its activations, the matching backward frees them. Under full recompute a
    backward also rematerialises its largest layer's full activations for a moment.
    `recompute` maps each unit to its mode (none, selective, full)."""
    live = 0.0
    peak = 0.0
    alive: dict[tuple, float] = {}
    freed: set[tuple] = set()  # forwards a backward freed whole (its later kernel ranges free nothing)
    per_sample: dict[tuple, float] = {}
    for instruction in computes:
        work = instruction.work
        key = (work.unit, work.layers, instruction.chunk, instruction.microbatch)
        if work.phase == "fwd" and model.needs_backward(work.unit):
            size = work_activation_bytes(model, instruction, recompute.get(work.unit, "none"), per_sample)
            alive[key] = alive.get(key, 0.0) + size
            live += size
            peak = max(peak, live)
        elif work.phase in ("bwd", "bwd_input"):
            if recompute.get(work.unit, "none") == "full":
                unit = model.unit(work.unit)
                start, end = work.layers
                rematerialised = rematerialised_bytes(unit.layers[start:end], work.sharding)
                peak = max(peak, live + rematerialised * work.samples * work.fraction * work.load)
            live -= _free(alive, freed, key, model, instruction, recompute.get(work.unit, "none"))
    return peak


def _free(alive: dict[tuple, float], freed: set[tuple], key: tuple, model: ModelSpec, backward: Compute, recompute: str) -> float:
    """Activations a backward frees: its forward's (the first of the backward's kernel
    ranges frees it whole); for a backward split layer by layer (overlap_grad_reduce's
    last micro-batch), its layers' share of the forward covering them; for a forward split
    layer by layer (the parameter gathers' first forward), every piece it covers."""
    if key in alive:
        freed.add(key)
        return alive.pop(key)
    if key in freed:
        return 0.0
    unit, (start, end), chunk, microbatch = key
    for (held_unit, (first, last), held_chunk, held_mb), held in alive.items():
        if (held_unit, held_chunk, held_mb) == (unit, chunk, microbatch) and first <= start and end <= last:
            part = min(held, work_activation_bytes(model, backward, recompute))
            alive[(held_unit, (first, last), held_chunk, held_mb)] = held - part
            return part
    pieces = [k for k in alive if (k[0], k[2], k[3]) == (unit, chunk, microbatch) and start <= k[1][0] and k[1][1] <= end]
    for piece in pieces:
        freed.add(piece)
    return sum(alive.pop(piece) for piece in pieces)


def _outermost(held: dict[tuple[str, tuple[int, int]], Sharding]) -> dict[tuple[str, tuple[int, int]], Sharding]:
    """The held ranges no other range of their unit covers: a range one forward runs layer
    by layer and the others whole holds its states once. By start, the longest first: a
    range is covered when an earlier one of its unit reaches as far."""
    kept: set[tuple[str, tuple[int, int]]] = set()
    reach: dict[str, int] = {}
    for name, (start, end) in sorted(held, key=lambda key: (key[0], key[1][0], -key[1][1])):
        if reach.get(name, -1) < end:
            kept.add((name, (start, end)))
        reach[name] = max(reach.get(name, -1), end)
    return {key: sharding for key, sharding in held.items() if key in kept}


def rank_memory(
    rank_program: RankProgram, units: Mapping[str, UnitPlan], model: ModelSpec, precision: str, amp: bool = False
) -> dict[str, float]:
    """Bytes one rank of a class needs: the model states of every layer range it computes
    (sharded by its unit's TP, and under ZeRO by its data replicas: a unit replicated over
    its TP group holds it whole and shards it over TP x DP) and its peak live activations.
    `amp`: PyTorch AMP's fp32 states (states_precision) and fp32 gathered weights."""
    computes = [i for i in rank_program.instructions if isinstance(i, Compute)]
    held: dict[tuple[str, tuple[int, int]], Sharding] = {}
    for instruction in computes:
        if instruction.work.phase in ("fwd", "interaction"):
            held[(instruction.work.unit, instruction.work.layers)] = instruction.work.sharding
    held = _outermost(held)
    out = {"weights": 0.0, "grads": 0.0, "optimizer": 0.0}
    for (name, (start, end)), sharding in held.items():
        unit = model.unit(name)
        plan = units[name]
        shards = sharding.devices
        trainable = unit.trainable_params(start, end) / shards
        fixed = sum(layer.params for layer in unit.layers[start:end]) / shards - trainable
        # Gradients are kept in the type a strategy reduces them in where it sets one (DeepSpeed's
        # ZeRO: 16-bit .grad and partitions, its gradient_accumulation_dtype the model's), and
        # again in the type it accumulates them in beside that, where one does (BF16_Optimizer).
        grads = kept_grad_bytes(precision, plan.grad_reduce_dtype, plan.grad_accum_dtype)
        for params, frozen in ((trainable, False), (fixed, True)):
            for key, value in model_state_bytes(
                params, states_precision(precision, amp), frozen, plan.zero_stage, plan.data_replicas, grads
            ).items():
                out[key] += value
    gathered = sum(units[name].gathered_params for name in {name for name, _ in held})
    if gathered:
        out["gathered"] = gathered * weight_bytes(precision, amp)
    recompute = {name: plan.recompute for name, plan in units.items()}
    out["activations"] = peak_activation_bytes(computes, model, recompute)
    out["total"] = sum(out.values())
    return out
