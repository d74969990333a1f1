"""DeepSpeed's pipeline engine reduces data parallelism's gradients by an all-reduce of the
whole gradient after the flush even under a sharded optimizer (strategy.grad_all_reduce,
which deepspeed3d sets), each replica then stepping its shard and all-gathering the updated
parameters; Megatron-LM's distributed optimizer reduce-scatters instead."""

from __future__ import annotations

import pytest

from src.errors import ConfigError
from src.program import Collective, Plan
from src.setup import plan_run, validate
from tests.composing import composed
from tests.strategies.node_gpt import node_gpt

# A GPT of 4 blocks on one 8-GPU node, TP 2, PP 2, so two data-parallel replicas per stage.
BASE = node_gpt(4, 8) + [
    "train.precision=bf16",
    "strategy.tp=2",
    "strategy.pp=2",
    "strategy.micro_batch_size=1",
    "strategy.recompute=none",
]


def _plan(*extra: str) -> Plan:
    return plan_run(validate(composed(BASE + list(extra))))


def _dp_bytes(plan: Plan) -> dict[str, float]:
    out: dict[str, float] = {}
    for i in plan.program.classes[0].instructions:
        if isinstance(i, Collective) and i.kind == "dp":
            out[i.op] = out.get(i.op, 0.0) + i.bytes * i.count
    return out


def test_the_whole_gradient_is_all_reduced_then_the_parameters_gathered() -> None:
    sharded = _dp_bytes(_plan("strategy=megatron", "strategy.zero_stage=1", "strategy.grad_reduce_dtype=bf16"))
    whole = _dp_bytes(
        _plan("strategy=megatron", "strategy.zero_stage=1", "strategy.grad_reduce_dtype=bf16", "strategy.grad_all_reduce=true")
    )
    assert set(sharded) == {"reduce_scatter", "all_gather"} and set(whole) == {"all_reduce", "all_gather"}
    # The same gradient bytes enter each collective; an all-reduce moves twice a reduce-scatter's.
    assert whole["all_reduce"] == pytest.approx(sharded["reduce_scatter"])
    assert whole["all_gather"] == pytest.approx(sharded["all_gather"])


def test_deepspeed3d_reduces_as_its_pipeline_engine() -> None:
    ops = _dp_bytes(_plan("strategy=deepspeed3d"))
    assert set(ops) == {"all_reduce", "all_gather"}


def test_it_cannot_overlap_the_backward() -> None:
    with pytest.raises(ConfigError, match="grad_all_reduce"):
        _plan("strategy=megatron", "strategy.zero_stage=1", "strategy.grad_all_reduce=true", "strategy.overlap_grad_reduce=true")


@pytest.mark.parametrize(("precision", "stage", "ops"), [("bf16", 1, {"all_reduce", "all_gather"}), ("fp16", 0, {"all_reduce"})])
def test_deepspeed3d_shards_its_optimizer_only_where_bf16_optimizer_does(precision: str, stage: int, ops: set[str]) -> None:
    """The entry point's ds_config.json enables no ZeRO (stage 0: no gather after the step);
    a bf16 model's BF16_Optimizer shards the fp32 states as ZeRO-1 does."""
    plan = _plan("strategy=deepspeed3d", f"train.precision={precision}")
    assert {u.zero_stage for u in plan.units} == {stage}
    assert set(_dp_bytes(plan)) == ops


def test_deepspeed3d_refuses_the_zero_stages_its_pipeline_engine_refuses() -> None:
    with pytest.raises(ConfigError, match="^strategy.zero_stage=2: DeepSpeed's pipeline engine") as err:
        _plan("strategy=deepspeed3d", "strategy.zero_stage=2")
    assert "\n" not in str(err.value)
