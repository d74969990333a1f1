"""Full recomputation re-runs a model's blocks only (LayerSpec.block): the embedding, the
head and its loss keep their activations and run once, as Megatron-LM, DeepSpeed's pipeline
and the real backend checkpoint."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.cluster import cluster_from_config
from src.config import composed
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import peak_activation_bytes
from src.mesh import Sharding
from src.models.registry import build_model
from src.program import Compute, Work

GPT = {"name": "gpt", "preset": None, "layers": 2, "hidden": 1024, "heads": 16, "vocab": 32000}
SEQ = 2048


def test_only_the_blocks_are_checkpointed() -> None:
    llm = build_model(GPT, SEQ).unit("llm")
    assert [layer.block for layer in llm.layers] == [False, True, True, False]
    assert [layer.recompute_mode("full") for layer in llm.layers] == ["none", "full", "full", "none"]
    assert all(layer.recompute_mode("selective") == "selective" for layer in llm.layers)


def test_a_full_recompute_backward_re_runs_the_blocks_forward_and_not_the_heads() -> None:
    """The backward under full recomputation costs the blocks' forwards more than without
    it; the head's logits GEMM and loss are not run again."""
    model = build_model(GPT, SEQ)
    llm = model.unit("llm")
    hopper = cluster_from_config(composed(["cluster=hopper"])["cluster"])
    # The device's time alone (a small model's host, issuing kernels, would bound some layers).
    compute = ComputeModel(replace(hopper, host_forward_kernel_s=0.0, host_backward_kernel_s=0.0), "bf16")
    layers = (0, len(llm.layers))
    extra = compute.work_time(Work("llm", "bwd", 1, layers, recompute="full"), model) - compute.work_time(
        Work("llm", "bwd", 1, layers), model
    )
    blocks = sum(compute.layer_times(layer, 1, Sharding(), 1, None, True).fwd for layer in llm.layers if layer.block)
    head = compute.layer_times(llm.layers[-1], 1, Sharding(), 1, None, True).fwd
    assert extra == pytest.approx(blocks)
    assert head > 0.2 * blocks  # a 32,000-entry head is worth keeping out of the recompute


def test_under_full_recompute_the_head_keeps_its_activations() -> None:
    """What a micro-batch leaves alive: each block's input, the embedding's output and the
    head's whole activations (its saved log-probabilities among them)."""
    model = build_model(GPT, SEQ)
    llm = model.unit("llm")
    forward = Compute(Work("llm", "fwd", 1, (0, len(llm.layers)), recompute="full"), microbatch=0)
    kept = peak_activation_bytes([forward], model, {"llm": "full"})
    embedding, first, second, head = (layer.activations for layer in llm.layers)
    none = Sharding()
    assert kept == pytest.approx(
        embedding.per_device(none, "none") + first.checkpoint + second.checkpoint + head.per_device(none, "none")
    )
