"""DeepSpeed-3D: Megatron-LM's tensor parallelism inside DeepSpeed's pipeline engine, over
data parallelism, as the codebase Par4D cites for it runs ([7]: DeepSpeedExamples'
`Megatron-LM-v1.1.5-3D_parallelism`, "3d parallelism with megatronlm and zero redundancy
optimizer", February 2021: a snapshot of Megatron-LM v1.1.5 inside DeepSpeed's pipeline).

What separates it from today's Megatron-LM baseline is what that codebase runs:
- DeepSpeed's pipeline engine's 1F1B schedule (TrainSchedule; no interleaving), its exchanges
  in the schedule's step order, a pass's sends opening the next step, each p2p.send a
  broadcast over the two stages' group with async_op False, which the sender's stream waits
  on until the receiver has posted its receive (p2p: deepspeed; at v0.3.15 and v0.6.5: 0.9.0
  swapped each step's two exchanges);
- the optimizer as its entry point configures it (examples/ds_pretrain_gpt2_pipe.sh with
  examples/ds_config.json, no zero_optimization section: ZeRO stage 0, the whole optimizer
  on every replica), except that a bf16 model's BF16_Optimizer shards the fp32 master weights
  and moments over the replicas (ZeRO-1);
- the whole gradient all-reduced after the pipeline flush (its engine's _exec_reduce_grads:
  buffered_allreduce_fallback, at DeepSpeed 0.3.15, 0.6.5 and 0.13.0), each replica then
  stepping its shard and, where the optimizer is sharded, all-gathering the updated
  parameters: three gradients' worth of traffic where Megatron-LM's distributed optimizer
  moves two; nothing overlapped with the backward;
- no sequence parallelism (it came with Megatron-LM 3.0, 2022);
- the pipeline partitioned by transformer layers (GPT2ModelPipe's
  partition_method='type:transformer'), so stages differ by at most one block;
- eager attention: ParallelSelfAttention writes QK^T to memory (torch.baddbmm), then
  FusedScaleMaskSoftmax and dropout over the scores; FlashAttention (2022) came later.
  The attention kernel is the software's, so it is this strategy's option `attention`,
  which the door builds the model with (its descriptor's `software`, src/strategies/spec.py);
- the loss as Megatron-LM's vocab-parallel cross entropy on an fp32 copy of the logits
  (megatron/model/gpt2_model.py: `output.float()`, its example scripts
  ds_pretrain_gpt2*.sh passing --fp16 and no --fp16-lm-cross-entropy);
- weight gradients added into the 16-bit `.grad` by autograd every micro-batch (2020: before
  Megatron-LM's gradient accumulation fusion), and for a bf16 model cast into an fp32 copy
  after it (model.grad_accumulation's cast);
- gradients reduced over data parallelism in DeepSpeed's communication_data_type, the
  model's 16-bit type (ZeRO-1's allreduce_bucket casts to it; deepspeed/runtime/engine.py's
  default since 0.5.8; fp32 under PyTorch AMP), where Megatron-LM forces fp32 for bf16. The
  codebase ran fp16 (DeepSpeed had no bf16 in 2021); a bf16 run such as Par4D's needs a
  DeepSpeed with bf16 pipelines (0.6.2 on, PR #1801), which reduces in 16 bits too;
- a bf16 model's gradients kept twice: those pipelines run BF16_Optimizer, which adds each
  micro-batch's bf16 `.grad` into an fp32 copy of every gradient (update_hp_grads) and
  all-reduces that copy (cast to bf16), neither sharded: 2 + 4 bytes a parameter
  (grad_accum_dtype; bf16_optimizer.py at 0.6.5 and 0.13.0).
The Programs are the Megatron pipeline's, built and searched by the Megatron planner
with these settings fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from src.cluster import ATTENTION_MODES, CROSS_ENTROPY_MODES, GRAD_ACCUMULATIONS, PARAM_GRAD_KERNELS
from src.config import options_from
from src.costmodel.memory import (
    check_grad_dtype,
    deepspeed_accum_dtype,
    deepspeed_bf16_optimizer,
    deepspeed_reduce_dtype,
)
from src.errors import ConfigError
from src.models.elementwise import UNFUSABLE
from src.program import Plan
from src.strategies.base import PlanRequest
from src.strategies.megatron.planner import plan_megatron
from src.strategies.spec import AutoVariant, StrategySpec


@dataclass(frozen=True)
class DeepSpeed3DOptions:
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    recompute: str | None = None
    uneven_pp: bool = True
    # 0 or 1 (its pipeline engine refuses ZeRO-2 and 3); null: as the codebase's entry point
    # runs: its ds_config.json has no zero_optimization section (stage 0: the whole optimizer
    # on every replica), but a bf16 model's BF16_Optimizer shards its fp32 states (stage 1).
    zero_stage: int | None = None
    # DeepSpeed's pipeline engine partitions activations across the TP ranks it sends them
    # from (is_pipe_partitioned) and gathers them on arrival, as Megatron's scatter/gather; its
    # gradients too from 0.5.8 (is_grad_partitioned, PR #1407), as the pipeline here prices both.
    # Not priced: 0.3.15 (an fp16 run's release) sends each gradient whole, TP times the bytes,
    # its receiver all-gathering its own saved output instead.
    scatter_gather: bool = True
    # The codebase's attention kernel (eager: its scores in memory), its parameter
    # gradients' reductions (separate: Megatron-LM v1.1.5's own layers and apex's LayerNorm)
    # and its loss (fp32: the vocab-parallel cross entropy on an fp32 copy); null: the run's
    # (the cluster preset's). The model's options, when set, win.
    attention: str | None = "eager"
    param_grad_kernels: str | None = "separate"
    cross_entropy: str | None = "fp32"
    # How its weight gradients accumulate; null: the codebase's for the run's precision
    # (software): autograd's AccumulateGrad into the 16-bit `.grad` (DeepSpeed's engine over
    # Megatron-LM v1.1.5's layers, before gradient accumulation fusion), and for a bf16 model
    # its BF16_Optimizer's cast into an fp32 copy after each micro-batch.
    grad_accumulation: str | None = None
    # The operations it runs as PyTorch's separate kernels (src/models/elementwise.py): its
    # scale-mask-softmax, as Megatron-LM v1.1.5 runs it without the fusion flag (off by
    # default, and the example script sets none) and in bf16 whatever the flag (its fused
    # path takes fp16 inputs only); model.unfused wins.
    unfused: tuple[str, ...] | None = ("softmax",)
    # The type its gradients are reduced in; null: DeepSpeed's communication_data_type.
    grad_reduce_dtype: str | None = None
    # The type a second copy of its gradients accumulates in; null: DeepSpeed's (its
    # BF16_Optimizer's fp32 for a bf16 model, none otherwise: memory.deepspeed_accum_dtype).
    grad_accum_dtype: str | None = None

    def __post_init__(self) -> None:
        for key, modes in (
            ("attention", ATTENTION_MODES),
            ("param_grad_kernels", PARAM_GRAD_KERNELS),
            ("cross_entropy", CROSS_ENTROPY_MODES),
            ("grad_accumulation", GRAD_ACCUMULATIONS),
        ):
            value = getattr(self, key)
            if value is not None and value not in modes:
                raise ConfigError(f"strategy.{key}={value!r}; choose one of {list(modes)} or null")
        named = list(self.unfused or ())
        unknown = sorted(set(named) - set(UNFUSABLE))
        if unknown:
            raise ConfigError(f"strategy.unfused={named} names {unknown}: the operations are {', '.join(UNFUSABLE)}")
        check_grad_dtype("grad_reduce_dtype", self.grad_reduce_dtype)
        check_grad_dtype("grad_accum_dtype", self.grad_accum_dtype)
        if self.zero_stage not in (None, 0, 1):
            raise ConfigError(
                f"strategy.zero_stage={self.zero_stage!r}: DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 "
                f"(stages 2 and 3 are incompatible with pipeline parallelism); choose 0, 1 or null"
            )

    def megatron_options(self, precision: str, amp: bool) -> dict:
        """Megatron-LM's options for this codebase, the gradients reduced in DeepSpeed's
        type for the run's `precision` (fp32 weights' gradients under `amp`)."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "vpp": 1,
            "micro_batch_size": self.micro_batch_size,
            "schedule": "1f1b",
            "recompute": self.recompute,
            "sequence_parallel": False,
            "zero_stage": deepspeed_zero_stage(self.zero_stage, precision, amp),
            "overlap_grad_reduce": False,
            "grad_all_reduce": True,
            "p2p": "deepspeed",
            "uneven_pp": self.uneven_pp,
            "scatter_gather": self.scatter_gather,
            "grad_reduce_dtype": deepspeed_reduce_dtype(self.grad_reduce_dtype, precision, amp),
            "grad_accum_dtype": deepspeed_accum_dtype(self.grad_accum_dtype, precision, amp),
        }


def deepspeed_zero_stage(zero_stage: int | None, precision: str, amp: bool) -> int:
    """The ZeRO stage a run sets, else the codebase's: its entry point's config enables none,
    and a bf16 model's BF16_Optimizer (every bf16 pipeline's, DeepSpeed 0.6.2 on) shards the
    fp32 master weights and moments over the replicas as ZeRO-1 does."""
    if zero_stage is not None:
        return zero_stage
    return 1 if deepspeed_bf16_optimizer(precision, amp) else 0


def software(options: dict, precision: str, amp: bool) -> dict[str, Any]:
    """The model settings this strategy's software fixes for a run in `precision` (the door
    builds the model with them)."""
    opts = options_from(DeepSpeed3DOptions, options)
    settings = {
        "attention": opts.attention,
        "param_grad_kernels": opts.param_grad_kernels,
        "cross_entropy": opts.cross_entropy,
        "grad_accumulation": opts.grad_accumulation or ("cast" if deepspeed_bf16_optimizer(precision, amp) else "hook"),
    }
    return {key: value for key, value in settings.items() if value is not None} | {"unfused": tuple(opts.unfused or ())}


def plan_deepspeed3d(request: PlanRequest) -> Plan:
    opts = options_from(DeepSpeed3DOptions, request.options)
    if request.model.interaction is not None:
        raise ConfigError(
            f"deepspeed3d pipelines language models; {request.model.name} has a contrastive "
            f"interaction (use strategy=megatron or distmm)"
        )
    try:
        plan = plan_megatron(replace(request, options=opts.megatron_options(request.train.precision, request.cluster.amp)))
    except ConfigError as err:
        raise type(err)(f"deepspeed3d (Megatron-LM pipeline in DeepSpeed's engine): {err}") from None
    plan.strategy = "deepspeed3d"
    return plan


STRATEGY = StrategySpec(
    "deepspeed3d",
    plan_deepspeed3d,
    DeepSpeed3DOptions,
    plan_fields={
        "tp": "strategy.tp",
        "pp": "strategy.pp",
        "micro_batch": "strategy.micro_batch_size",
        "recompute": "strategy.recompute",
        "zero_stage": "strategy.zero_stage",
        "scatter": "strategy.scatter_gather",
    },
    software=software,
    auto_variants=(AutoVariant("deepspeed3d"),),
)
