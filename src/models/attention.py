"""How the attention core runs: FlashAttention or eager (model.attention).

eager: QK^T is written to HBM, normalised by a separate softmax kernel, and the s x s
scores (with dropout, its mask and output) stay alive until backward (Korthikanti et al.
2022, the 5·a·s² bytes of layers.py). This is what a plain PyTorch/Megatron run without
fused attention does.

flash: FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023) tiles QK^T, softmax
and the product with V in on-chip memory: the scores never reach HBM (no softmax traffic)
and are not kept for backward, only the fp32 log-sum-exp per head and query row; the
attention dropout (eager: a kernel of its own over the scores) runs inside it; backward
recomputes QK^T (one more forward of the scores GEMM, hardware FLOPs that the model FLOPs
of MFU do not count). Megatron-LM (--use-flash-attn, then Transformer Engine's fused
attention by default) and torchtitan (PyTorch SDPA) train this way on Ampere and Hopper.

The default is the cluster preset's (cluster.attention): the attention kernel of the
software its testbed ran, which is a matter of era, not of the GPU. FlashAttention
appeared in 2022 (Megatron-LM's --use-flash-attn and Transformer Engine's fused attention
in 2023), so the 2021 DGX A100 runs of Narayanan et al. (dgx_a100) run eager, as do V100
(DistMM's p3.16xlarge), MI250X (Frontier: PyTorch's SDPA had no flash kernel on gfx90a
in Par4D's era) and CPU workers; the 2024 systems on Ampere/Hopper (DistTrain's A800s and
Optimus's H100s, both built on Megatron-LM; Par4D on Perlmutter's A100s with PyTorch 2's
SDPA) run flash. None of the papers states it; model.attention=flash|eager sets it for a run.

flash prices the core as the GEMMs it computes, on the device's GEMM curve. flash1 and flash2
are the same algorithm run by a named version (FlashAttention 1, FlashAttention 2), priced by
that version's rates as measured on the device (the preset's attention_measurements,
src/attention_measurements.py): the versions differ by twice on an A100, where the curve
gives both one rate; a preset without a table refuses them.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from src.cluster import ATTENTION_MODES, MEASURED_ATTENTION
from src.models.spec import ActivationBytes, Kernel, LayerSpec, ModelSpec

__all__ = ["ATTENTION_MODES", "measured_versions", "with_attention"]


def with_attention(spec: ModelSpec, mode: str) -> ModelSpec:
    """The model with every attention core run as `mode` (the builders make eager layers).
    Repeated layers stay one object: consumers cache by identity."""
    if mode == "eager":
        return spec
    return spec.map_layers(partial(_flash_layer, version=mode if mode in MEASURED_ATTENTION else ""))


def _flash_layer(layer: LayerSpec, version: str) -> LayerSpec:
    if not any(kernel.attention_scores for kernel in layer.kernels):
        return layer
    a: ActivationBytes = layer.activations
    kernels = tuple(_flash_kernel(kernel, version) for kernel in layer.kernels if not kernel.attention_dropout)
    return replace(layer, kernels=kernels, activations=replace(a, attention=a.flash_attention))


def _flash_kernel(kernel: Kernel, version: str) -> Kernel:
    """The scores GEMM is recomputed in backward; the softmax moves nothing through HBM; a
    measured version prices the core's two products."""
    if kernel.attention_core and kernel.kind == "gemm":
        kernel = replace(kernel, flash_kernel=version)
    if not kernel.attention_scores:
        return kernel
    if kernel.kind == "gemm":
        return replace(kernel, backward_recompute=True)
    return replace(kernel, bytes=0.0)


def measured_versions(spec: ModelSpec) -> set[str]:
    """The FlashAttention versions whose measured rates price the model's cores."""
    return {kernel.flash_kernel for unit in spec.units for layer in unit.layers for kernel in layer.kernels if kernel.flash_kernel}
