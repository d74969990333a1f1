"""Composite builders shared by several families: kernels, ViT and text towers, LLM
decoders (GPT and Llama style), MLP projectors. Counts are per sample, forward, as in
spec.py; bytes are 16-bit activations (layers.ACT_BYTES).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from src.models.layers import ACT_BYTES, embedding_layer, gemm, head_layer, memory, patch_embedding_layer, transformer_layer
from src.models.spec import ActivationBytes, Architecture, LayerSpec, UnitSpec


def vit_layers(image: int, patch: int, layers: int, hidden: int, heads: int, ffn: int | None = None) -> list[LayerSpec]:
    """A ViT encoder: patchify (+CLS, learned positions) and `layers` pre-norm blocks over
    (image/patch)^2 + 1 tokens. The block object is shared: consumers cache by identity."""
    tokens = (image // patch) ** 2 + 1
    block = transformer_layer(tokens, hidden, heads, ffn)
    return [patch_embedding_layer(image, patch, hidden)] + [block] * layers


def text_layers(seq: int, vocab: int, layers: int, hidden: int, heads: int) -> list[LayerSpec]:
    """A CLIP-style text transformer: token + learned position embedding, `layers` blocks
    (causal; the mask does not change the counts)."""
    block = transformer_layer(seq, hidden, heads)
    return [embedding_layer(vocab, hidden, seq, positions=seq)] + [block] * layers


def feature_head(hidden: int, embed_dim: int, name: str = "projection") -> LayerSpec:
    """Final norm and projection of ONE pooled token (CLS/EOS) to the contrastive
    embedding; no loss here (the interaction unit owns it)."""
    return head_layer(1, hidden, embed_dim, loss_elems=0, name=name)


def mlp_projector(tokens: int, d_in: int, d_hidden: int, d_out: int, name: str) -> LayerSpec:
    """A two-layer GELU MLP applied to every token (LLaVA-1.5's `mlp2x_gelu` projector).
    Megatron-style TP: fc1 column-parallel, fc2 row-parallel, one all-reduce."""
    return LayerSpec(
        name=name,
        kernels=(
            gemm("fc1", tokens, d_in, d_hidden, "n", bias=True),
            memory("gelu", tokens * d_hidden, "n"),
            gemm("fc2", tokens, d_hidden, d_out, "k", bias=True),
        ),
        params=d_in * d_hidden + d_hidden + d_hidden * d_out + d_out,
        activations=ActivationBytes(
            replicated=ACT_BYTES * tokens * d_in, split=ACT_BYTES * tokens * 2 * d_hidden, checkpoint=ACT_BYTES * tokens * d_in
        ),
        tp_allreduces=1,
        tp_comm_elems=tokens * d_out,
    )


def per_images(layer: LayerSpec, images: int) -> LayerSpec:
    """A per-image layer run on `images` images at once: every kernel's rows, every
    moved byte and every kept activation scale; the parameters do not."""
    if images == 1:
        return layer
    kernels = tuple(replace(k, m=k.m * images) if k.kind == "gemm" else replace(k, bytes=k.bytes * images) for k in layer.kernels)
    a = layer.activations
    activations = ActivationBytes(
        a.replicated * images, a.split * images, a.attention * images, a.checkpoint * images, a.flash_attention * images
    )
    return replace(layer, kernels=kernels, activations=activations, tp_comm_elems=layer.tp_comm_elems * images)


def scaled_per_images(layers: list[LayerSpec], images: int) -> tuple[LayerSpec, ...]:
    """Per-image layers built for `images` images, keeping repeated layers one object
    (the cost model caches by identity)."""
    made: dict[int, LayerSpec] = {}
    return tuple(made.setdefault(id(layer), per_images(layer, images)) for layer in layers)


@dataclass(frozen=True)
class DecoderPreset:
    """An LLM backbone. style 'gpt': GPT-3/Megatron (LayerNorm with biases, 4h GELU MLP,
    learned absolute positions, output layer tied to the input embedding, Megatron's
    default dropout 0.1). style 'llama':
    RMSNorm, no biases, SwiGLU MLP of width `ffn`, RoPE (no position parameters),
    untied output layer, grouped-query attention when kv_heads < heads."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    style: Literal["gpt", "llama"] = "gpt"
    ffn: int | None = None
    kv_heads: int | None = None


def decoder_unit(preset: DecoderPreset, seq: int, output_elems: int, name: str = "llm", dropout: bool | None = None) -> UnitSpec:
    """An LLM backbone unit: embedding, `layers` blocks, LM head with the loss. `dropout`:
    whether its blocks run dropout (None: the style's, Megatron's 0.1 for 'gpt', none for
    'llama')."""
    llama = preset.style == "llama"
    dropout = not llama if dropout is None else dropout
    arch = Architecture(
        vocab=preset.vocab,
        style=preset.style,
        ffn=preset.ffn or 4 * preset.hidden,
        kv_heads=preset.kv_heads or preset.heads,
    )
    block = transformer_layer(
        seq,
        preset.hidden,
        preset.heads,
        preset.ffn,
        kv_heads=preset.kv_heads,
        gated=llama,
        bias=not llama,
        dropout=dropout,
        rotary=llama,
    )
    layers = (
        [embedding_layer(preset.vocab, preset.hidden, seq, positions=0 if llama else seq)]
        + [block] * preset.layers
        + [head_layer(seq, preset.hidden, preset.vocab, tied=not llama, norm_shift=not llama)]
    )
    return UnitSpec(
        name=name, layers=tuple(layers), hidden=preset.hidden, heads=preset.heads, seq_len=seq, output_elems=output_elems, arch=arch
    )
