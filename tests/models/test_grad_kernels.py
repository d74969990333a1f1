"""model.param_grad_kernels: the biases' and the normalisations' gradient reductions, kernels
of their own (eager PyTorch, Megatron-LM's own layers) or folded into other kernels
(Transformer Engine); cluster.amp: the weights' casts and fp32 gradients of PyTorch AMP."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.cluster import cluster_from_config
from src.config import composed
from src.costmodel.compute import ComputeModel, layer_launches
from src.errors import ConfigError
from src.mesh import Sharding, tensor_parallel
from src.models.registry import build_model
from src.program import Work

GPT = {"name": "gpt", "preset": None, "layers": 2, "hidden": 1024, "heads": 16, "vocab": 32000}
SEQ = 2048


def block(mode: str, **options):
    return build_model({**GPT, **options, "param_grad_kernels": mode}, SEQ).unit("llm").layers[1]


def hopper() -> ComputeModel:
    return ComputeModel(cluster_from_config(composed(["cluster=hopper"])["cluster"]), "bf16")


def test_separate_adds_each_bias_and_norm_reduction_to_the_weight_gradient_at_its_bytes() -> None:
    """A GPT block's biases (qkv 3h, proj h, fc1 4h, fc2 h) read their outputs' gradients,
    9 x 2048 x 1024 bf16 values; its two LayerNorms read the output's gradient and the input
    again, 2 x 2 x 2048 x 1024 values: six kernels, each with the device's per-kernel gap."""
    compute = hopper()
    separate, fused = compute.layer_times(block("separate"), 1), compute.layer_times(block("fused"), 1)
    hbm = compute.cluster.memory_bandwidth * compute.cluster.memory_efficiency
    added = 2 * (9 + 4) * SEQ * 1024 / hbm + 6 * compute.cluster.kernel_overhead_s
    assert separate.bwd_weight - fused.bwd_weight == pytest.approx(added)
    assert (separate.fwd, separate.bwd_input) == (fused.fwd, fused.bwd_input)
    # The host's per-kernel times are per kernel of the count they were measured over.
    assert layer_launches(block("separate")) == layer_launches(block("fused"))


def test_a_block_without_biases_reduces_only_its_norms() -> None:
    """Llama's block (RMSNorm, no biases): two norms' reductions, no bias's."""
    compute = hopper()
    separate, fused = (compute.layer_times(block(mode, style="llama"), 1) for mode in ("separate", "fused"))
    hbm = compute.cluster.memory_bandwidth * compute.cluster.memory_efficiency
    assert separate.bwd_weight - fused.bwd_weight == pytest.approx(2 * 4 * SEQ * 1024 / hbm + 2 * compute.cluster.kernel_overhead_s)


def test_tensor_parallelism_splits_a_column_parallel_bias_and_not_a_row_parallel_one() -> None:
    """At TP 8 fc1's output (4h) is split, fc2's (h) is whole on every rank; with sequence
    parallelism fc2's output is split along the sequence too."""
    compute = hopper()
    fc1, fc2 = (next(k for k in block("separate").kernels if k.name == name) for name in ("fc1", "fc2"))
    hbm = compute.cluster.memory_bandwidth * compute.cluster.memory_efficiency
    gap = compute.cluster.kernel_overhead_s

    def reduction(kernel, sharding: Sharding) -> float:
        return compute.kernel_times(kernel, 1, sharding, 1).bwd_weight - compute.gemm_time(
            kernel.k / (8 if kernel.tp_split == "k" else 1), kernel.n / (8 if kernel.tp_split == "n" else 1), kernel.m
        )

    assert reduction(fc1, tensor_parallel(8)) == pytest.approx(2 * SEQ * 4096 / 8 / hbm + gap)
    assert reduction(fc2, tensor_parallel(8)) == pytest.approx(2 * SEQ * 1024 / hbm + gap)
    assert reduction(fc2, tensor_parallel(8, sequence_parallel=True)) == pytest.approx(2 * SEQ * 1024 / 8 / hbm + gap)


def test_a_frozen_unit_runs_no_reduction() -> None:
    """The reductions are parameter gradients: the weight-gradient work of a trained unit
    carries them, a frozen unit's has none."""
    compute = hopper()

    def weight_gradient(mode: str, frozen: list[str]) -> float:
        model = build_model({**GPT, "param_grad_kernels": mode, "frozen": frozen}, SEQ)
        return compute.work_time(Work("llm", "bwd_weight", 16, (1, 3)), model)  # device-bound

    assert weight_gradient("separate", []) > weight_gradient("fused", []) > 0
    assert weight_gradient("separate", ["llm"]) == weight_gradient("fused", ["llm"]) == 0.0


def test_the_default_is_the_cluster_presets_and_a_bad_value_is_refused() -> None:
    assert block("fused") == build_model(GPT, SEQ, param_grad_kernels="fused").unit("llm").layers[1]
    assert block("separate") == build_model(GPT, SEQ).unit("llm").layers[1]
    with pytest.raises(ConfigError, match=r"model.param_grad_kernels='apex' is not one of: separate, fused"):
        build_model({**GPT, "param_grad_kernels": "apex"}, SEQ)
    presets = {
        name: cluster_from_config(composed([f"cluster={name}"])["cluster"]).param_grad_kernels
        for name in ("hopper", "a800", "dgx_a100")
    }
    assert presets == {"hopper": "fused", "a800": "fused", "dgx_a100": "separate"}
    with pytest.raises(ConfigError, match=r"cluster.param_grad_kernels must be one of \['separate', 'fused'\], got 'te'"):
        cluster_from_config(composed(["cluster=hopper", "cluster.param_grad_kernels=te"])["cluster"])


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
