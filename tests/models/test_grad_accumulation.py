"""model.grad_accumulation: a micro-batch's weight gradients added into the step's in a pass of
their own (Megatron-LM's DDP hook of 2021-22, PyTorch's autograd) or inside the GEMM
(gradient accumulation fusion)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.cluster import cluster_from_config
from src.config import composed
from src.costmodel.compute import ComputeModel
from src.mesh import Sharding, tensor_parallel
from src.models.grad_accumulation import with_grad_accumulation
from src.models.registry import build_model
from src.setup import validate

GPT = {"name": "gpt", "preset": None, "layers": 2, "hidden": 1024, "heads": 16, "vocab": 32000}
SEQ = 2048
# A GPT block's weights: qkv 3h^2, projection h^2, fc1 and fc2 4h^2 each.
BLOCK_WEIGHTS = 12 * 1024 * 1024


def block(mode: str):
    return build_model({**GPT, "grad_accumulation": mode}, SEQ).unit("llm").layers[1]


def cluster(amp: bool = False):
    return replace(cluster_from_config(composed(["cluster=dgx_a100"])["cluster"]), amp=amp)


@pytest.mark.parametrize(("precision", "per_weight"), [("fp16", 6.0), ("bf16", 10.0), ("fp32", 12.0)])
def test_a_hook_adds_each_weights_gradient_once_a_micro_batch_whatever_its_rows(precision: str, per_weight: float) -> None:
    """The fresh gradient read (2 bytes, 4 at fp32), the buffer's element read and written (fp16's
    in fp16, bf16's and fp32's in fp32): per micro-batch, not per row; the fused GEMM adds none."""
    compute = ComputeModel(cluster(), precision)
    hbm, gap = compute.cluster.memory_bandwidth * compute.cluster.memory_efficiency, compute.cluster.kernel_overhead_s
    for rows in (1, 8):
        hooked, fused = compute.layer_times(block("hook"), rows), compute.layer_times(block("fused"), rows)
        assert hooked.bwd_weight - fused.bwd_weight == pytest.approx(per_weight * BLOCK_WEIGHTS / hbm + 4 * gap)
        assert (hooked.fwd, hooked.bwd_input) == (fused.fwd, fused.bwd_input)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_cast_reads_the_16_bit_gradient_writes_it_as_fp32_and_adds_it_into_an_fp32_copy(precision: str) -> None:
    """BF16_Optimizer's update_hp_grads: read 2 and write 4 bytes (the cast), read 4 + 4 and
    write 4 (the add): 18 bytes a weight, per micro-batch."""
    compute = ComputeModel(cluster(), precision)
    hbm, gap = compute.cluster.memory_bandwidth * compute.cluster.memory_efficiency, compute.cluster.kernel_overhead_s
    cast, fused = compute.layer_times(block("cast"), 8), compute.layer_times(block("fused"), 8)
    assert cast.bwd_weight - fused.bwd_weight == pytest.approx(18.0 * BLOCK_WEIGHTS / hbm + 4 * gap)


def test_tensor_parallelism_splits_the_pass_with_the_weights() -> None:
    compute = ComputeModel(cluster(), "fp16")
    extra = [
        compute.layer_times(block("hook"), 1, sharding).bwd_weight - compute.layer_times(block("fused"), 1, sharding).bwd_weight
        for sharding in (Sharding(), tensor_parallel(8))
    ]
    gap = 4 * compute.cluster.kernel_overhead_s
    assert extra[1] - gap == pytest.approx((extra[0] - gap) / 8)


def test_under_amp_autograd_accumulates_into_the_fp32_grad_whatever_the_mode() -> None:
    compute = ComputeModel(cluster(amp=True), "bf16")
    assert compute.layer_times(block("hook"), 1) == compute.layer_times(block("fused"), 1)


@pytest.mark.parametrize("mode", ["hook", "fused"])
@pytest.mark.parametrize(("precision", "amp", "per_entry"), [("fp16", False, 8.0), ("bf16", False, 12.0), ("bf16", True, 16.0)])
def test_an_embeddings_dense_gradient_is_added_once_a_micro_batch(mode: str, precision: str, amp: bool, per_entry: float) -> None:
    """PyTorch's embedding backward zero-fills the table's gradient (the weights' bytes) and the
    framework adds it into the step's (as a hook adds a weight's): in either mode, since no GEMM
    accumulates it; split over TP with the table; under AMP the fp32 table's into `.grad`."""
    compute = ComputeModel(cluster(amp=amp), precision)
    hbm, gap = compute.cluster.memory_bandwidth * compute.cluster.memory_efficiency, compute.cluster.kernel_overhead_s
    embedding = build_model({**GPT, "grad_accumulation": mode}, SEQ).unit("llm").layers[0]
    (lookup,) = embedding.kernels
    assert lookup.table == (32000 + SEQ) * 1024 == embedding.params  # tokens' and learned positions' tables
    without = replace(embedding, kernels=(replace(lookup, table=0.0),))
    for rows, sharding, tp in ((1, Sharding(), 1), (8, Sharding(), 1), (1, tensor_parallel(8), 8)):
        extra = compute.layer_times(embedding, rows, sharding).bwd_weight - compute.layer_times(without, rows, sharding).bwd_weight
        assert extra == pytest.approx(per_entry * embedding.params / tp / hbm + gap)


def _mode(*overrides: str) -> str:
    setup = validate(
        composed(
            ["model=gpt", "model.preset=null", "model.layers=2", "model.hidden=256", "model.heads=4", "model.vocab=1024", *overrides]
        )
    )
    modes = {k.accumulation for layer in setup.model.unit("llm").layers for k in layer.kernels if k.has_weight}
    assert len(modes) == 1
    return modes.pop()


def test_the_default_is_the_presets_software_a_strategys_codebase_or_the_models_option() -> None:
    """Megatron-LM with fp32 accumulation fuses it (hopper, a800, perlmutter); Megatron-LM of
    2021-22 in fp16, LitGPT, PyTorch loops and the real backend add it in a pass; DeepSpeed-3D's
    codebase (2020) too, on any preset, and a bf16 model's BF16_Optimizer casts it into an fp32
    copy; model.grad_accumulation wins over both."""
    presets = {
        name: cluster_from_config(composed([f"cluster={name}"])["cluster"]).grad_accumulation
        for name in ("hopper", "a800", "dgx_a100", "perlmutter", "frontier", "p3_16xlarge", "local")
    }
    assert presets == {
        "hopper": "fused",
        "a800": "fused",
        "perlmutter": "fused",
        "dgx_a100": "hook",
        "frontier": "hook",
        "p3_16xlarge": "hook",
        "local": "hook",
    }
    perlmutter = ["cluster=perlmutter", "cluster.nodes=2"]
    assert _mode(*perlmutter) == ""
    assert _mode(*perlmutter, "strategy=deepspeed3d", "train.precision=bf16") == "cast"
    assert _mode(*perlmutter, "strategy=deepspeed3d", "train.precision=fp16") == "hook"
    assert _mode(*perlmutter, "strategy=deepspeed3d", "train.precision=bf16", "cluster.amp=true") == "hook"
    assert _mode(*perlmutter, "strategy=deepspeed3d", "strategy.grad_accumulation=fused") == ""
    assert _mode(*perlmutter, "strategy=deepspeed3d", "model.grad_accumulation=fused") == ""


def test_the_hooked_model_keeps_repeated_layers_one_object_and_unweighted_ones_as_they_were() -> None:
    """Consumers cache layer times by identity: a GPT's blocks (one object repeated) stay one
    object, and a layer with no weighted product (the embedding's lookup) is not copied."""
    spec = build_model({**GPT, "layers": 4, "grad_accumulation": "fused"}, SEQ)
    fused, hooked = spec.unit("llm").layers, with_grad_accumulation(spec, "hook").unit("llm").layers
    blocks = [i for i, layer in enumerate(fused) if layer.block]
    assert len({id(hooked[i]) for i in blocks}) == 1 and hooked[blocks[0]] is not fused[blocks[0]]
    unweighted = [i for i, layer in enumerate(fused) if not any(k.has_weight for k in layer.kernels)]
    assert unweighted and [i for i, (a, b) in enumerate(zip(fused, hooked)) if a is b] == unweighted
