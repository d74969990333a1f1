"""A unit's real layers, one module per LayerSpec, built from the ModelSpec's dimensions:
the runtime trains exactly the shapes the simulator prices, and Work.layers index both.

Every layer is seeded on its own (layer_seed), so a rank builds only the layers it
computes (TP slices their weights) and any plan starts from the weights of a 1-process run.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from src.models.spec import Kernel, LayerSpec, ModelSpec, UnitSpec
from src.runtime.modules.blocks import Attention, Block, FeatureHead, LMHead, PatchEmbedding, TokenEmbedding
from src.runtime.modules.contrastive import ContrastiveLoss
from src.runtime.modules.parallel import TP


def _kernel(layer: LayerSpec, name: str) -> Kernel:
    for kernel in layer.kernels:
        if kernel.name == name:
            return kernel
    raise ValueError(f"layer {layer.name} has no kernel {name!r}")


def image_geometry(unit: UnitSpec) -> tuple[int, int]:
    """(image size, patch size) of a ViT unit, read off its patchify GEMM."""
    patchify = _kernel(unit.layers[0], "patchify")
    patch = math.isqrt(patchify.k // 3)
    return math.isqrt(patchify.m) * patch, patch


def vocab_size(unit: UnitSpec) -> int:
    """Vocabulary of a unit that starts with a token + position embedding."""
    return unit.layers[0].params // unit.hidden - unit.seq_len


def _layer(model: ModelSpec, unit: UnitSpec, index: int, tp: TP) -> nn.Module:
    layer = unit.layers[index]
    causal = unit.name != "vision"
    last = index == unit.num_layers - 1
    if layer.name == "patch_embedding":
        image, patch = image_geometry(unit)
        return PatchEmbedding(image, patch, unit.hidden, tp)
    if layer.name == "embedding":
        return TokenEmbedding(vocab_size(unit), unit.hidden, unit.seq_len, tp)
    if layer.name == "block":
        return Block(unit.hidden, unit.heads, tp, causal)
    if layer.name == "xblock":
        return Block(unit.hidden, unit.heads, tp, causal, cross_dim=_kernel(layer, "xattn_kv").k)
    if layer.name == "projection":
        return FeatureHead(unit.hidden, _kernel(layer, "projection").n, "last" if causal else "first", tp, keep_x=not last)
    if layer.name in ("head", "caption_head"):
        return LMHead(unit.hidden, _kernel(layer, "projection").n, tp)
    if layer.name == "contrastive":
        return ContrastiveLoss()
    raise ValueError(f"the real backend has no module for layer {layer.name!r} of unit {unit.name} ({model.name})")


def layer_seed(seed: int, unit: str, index: int) -> int:
    """Each layer draws its weights from its own seed: a rank builds only its layers, with
    the very values a whole-model build gives them."""
    return zlib.crc32(f"{seed}:{unit}:{index}".encode())


def build_units(
    model: ModelSpec, seed: int, tp: dict[str, TP], keep: dict[str, set[int]], recompute: dict[str, str] | None = None
) -> nn.ModuleDict:
    """Each unit in `keep` as a ModuleList indexed like its LayerSpecs, holding only the
    layers in `keep[unit]` (None elsewhere); only those are ever built (a TP layer
    draws its whole weight, then keeps its slice). `recompute`: a unit's mode;
    'selective' re-runs its attention cores in backward."""
    units = nn.ModuleDict()
    for unit in model.units:
        if unit.name not in keep:
            continue
        layers = nn.ModuleList()
        for i in range(unit.num_layers):
            if i not in keep[unit.name]:
                layers.add_module(str(i), None)
                continue
            torch.manual_seed(layer_seed(seed, unit.name, i))
            layers.append(_layer(model, unit, i, tp.get(unit.name, TP())))
        units[unit.name] = layers
        units[unit.name].requires_grad_(not unit.frozen)
        if (recompute or {}).get(unit.name) == "selective":
            for module in units[unit.name].modules():
                if isinstance(module, Attention):
                    module.recompute_core = True
    return units


def unit_layers(units: nn.ModuleDict, unit: str) -> nn.ModuleList:
    """A unit's layers as build_units made them (a ModuleList indexed like its LayerSpecs)."""
    layers = units[unit]
    assert isinstance(layers, nn.ModuleList)
    return layers
