"""The type data parallelism reduces gradients in (strategy.grad_reduce_dtype): by default
DeepSpeed's communication_data_type, the model's type at every ZeRO stage (fp32 under
PyTorch AMP, whose weights are fp32); FSDP's reduce_dtype where a run sets it."""

from __future__ import annotations

import pytest

from src.costmodel.memory import rank_memory
from src.errors import ConfigError
from src.program import Collective, Plan
from src.setup import plan_run, validate
from tests.composing import composed
from tests.strategies.node_gpt import node_gpt

# A GPT of 2 blocks, hidden 512, on one 8-GPU node: every trained parameter's gradient is
# reduced once a step (ZeRO 0-2) or once a micro-batch (ZeRO-3, one micro-batch here).
MODEL = node_gpt(2, 8) + ["train.precision=bf16"]
BASE = MODEL + ["strategy=ddp", "strategy.recompute=none", "strategy.micro_batch_size=1"]


def _plan(*extra: str) -> Plan:
    return plan_run(validate(composed(BASE + list(extra))))


def _reduced_bytes(plan: Plan) -> float:
    return sum(
        i.bytes * i.count
        for i in plan.program.classes[0].instructions
        if isinstance(i, Collective) and i.op in ("all_reduce", "reduce_scatter")
    )


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_default_reduces_in_the_model_type_and_fp32_doubles_the_bytes(stage: int) -> None:
    default = _plan(f"strategy.zero_stage={stage}")
    fp32 = _plan(f"strategy.zero_stage={stage}", "strategy.grad_reduce_dtype=fp32")
    assert default.units[0].grad_reduce_dtype == "bf16" and fp32.units[0].grad_reduce_dtype == "fp32"
    assert _reduced_bytes(default) > 0
    assert _reduced_bytes(fp32) == pytest.approx(2 * _reduced_bytes(default))


def test_under_amp_the_fp32_weights_gradients_are_reduced_in_fp32() -> None:
    amp = _plan("strategy.zero_stage=3", "cluster.amp=true")
    assert amp.units[0].grad_reduce_dtype == "fp32"
    assert _reduced_bytes(amp) == pytest.approx(_reduced_bytes(_plan("strategy.zero_stage=3", "strategy.grad_reduce_dtype=fp32")))


def test_megatron_keeps_reducing_bf16_models_gradients_in_fp32() -> None:
    """Megatron-LM forces fp32 gradient reduction for bf16 (src.costmodel.memory.grad_bytes):
    its units state no grad_reduce_dtype of their own."""
    plan = plan_run(validate(composed([*MODEL, "strategy=megatron", "strategy.tp=1", "strategy.pp=1", "strategy.zero_stage=0"])))
    assert plan.units[0].grad_reduce_dtype is None
    assert _reduced_bytes(plan) == pytest.approx(_reduced_bytes(_plan("strategy.zero_stage=0", "strategy.grad_reduce_dtype=fp32")))


def test_a_bad_type_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="^strategy.grad_reduce_dtype='int8'") as err:
        _plan("strategy.grad_reduce_dtype=int8")
    assert "\n" not in str(err.value)


PIPELINE = [*MODEL, "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=1", "strategy.recompute=none"]


def test_deepspeed3d_reduces_in_deepspeeds_16_bit_type_where_megatron_lm_forces_fp32() -> None:
    """DeepSpeed-3D's ZeRO-1 casts its gradient buckets to communication_data_type (bf16):
    half the bytes of its fp32 reduction, and of Megatron-LM's forced fp32 (the estimate
    the search ranks by prices the same)."""
    ds3d = plan_run(validate(composed(PIPELINE + ["strategy=deepspeed3d"])))
    ds3d_fp32 = plan_run(validate(composed(PIPELINE + ["strategy=deepspeed3d", "strategy.grad_reduce_dtype=fp32"])))
    megatron = plan_run(validate(composed(PIPELINE + ["strategy=megatron", "strategy.zero_stage=1", "strategy.vpp=1"])))
    megatron_bf16 = plan_run(
        validate(
            composed(PIPELINE + ["strategy=megatron", "strategy.zero_stage=1", "strategy.vpp=1", "strategy.grad_reduce_dtype=bf16"])
        )
    )
    assert ds3d.units[0].grad_reduce_dtype == "bf16" and megatron.units[0].grad_reduce_dtype is None
    assert _reduced_bytes(ds3d) > 0
    assert _reduced_bytes(ds3d_fp32) == pytest.approx(2 * _reduced_bytes(ds3d))
    assert _reduced_bytes(megatron) == pytest.approx(_reduced_bytes(ds3d_fp32))
    assert _reduced_bytes(megatron_bf16) == pytest.approx(_reduced_bytes(ds3d))


@pytest.mark.parametrize("strategy", ["megatron", "deepspeed3d"])
def test_a_bad_pipeline_type_is_refused_in_one_line(strategy: str) -> None:
    with pytest.raises(ConfigError, match="strategy.grad_reduce_dtype='int8'") as err:
        plan_run(validate(composed(PIPELINE + [f"strategy={strategy}", "strategy.grad_reduce_dtype=int8"])))
    assert "\n" not in str(err.value)


def test_deepspeed_keeps_its_gradients_in_the_type_it_reduces_them_in_and_bf16_an_fp32_copy() -> None:
    """DeepSpeed keeps 16-bit .grads, and a bf16 model's BF16_Optimizer an fp32 copy of every
    gradient beside them (neither sharded): 2 + 4 bytes a parameter for DeepSpeed-3D, 4 + 4
    reduced in fp32, 2 + 2 with a bf16 copy."""
    memory, units = {}, {}
    cases = {
        "ds3d": [],
        "fp32": ["strategy.grad_reduce_dtype=fp32"],
        "bf16_copy": ["strategy.grad_accum_dtype=bf16"],
    }
    for name, extra in cases.items():
        setup = validate(composed(PIPELINE + ["strategy=deepspeed3d", *extra]))
        plan = plan_run(setup)
        units[name] = {u.unit: u for u in plan.units}
        memory[name] = rank_memory(plan.program.classes[0], units[name], setup.model, "bf16")
    assert next(iter(units["ds3d"].values())).grad_accum_dtype == "fp32"
    assert memory["ds3d"]["grads"] > 0
    assert memory["fp32"]["grads"] == pytest.approx(memory["ds3d"]["grads"] * 8 / 6)
    assert memory["bf16_copy"]["grads"] == pytest.approx(memory["ds3d"]["grads"] * 4 / 6)
    assert memory["fp32"]["weights"] == pytest.approx(memory["ds3d"]["weights"])


@pytest.mark.parametrize("extra", [["train.precision=fp16"], ["cluster.amp=true"]])
def test_deepspeed_keeps_no_second_copy_for_fp16_or_under_amp(extra: list[str]) -> None:
    plan = plan_run(validate(composed(PIPELINE + ["strategy=deepspeed3d", *extra])))
    assert all(u.grad_accum_dtype is None for u in plan.units)
