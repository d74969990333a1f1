"""DeepSpeed-3D: Megatron-LM's tensor parallelism inside DeepSpeed's pipeline engine with
ZeRO-1 over data parallelism (Microsoft's "3D parallelism with MegatronLM and ZeRO"
example, Par4D's second baseline).

What separates it from the Megatron-LM baseline is what DeepSpeed's integration runs:
its pipeline engine's 1F1B schedule (TrainSchedule; no interleaving), ZeRO stage 1
always (optimizer states sharded over data parallelism: gradients reduce-scattered and
parameters all-gathered after the flush, not overlapped with the backward), no sequence
parallelism, and stages balanced by parameters (partition_method "parameters", so stages
may differ by a block). The Programs are the Megatron pipeline's, built and searched by
the Megatron planner with these settings fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from src.config import options_from
from src.errors import ConfigError
from src.program import Plan
from src.strategies.base import PlanRequest
from src.strategies.megatron.planner import plan_megatron


# The real backend's refusals name plan fields (src.errors.PlanRefused); these options set them.
PLAN_FIELDS = {
    "tp": "strategy.tp",
    "pp": "strategy.pp",
    "micro_batch": "strategy.micro_batch_size",
    "recompute": "strategy.recompute",
    "scatter": "strategy.scatter_gather",
}


@dataclass(frozen=True)
class DeepSpeed3DOptions:
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    recompute: str | None = None
    uneven_pp: bool = True
    # DeepSpeed's pipeline engine partitions activations across the TP ranks it sends them
    # from (is_pipe_partitioned) and gathers them on arrival, as Megatron's scatter/gather.
    scatter_gather: bool = True

    def megatron_options(self) -> dict:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "vpp": 1,
            "micro_batch_size": self.micro_batch_size,
            "schedule": "1f1b",
            "recompute": self.recompute,
            "sequence_parallel": False,
            "zero_stage": 1,
            "overlap_grad_reduce": False,
            "uneven_pp": self.uneven_pp,
            "scatter_gather": self.scatter_gather,
        }


def plan_deepspeed3d(request: PlanRequest) -> Plan:
    opts = options_from(DeepSpeed3DOptions, request.options)
    if request.model.interaction is not None:
        raise ConfigError(
            f"deepspeed3d pipelines language models; {request.model.name} has a contrastive "
            f"interaction (use strategy=megatron or distmm)"
        )
    try:
        plan = plan_megatron(replace(request, options=opts.megatron_options()))
    except ConfigError as err:
        raise type(err)(f"deepspeed3d (Megatron-LM pipeline, ZeRO-1): {err}") from None
    plan.strategy = "deepspeed3d"
    return plan
