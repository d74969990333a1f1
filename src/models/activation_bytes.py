"""A model's activations at its training precision's element size.

The builders count activations and the bandwidth-bound kernels' traffic in 16-bit values
(layers.ACT_BYTES, the element of a bf16 or fp16 run); an fp32 run moves and keeps 4-byte
values. Scaled here, once, so that every consumer (the cost model's bandwidth-bound kernels,
the memory model's activations, the planners' fits) sees the run's bytes. Kept as they are:
the loss's kernels, whose logits' types their mode states (src/models/cross_entropy.py), and
FlashAttention's fp32 statistics before a model runs it (ActivationBytes.flash_attention).
What the scale over-counts at fp32: a 1-byte dropout mask counted among the attention's and
the statistics of a model that runs FlashAttention (at fp32 no FlashAttention kernel runs).
"""

from __future__ import annotations

from dataclasses import replace

from src.models.layers import ACT_BYTES
from src.models.spec import ActivationBytes, Kernel, LayerSpec, ModelSpec


def with_activation_bytes(model: ModelSpec, element: int) -> ModelSpec:
    """`model` with activations of `element` bytes (ACT_BYTES: as built)."""
    if element == ACT_BYTES:
        return model
    scale = element / ACT_BYTES

    def kernel(k: Kernel) -> Kernel:
        return replace(k, bytes=k.bytes * scale) if k.kind == "memory" and not k.cross_entropy else k

    def layer(spec: LayerSpec) -> LayerSpec:
        a = spec.activations
        activations = ActivationBytes(
            replicated=a.replicated * scale,
            split=a.split * scale,
            attention=a.attention * scale,
            checkpoint=a.checkpoint * scale,
            flash_attention=a.flash_attention,
        )
        return replace(spec, kernels=tuple(kernel(k) for k in spec.kernels), activations=activations)

    return model.map_layers(layer)
