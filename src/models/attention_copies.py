"""Tensor copies software makes around a self-attention core (model.attention_copies).

The builders give a self-attention block no copy between its QKV projection and its core,
as a kernel that reads the projection's output in place runs it (Transformer Engine's
cuDNN attention on Megatron-Core's [s, b] layout). Software that hands FlashAttention its
[b, s] layout, or reshapes the heads in PyTorch first, copies whole tensors: each copy one
kernel reading and writing every 16-bit value, and its backward one more copying the
gradient the other way (no saved tensor). Megatron-LM's legacy ParallelAttention with
--use-flash-attn (megatron/model/transformer.py, as FlagScale's forks keep it at ed55532
and 26cd664) makes every one listed here, the rotary patch under its flag:

bshd: the queries, keys and values copied into FlashAttention's [b, s] layout
  (`rearrange(x, 's b ... -> b s ...').contiguous()`) and its output back: 4 kernels,
  which copy nothing where a micro-batch holds one sample (Kernel.batch_transpose).
kv_repeat: the keys and values repeated to every query head (`repeat_interleave` over the
  head axis, by heads / kv_heads, a copy even at 1) before the rotary embedding: 2 kernels
  reading the keys and values and writing query-sized ones; their backward sums the
  repeats back (the same bytes). Every step after it works on the repeated keys and
  values: the keys' rotation and the copies below move query-sized tensors, and
  FlashAttention keeps them for its backward instead of the grouped ones.
rotary_patch: FlagScale's --rotary-interleaved-patch: the queries, keys and values
  re-interleaved after the rotation (an einops rearrange of a transpose, which copies):
  3 kernels. It needs the rotary embedding.
rope_concat: the rotation's result concatenated with its unrotated part
  (`torch.cat((t, t_pass), dim=-1)` in apply_rotary_pos_emb, whose `t_pass` is empty when
  the whole head rotates), for the queries and the keys: 2 kernels. It needs the rotary
  embedding.

Left out: the queries' reshape after the QKV split, a copy only where a TP rank holds
several query groups (one group a rank reshapes in place). Cross-attention keeps its
layout: the option covers self-attention blocks.
"""

from __future__ import annotations

from dataclasses import replace

from src.errors import ConfigError
from src.models.layers import ACT_BYTES
from src.models.spec import Kernel, LayerSpec, ModelSpec

COPIES = ("bshd", "kv_repeat", "rotary_patch", "rope_concat")
ROTARY = ("rotary_patch", "rope_concat")
PROJECTION, SCORES, OUTPUT, ROPE_K = "attn_qkv", "attn_scores", "attn_proj", "attn_rope_k"


def with_attention_copies(spec: ModelSpec, copies: list[str]) -> ModelSpec:
    """The model with the listed copies priced in each self-attention block; a copy of a
    step the blocks do not run (a rotation in a model without RoPE) is refused."""
    unknown = sorted(set(copies) - set(COPIES))
    if unknown:
        raise ConfigError(f"model.attention_copies={copies} names {unknown}: the copies are {', '.join(COPIES)}")
    if not copies:
        return spec
    names = {kernel.name for unit in spec.units for layer in unit.layers for kernel in layer.kernels}
    if PROJECTION not in names:
        raise ConfigError(
            f"model.attention_copies={copies}: model {spec.name} has no transformer block whose self-attention they copy around"
        )
    rotary = sorted(set(copies) & set(ROTARY))
    if rotary and ROPE_K not in names:
        raise ConfigError(
            f"model.attention_copies names {', '.join(rotary)}, copies of the rotary embedding, which model {spec.name} "
            f"does not run (only Llama blocks rotate their queries and keys)"
        )
    chosen = frozenset(copies)
    return spec.map_layers(lambda layer: _copied(layer, chosen))


def _copied(layer: LayerSpec, copies: frozenset[str]) -> LayerSpec:
    by_name = {kernel.name: kernel for kernel in layer.kernels}
    if PROJECTION not in by_name:
        return layer
    output = by_name[OUTPUT]
    queries = output.m * output.n  # a sample's query values (its output's as many)
    keys = (by_name[PROJECTION].n - output.n) / 2 * output.m  # and its keys' (the values' as many)
    repeated = "kv_repeat" in copies
    moved = queries if repeated else keys  # the keys and values the steps after a repeat see
    values, launches = 0.0, 0  # values read and written once each, copies
    if repeated:
        # Keys and values each read grouped and written query-sized: (keys + queries) / 2
        # values read and written apiece.
        values, launches = values + keys + queries, launches + 2
    if "rotary_patch" in copies:
        values, launches = values + queries + 2 * moved, launches + 3
    if "rope_concat" in copies:
        values, launches = values + queries + moved, launches + 2
    made = [_copy("attn_copies", values, launches)] if launches else []
    if "bshd" in copies:
        made.append(replace(_copy("attn_layout", 2 * queries + 2 * moved, 4), batch_transpose=True))
    kernels: list[Kernel] = []
    for kernel in layer.kernels:
        if kernel.name == SCORES:
            kernels += made  # between the projection (and rotation) and the core
        if repeated and kernel.name == ROPE_K:
            kernel = replace(kernel, bytes=kernel.bytes * queries / keys)
        kernels.append(kernel)
    activations = layer.activations
    if repeated:
        # FlashAttention keeps the repeated keys and values for its backward.
        activations = replace(activations, split=activations.split + 2 * ACT_BYTES * (queries - keys))
    return replace(layer, kernels=tuple(kernels), activations=activations)


def _copy(name: str, values: float, launches: int) -> Kernel:
    """`launches` copies reading and writing `values` 16-bit values among them, split by heads;
    backward copies the gradients back (as many bytes)."""
    return Kernel(name, "memory", bytes=2 * ACT_BYTES * values, tp_split="n", backward_moves=1.0, launches=launches)
