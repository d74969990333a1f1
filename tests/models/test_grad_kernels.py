"""model.param_grad_kernels: the biases' and the normalisations' gradient reductions, kernels
of their own (eager PyTorch, Megatron-LM's own layers) or folded into other kernels
(Transformer Engine)."""

from __future__ import annotations

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
