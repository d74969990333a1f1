"""The optimizer step priced pass by pass as mixed-precision frameworks run it
(src/costmodel/optimizer_step.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.costmodel.compute import ComputeModel
from src.costmodel.optimizer_step import StepBytes, step_bytes
from src.models.layers import transformer_layer
from src.models.spec import ModelSpec, UnitSpec
from src.program import Compute
from src.strategies.builders.emit import iteration_tail
from src.strategies.builders.stages import Segment
from src.mesh import Sharding
from tests.costmodel.test_costmodel import CLUSTER


@pytest.mark.parametrize(
    ("precision", "amp", "expected"),
    [
        # fp16 gradients: averaged and zeroed (2 + 2 + 2), copied to fp32 (6), unscaled (8),
        # normed (4), Adam (28), the fp16 weights copied back (6).
        ("fp16", False, StepBytes(6.0, 52.0)),
        # bf16: fp32 gradients (4 + 4 + 4), no copy to fp32 and no loss scaling.
        ("bf16", False, StepBytes(12.0, 38.0)),
        # AMP keeps fp32 weights and gradients: nothing to copy either way; fp16 still unscales.
        ("bf16", True, StepBytes(12.0, 32.0)),
        ("fp16", True, StepBytes(12.0, 40.0)),
        ("fp32", False, StepBytes(12.0, 32.0)),
    ],
)
def test_each_precision_moves_the_bytes_of_its_passes(precision: str, amp: bool, expected: StepBytes) -> None:
    assert step_bytes(precision, amp) == expected


def _model() -> ModelSpec:
    layer = transformer_layer(128, 256, 4)
    return ModelSpec("m", (UnitSpec("llm", (layer,) * 4, 256, 4, 128, 128 * 256),))


@pytest.mark.parametrize(("zero_stage", "grads_over", "state_over"), [(0, 1, 1), (1, 1, 4), (2, 4, 4)])
def test_zero_shards_the_state_passes_and_from_stage_2_the_gradient_passes(zero_stage: int, grads_over: int, state_over: int) -> None:
    """A rank of 4 data-parallel replicas: the distributed optimizer (ZeRO-1) steps a
    quarter of the state but averages and zeroes the whole gradient buffer; ZeRO-2 holds a
    quarter of the gradients too."""
    model = _model()
    compute = ComputeModel(replace(CLUSTER, kernel_overhead_s=0.0), "bf16")
    tail = iteration_tail(model, [Segment("llm", (0, 4))], Sharding(), "dp", 4, zero_stage, 4, 2)
    (work,) = [i.work for i in tail if isinstance(i, Compute)]
    params = model.unit("llm").trainable_params(0, 4)
    seconds = (params / grads_over * 12.0 + params / state_over * 38.0) / (CLUSTER.memory_bandwidth * CLUSTER.memory_efficiency)
    assert compute.work_time(work, model) == pytest.approx(seconds)
