"""A unit's real layers, one module per LayerSpec, built from the ModelSpec's dimensions
and each unit's architecture (UnitSpec.arch: image and patch sizes, vocabulary, block
style): the runtime trains exactly the shapes the simulator prices, and Work.layers index
both.

Every layer is seeded on its own (layer_seed), so a rank builds only the layers it
computes (TP slices their weights) and any plan starts from the weights of a 1-process run.
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import Mapping, Protocol

import torch
from torch import nn

from src.models.flows import chain_sources
from src.config import ContrastiveSpec
from src.models.spec import Kernel, LayerSpec, ModelSpec, UnitSpec
from src.runtime.modules.blocks import Attention, Block, FeatureHead, Llama, LMHead, PatchEmbedding, TokenEmbedding
from src.runtime.modules.contrastive import CaptionHead, ContrastiveLoss
from src.runtime.modules.generator import generator_layer
from src.runtime.modules.gpt3d import Attention3D
from src.runtime.modules.mllm import ConditioningHead, MultimodalEmbedding, Projector
from src.runtime.modules.parallel import TP


def _kernel(layer: LayerSpec, name: str) -> Kernel:
    for kernel in layer.kernels:
        if kernel.name == name:
            return kernel
    raise ValueError(f"layer {layer.name} has no kernel {name!r}")


def llama_style(unit: UnitSpec) -> Llama | None:
    """A unit of Llama blocks (its architecture's style): their FFN width and key/value heads."""
    arch = unit.arch
    return Llama(arch.ffn, arch.kv_heads) if arch.style == "llama" else None


def _captions(model: ModelSpec) -> bool:
    """A CoCa: a contrastive model with a captioning head, whose two losses are weighted."""
    return any(layer.name == "caption_head" for unit in model.units for layer in unit.layers)


def _layer(model: ModelSpec, unit: UnitSpec, index: int, tp: TP, contrastive: ContrastiveSpec) -> nn.Module:
    layer = unit.layers[index]
    causal = not unit.arch.reads_images  # a unit that reads images attends both ways
    last = index == unit.num_layers - 1
    if unit.kind == "unet":
        module = generator_layer(unit.layers, index)
        if module is not None:
            return module
    llama = llama_style(unit)
    if layer.name == "patch_embedding":
        return PatchEmbedding(unit.arch.image_size, unit.arch.patch_size, unit.hidden, tp)
    if layer.name in ("input_projector", "output_projector"):
        fc1, fc2 = _kernel(layer, "fc1"), _kernel(layer, "fc2")
        sources = chain_sources(model, unit.name)
        consumers = [model.unit(c).seq_len for p, c in model.flows if p == unit.name]
        role = layer.name.removesuffix("_projector")
        return Projector(fc1.k, fc1.n, fc2.n, tp, role, sources[0] if sources else None, consumers[0] if consumers else 0)
    if layer.name == "embedding" and llama is not None:
        return MultimodalEmbedding(unit.arch.vocab, unit.hidden, chain_sources(model, unit.name), tp)
    if layer.name == "head" and llama is not None:
        return ConditioningHead(unit.hidden, unit.arch.vocab, unit.output_elems // unit.hidden, tp)
    if layer.name == "embedding":
        return TokenEmbedding(unit.arch.vocab, unit.hidden, unit.seq_len, tp, chain_sources(model, unit.name))
    if layer.name == "block":
        return Block(unit.hidden, unit.heads, tp, causal, llama=llama)
    if layer.name == "xblock":
        return Block(unit.hidden, unit.heads, tp, causal, cross_dim=_kernel(layer, "xattn_kv").k)
    if layer.name == "projection":
        return FeatureHead(unit.hidden, _kernel(layer, "projection").n, "last" if causal else "first", tp, keep_x=not last)
    if layer.name == "caption_head":
        return CaptionHead(unit.hidden, unit.arch.vocab, tp, contrastive.caption_loss_weight, contrastive.pad_id)
    if layer.name == "head":
        return LMHead(unit.hidden, unit.arch.vocab, tp)
    if layer.name == "contrastive":
        return ContrastiveLoss(contrastive.contrastive_loss_weight if _captions(model) else 1.0)
    raise ValueError(f"the real backend has no module for layer {layer.name!r} of unit {unit.name} ({model.name})")


class LaidOutLayers(Protocol):
    """A unit's layers on a layout of its own (runtime.layouts): built by index, then linked."""

    def layer(self, index: int) -> nn.Module:
        """The unit's layer `index` on the layout, drawn from the seed already set."""
        ...

    def link(self, layers: nn.ModuleList) -> None:
        """What ties the unit's built layers together (a prefetch chain)."""
        ...


def layer_seed(seed: int, unit: str, index: int) -> int:
    """Each layer draws its weights from its own seed: a rank builds only its layers, with
    the very values a whole-model build gives them."""
    return zlib.crc32(f"{seed}:{unit}:{index}".encode())


def build_units(
    model: ModelSpec,
    seed: int,
    tp: dict[str, TP],
    keep: dict[str, set[int]],
    recompute: dict[str, str] | None = None,
    laid_out: Mapping[str, LaidOutLayers] | None = None,
    contrastive: ContrastiveSpec = ContrastiveSpec(),
) -> nn.ModuleDict:
    """Each unit in `keep` as a ModuleList indexed like its LayerSpecs, holding only the
    layers in `keep[unit]` (None elsewhere); only those are ever built (a TP layer
    draws its whole weight, then keeps its slice). `recompute`: a unit's mode;
    'selective' re-runs its attention cores in backward. `laid_out`: the units on a layout
    of their own, built of its layers (a tensor grid's 3D-parallel layers). `contrastive`: CoCa's loss weights and padding
    (backend.contrastive)."""
    laid_out = laid_out or {}
    units = nn.ModuleDict()
    for unit in model.units:
        if unit.name not in keep:
            continue
        layers = nn.ModuleList()
        layout = laid_out.get(unit.name)
        build = (
            layout.layer if layout is not None else partial(_layer, model, unit, tp=tp.get(unit.name, TP()), contrastive=contrastive)
        )
        for i in range(unit.num_layers):
            if i not in keep[unit.name]:
                layers.add_module(str(i), None)
                continue
            torch.manual_seed(layer_seed(seed, unit.name, i))
            module = build(index=i)
            # A frozen unit, or a frozen or forward-only layer of a trained one (an MLLM's
            # ViT under its trained projector, SD's VAE encoder), keeps no gradients.
            layers.append(module.requires_grad_(unit.trains(unit.layers[i])))
        if layout is not None:
            layout.link(layers)
        units[unit.name] = layers
        if (recompute or {}).get(unit.name) == "selective":
            for module in units[unit.name].modules():
                if isinstance(module, (Attention, Attention3D)):
                    module.recompute_core = True
    return units


def unit_layers(units: nn.ModuleDict, unit: str) -> nn.ModuleList:
    """A unit's layers as build_units made them (a ModuleList indexed like its LayerSpecs)."""
    layers = units[unit]
    assert isinstance(layers, nn.ModuleList)
    return layers
