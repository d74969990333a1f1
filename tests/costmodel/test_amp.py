"""cluster.amp: PyTorch's automatic mixed precision, priced where a run's software trains under
it: the weights' casts and fp32 gradients, the fp32 residual stream, eager norms in fp32."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.cluster import GIB, cluster_from_config
from src.config import composed
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import rank_memory
from src.mesh import Sharding
from src.program import Collective
from src.setup import plan_run, validate
from tests.composing import composed as composed_run
from tests.models.test_grad_kernels import block, hopper


def test_pytorch_amp_casts_each_weight_once_a_micro_batch_and_accumulates_its_fp32_gradient() -> None:
    """cluster.amp: fc1's 1024 x 4096 fp32 weight is cast to bf16 in the forward (6 bytes an
    element), its gradient cast back and added into `.grad` in the backward (18 bytes): per
    micro-batch, whatever its rows; 16-bit weights (Megatron-LM's) and fp32 runs cast nothing."""
    amp = cluster_from_config(composed(["cluster=hopper", "cluster.amp=true"])["cluster"])
    fc1 = next(k for k in block("fused").kernels if k.name == "fc1")
    hbm = amp.memory_bandwidth * amp.memory_efficiency

    def extra(rows: int) -> tuple[float, float]:
        cast, plain = ComputeModel(amp, "bf16").kernel_times(fc1, rows, Sharding(), 1), hopper().kernel_times(fc1, rows, Sharding(), 1)
        return cast.fwd - plain.fwd, cast.bwd_weight - plain.bwd_weight

    gap = amp.kernel_overhead_s
    assert extra(1) == pytest.approx(extra(8))
    assert extra(1) == pytest.approx((6 * 1024 * 4096 / hbm + gap, 18 * 1024 * 4096 / hbm + gap))
    assert ComputeModel(amp, "fp32").kernel_times(fc1, 1, Sharding(), 1) == ComputeModel(replace(amp, amp=False), "fp32").kernel_times(
        fc1, 1, Sharding(), 1
    )


@pytest.mark.parametrize(("mode", "norm"), [("separate", (3.5, 2.75)), ("fused", (1.0, 1.0))])
def test_pytorch_amp_keeps_the_residual_stream_in_fp32_and_an_eager_norm_too(mode: str, norm: tuple[float, float]) -> None:
    """Under AMP a residual add reads the fp32 stream and a block's 16-bit output and writes
    the stream: 10 bytes a value for 6. An eager LayerNorm (its parameters' gradients a kernel
    of their own) runs in fp32 (8 bytes a value forward) and the GEMM after it casts its output
    (6 more): 3.5 times its 16-bit forward, 2.75 times its backward; a fused framework's norm
    (Transformer Engine's, FlashAttention's dropout-add-LayerNorm) moves what it did. Other
    memory-bound kernels (GELU on a GEMM's 16-bit output) move as before."""
    amp = ComputeModel(cluster_from_config(composed(["cluster=hopper", "cluster.amp=true"])["cluster"]), "bf16")
    plain, gap = hopper(), amp.cluster.kernel_overhead_s
    kernels = {k.name: k for k in block(mode).kernels}

    def ratio(name: str) -> tuple[float, float]:
        a, p = (c.kernel_times(kernels[name], 1, Sharding(), 1) for c in (amp, plain))
        return (a.fwd - gap) / (p.fwd - gap), (a.bwd_input - gap) / (p.bwd_input - gap)

    assert ratio("ln1") == pytest.approx(norm)
    assert ratio("mlp_residual") == pytest.approx((10 / 6, 10 / 6))
    assert ratio("act") == pytest.approx((1.0, 1.0))


def _gathered_bytes(*overrides: str) -> float:
    """Bytes a rank all-gathers in one step (weights: ZeRO-3's fetches, the distributed
    optimizer's updated parameters) of a 2-block GPT on one 8-GPU node, bf16."""
    base = ["model=gpt", "model.preset=null", "model.layers=2", "model.hidden=512", "model.heads=8", "model.vocab=1024"]
    base += ["train.seq_len=128", "train.global_batch=8", "train.precision=bf16", "cluster=dgx_a100", "cluster.nodes=1", "logger=none"]
    plan = plan_run(validate(composed_run(base + list(overrides))))
    return sum(
        i.bytes * i.count for rp in plan.program.classes for i in rp.instructions if isinstance(i, Collective) and i.op == "all_gather"
    )


@pytest.mark.parametrize(
    "strategy",
    [
        ["strategy=ddp", "strategy.zero_stage=3", "strategy.recompute=none", "strategy.overlap_comm=true"],
        ["strategy=ddp", "strategy.zero_stage=1"],
        ["strategy=megatron", "strategy.tp=1", "strategy.pp=1", "strategy.zero_stage=1", "strategy.recompute=none"],
    ],
)
def test_under_amp_the_gathered_weights_are_fp32(strategy: list[str]) -> None:
    """PyTorch AMP keeps fp32 weights, so what gathers them (ZeRO-3's fetches, the updated
    parameters after a sharded optimizer step) moves 4 bytes an element, as the real backend's
    DeepSpeed and distributed optimizer do: twice the 16-bit weights' bytes."""
    sixteen = _gathered_bytes(*strategy)
    assert sixteen > 0
    assert _gathered_bytes(*strategy, "cluster.amp=true") == pytest.approx(2 * sixteen)


def test_under_amp_the_model_states_are_fp32_trainings() -> None:
    """PyTorch AMP keeps fp32 weights, fp32 gradients and two fp32 moments (16 bytes a
    parameter, no master copy), where 16-bit training keeps 2 + 4 + 12 (Megatron-LM's
    gradients); the planner reports the memory it counted so."""
    base = ["model=gpt", "model.preset=null", "model.layers=2", "model.hidden=512", "model.heads=8", "model.vocab=1024"]
    base += ["train.seq_len=128", "train.global_batch=8", "train.precision=bf16", "cluster=dgx_a100", "cluster.nodes=1", "logger=none"]
    base += ["strategy=megatron", "strategy.tp=1", "strategy.pp=1", "strategy.zero_stage=0", "strategy.recompute=none"]
    memory = {}
    for amp in (False, True):
        setup = validate(composed_run(base + [f"cluster.amp={str(amp).lower()}"]))
        plan = plan_run(setup)
        units = {u.unit: u for u in plan.units}
        memory[amp] = rank_memory(plan.program.classes[0], units, setup.model, "bf16", amp)
        assert list(plan.details["memory_gib"].values()) == [round(memory[amp]["total"] / GIB, 3)]
    params = memory[False]["weights"] / 2
    assert memory[False]["grads"] == pytest.approx(4 * params) and memory[False]["optimizer"] == pytest.approx(12 * params)
    assert memory[True]["weights"] == pytest.approx(4 * params)
    assert memory[True]["grads"] == pytest.approx(4 * params) and memory[True]["optimizer"] == pytest.approx(8 * params)
