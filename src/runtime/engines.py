"""DeepSpeed glue: one engine per group of units that share a data-parallel group.

The engine owns gradient reduction and the optimizer (ZeRO 0-3 over the unit's DP group).
It runs in DeepSpeed's unmanaged gradient-accumulation mode: the executor calls
`backward` once per instruction (micro-batch, stage, batch-sync) with the outputs to
start from and their gradients, already scaled, and `step` once at the Program's optimizer
instruction, which updates. ZeRO-0/1 reduce gradients inside `step`, ZeRO-2/3 during
backward. Wherever DeepSpeed communicates, each operation of its communication backend is
timed (`time_deepspeed_comm`), and the executor charges that time to DP communication
instead of to the compute around it.

backend.deepspeed is merged into each engine's config (gradient clipping, the scheduler);
the client optimizer is runtime.optimizer's (its parameter groups, the logit-scale clamp).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from src.config import ContrastiveSpec, DeepSpeedSpec
from src.program import DEEPSPEED_PERSISTENCE_THRESHOLD, UnitPlan
from src.runtime.comm import CLOCK, all_gather_single, reduce_scatter_single
from src.runtime.optimizer import OPTIMIZERS, attach_zero0_norm, build_optimizer, mark_tensor_parallel, scheduler_params
from src.runtime.own_engine import OwnEngine

# prebuild_ops: the worker's entry imports it from here, beside the engines it prepares for.
from src.runtime.op_build import prebuild_ops, without_load_notice  # noqa: F401


@dataclass(frozen=True)
class ParallelGroups:
    """What DeepSpeed calls an mpu: this rank's data- and model-parallel groups."""

    dp: dist.ProcessGroup
    dp_ranks: tuple[int, ...]
    tp: dist.ProcessGroup | None
    tp_ranks: tuple[int, ...]
    # The same slice of the model's other pipeline stages, where the engine clips by the
    # model's norm, its own reduced over them (runtime.clipping).
    pp: dist.ProcessGroup | None = None

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.dp_ranks.index(dist.get_rank())

    def get_data_parallel_world_size(self) -> int:
        return len(self.dp_ranks)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)

    # DeepSpeed's "model parallel" is what is not data parallel: here the TP group (a
    # pipeline's stages hold different parameters and never reduce together).
    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.tp

    def get_model_parallel_rank(self) -> int:
        return self.tp_ranks.index(dist.get_rank()) if self.tp is not None else 0

    def get_model_parallel_world_size(self) -> int:
        return len(self.tp_ranks) if self.tp is not None else 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_ranks[0] if self.tp is not None else dist.get_rank()


@dataclass(frozen=True)
class EngineSettings:
    zero_stage: int
    micro_batch: int
    accumulation: int  # backward calls of one micro-batch's worth per step (for DeepSpeed's batch bookkeeping)
    deepspeed: DeepSpeedSpec = DeepSpeedSpec()
    contrastive: ContrastiveSpec = ContrastiveSpec()
    steps: int = 1  # the run's train.steps: a decaying schedule's end where its config leaves it null
    # Gradients reduced during the backward: by DeepSpeed under ZeRO-3 (which also prefetches
    # parameters), by the executor's buckets (runtime.grad_reduce) under plain DP.
    overlap_comm: bool = False
    prefetch_params: int = 0  # ZeRO-3 with overlap_comm: parameters gathered ahead of the layer that needs them
    reuse_distance: int = 0  # ZeRO-3: DeepSpeed's stage3_max_reuse_distance as the plan priced it; 0: its default
    persistence_threshold: int = DEEPSPEED_PERSISTENCE_THRESHOLD  # ZeRO-3: DeepSpeed's stage3_param_persistence_threshold

    @classmethod
    def of(cls, unit: UnitPlan, deepspeed: DeepSpeedSpec, contrastive: ContrastiveSpec, steps: int) -> EngineSettings:
        """The engine of `unit` (and of the units sharing its data-parallel group) as its
        plan priced it, trained as backend.deepspeed and backend.contrastive say."""
        return cls(
            zero_stage=unit.zero_stage,
            micro_batch=unit.micro_batch,
            accumulation=unit.num_microbatches,
            deepspeed=deepspeed,
            contrastive=contrastive,
            steps=steps,
            overlap_comm=unit.overlap_comm,
            prefetch_params=int(unit.prefetch_params),
            reuse_distance=int(unit.reuse_distance),
            persistence_threshold=int(unit.persistence_threshold),
        )

    @property
    def overlaps_zero3(self) -> bool:
        """DeepSpeed overlaps this engine's ZeRO-3 collectives with compute (below ZeRO-3
        the executor's buckets overlap the reductions, if anything does)."""
        return self.overlap_comm and self.zero_stage == 3


def deepspeed_config(settings: EngineSettings, dp: int) -> dict:
    """A plain dict (never OmegaConf): DeepSpeed inspects the type."""
    # Overlap is what the plan says, never DeepSpeed's default (stage 3 overlaps and
    # prefetches unless told otherwise).
    zero: dict = {"stage": settings.zero_stage, "overlap_comm": settings.overlaps_zero3}
    if settings.zero_stage == 3:
        # The plan's threshold (the tiny models' plans set 0 to partition every tensor).
        zero["stage3_param_persistence_threshold"] = settings.persistence_threshold
        zero["stage3_prefetch_bucket_size"] = settings.prefetch_params if settings.overlap_comm else 0
        if settings.reuse_distance:
            zero["stage3_max_reuse_distance"] = settings.reuse_distance
    training = settings.deepspeed
    config = {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": settings.accumulation,
        "train_batch_size": settings.micro_batch * settings.accumulation * dp,
        "managed_gradient_accumulation": False,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # ZeRO-0's fp32 path clips in the client optimizer's hook (runtime.optimizer), where
        # the norm it takes is kept.
        "gradient_clipping": training.gradient_clipping if settings.zero_stage > 0 else 0.0,
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
        # A checkpoint's tag is checked by an all-reduce over the whole world, which ranks
        # holding different numbers of engines would not all join (runtime.checkpoint).
        "checkpoint": {"tag_validation": "Ignore"},
    }
    if training.scheduler is not None:
        config["scheduler"] = {"type": training.scheduler.type, "params": scheduler_params(training.scheduler, settings.steps)}
    return config


# Whether some engine of the run this process runs overlaps ZeRO-3's collectives with compute.
_overlapping = False


def new_run() -> None:
    """A run starts in this process (runtime.worker may run several one after another): none
    of its engines overlaps ZeRO-3's collectives yet."""
    global _overlapping
    _overlapping = False


def start_deepspeed_comm(overlapped: bool) -> None:
    """Start DeepSpeed's communication on the process group the worker joined (it loads
    the shm op), its ZeRO all-gathers and reduce-scatters on torch's current collectives:
    DeepSpeed 0.19 picks the ones torch 2.13 deprecates, a FutureWarning per call site and
    rank (81-137 lines before a ZeRO-3 run's results).

    Unless an engine of the run overlaps them (`overlapped`, once said, for every later
    one of the run too), each is waited for as it is issued: DeepSpeed issues ZeRO-3's fetches
    asynchronously and waits right after, inside its hooks, where timing the op (its launch
    only) would leave the wait booked as compute."""
    import deepspeed

    global _overlapping
    _overlapping = _overlapping or overlapped
    with without_load_notice():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    backend = importlib.import_module("deepspeed.comm.comm").cdb  # the module's global, set by init_distributed
    gather, scatter = all_gather_single, reduce_scatter_single
    backend.all_gather_function = gather if _overlapping else _waited(gather)
    backend.reduce_scatter_function = scatter if _overlapping else _waited(scatter)


def _waited(collective: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args, async_op: bool = False, **kwargs):
        work = collective(*args, async_op=async_op, **kwargs)
        if async_op:
            work.wait()
        return work

    return run


def make_engine(module: nn.Module, groups: ParallelGroups, settings: EngineSettings):
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    mark_tensor_parallel(module)
    optimizer = build_optimizer(module, settings.deepspeed, settings.contrastive)
    start_deepspeed_comm(settings.overlaps_zero3)
    with without_load_notice():
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, mpu=groups, config=deepspeed_config(settings, len(groups.dp_ranks))
        )
    if settings.zero_stage == 0:
        attach_zero0_norm(engine, settings.deepspeed.gradient_clipping)
        # The executor reduced them during the backward; or a group of one has nothing to reduce
        # with (DeepSpeed would still copy every gradient into its buckets and back: two passes).
        if settings.overlap_comm or len(groups.dp_ranks) == 1:
            engine.enable_backward_allreduce = False
    return engine


def partitioned_at_init(groups: ParallelGroups, settings: EngineSettings) -> contextlib.AbstractContextManager:
    """ZeRO-3's construction context: each parameter is partitioned over the data-parallel
    group as soon as its module is built (DeepSpeed's zero.Init)."""
    import deepspeed

    # zero.Init reads the world from DeepSpeed's communication, which engine creation
    # would start.
    start_deepspeed_comm(settings.overlaps_zero3)
    return deepspeed.zero.Init(
        data_parallel_group=groups.dp, config_dict_or_path=deepspeed_config(settings, len(groups.dp_ranks)), mpu=groups
    )


# DeepSpeed's communication backend's operations: what its comms logger would time (every
# op of deepspeed.comm that moves data or synchronises ranks).
DEEPSPEED_OPS = (
    "all_reduce",
    "inference_all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_base",
    "all_gather_coalesced",
    "all_gather_object",
    "all_to_all_single",
    "all_to_all",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
)


_inside_op = False  # whether a DeepSpeed op is running: one it calls is inside its time


def _timed(op: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args, **kwargs):
        global _inside_op
        if _inside_op:
            return op(*args, **kwargs)
        _inside_op = True
        try:
            with CLOCK.timed("dp"):
                return op(*args, **kwargs)
        finally:
            _inside_op = False

    run.timed = True  # type: ignore[attr-defined]
    return run


def time_deepspeed_comm() -> None:
    """From now on, charge every operation of DeepSpeed's communication backend to DP
    communication (CLOCK, as the runtime's own collectives): an asynchronous op's time is
    the time to issue it, its wait being DeepSpeed's and not told apart from compute
    (start_deepspeed_comm waits inside the op for those the plan does not overlap).

    DeepSpeed's comms logger would time the same ops, but it binds each call's arguments
    to the op's signature and keeps a record of every call: 25-80 us an op, which a ZeRO-3
    step pays for each of its parameter fetches. The backend lives as long as the process's
    DeepSpeed communication: its ops are wrapped once."""
    backend = importlib.import_module("deepspeed.comm.comm").cdb  # the module's global, set by init_distributed
    for name in DEEPSPEED_OPS:
        op = getattr(backend, name, None)
        if op is not None and not getattr(op, "timed", False):
            setattr(backend, name, _timed(op))


def runs_autograd_backward(engine) -> bool:
    """Whether DeepSpeed's `backward` for `engine` is autograd's and a count of the call:
    ZeRO-0 on the optimizer the engine was given (no ZeRO or bf16 wrapper to scale a loss
    or reduce in hooks), no loss scaler of DeepSpeed's, and unmanaged accumulation, so
    nothing is reduced before `step`. Its bookkeeping around autograd costs 25-100 us a call
    (timers, a graph tracker with a hook on the loss, the reduction's checks), and a
    Program calls it once per unit and micro-batch: three times a step of a tiny CLIP."""
    return (
        engine.zero_optimization_stage() == 0
        and type(engine.optimizer) in OPTIMIZERS.values()  # make_engine's, unwrapped
        and engine.torch_autocast_z0_gradscaler is None
        and not engine.managed_gradient_accumulation()
    )


def backward(engine, ends: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor], micro_step: int) -> None:
    """One backward call (a layer range of one micro-batch): the gradients of
    sum(end . seed) into the engine's parameters and the graph's leaves.

    Where DeepSpeed's backward is autograd's (`runs_autograd_backward`), autograd runs it and
    the call is counted as DeepSpeed counts it (its `step` advances `global_samples`, which
    checkpoints keep, by the calls since the last step). Else DeepSpeed's backward runs on
    the surrogate loss. ZeRO-3 copies a parameter's first gradient partition of a step and
    adds the later ones, telling them apart by its micro-step, which only the engine's own
    forward advances; the executor runs the layers without it, so it says which micro-step
    (the micro-batch's place in the step) this is."""
    if runs_autograd_backward(engine):
        torch.autograd.backward(list(ends), list(seeds))
        engine._unmanaged_backward_count += 1
        return
    if hasattr(engine.optimizer, "micro_step_id"):
        engine.optimizer.micro_step_id = micro_step
    surrogate = functools.reduce(operator.add, ((end * seed).sum() for end, seed in zip(ends, seeds)))
    engine.backward(surrogate, scale_wrt_gas=False)


def point_reduction_at(engine) -> None:
    """Call just before `step`, which reduces gradients (ZeRO-0/1; ZeRO-2/3 reduced during
    backward). DeepSpeed's reduction reads the data-parallel group of the LAST engine
    initialised in the process (a module global): point it at this engine's. An engine of
    our own (runtime.own_engine) reduces its gradients itself: nothing to point."""
    if isinstance(engine, OwnEngine):
        return
    from deepspeed.utils import groups

    groups.mpu = engine.mpu
