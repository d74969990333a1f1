"""Each unit's architecture (UnitSpec.arch), which the real backend builds its modules and
data from, states the shapes its kernels price: image and patch sizes, vocabulary, block
style, image tokens."""

from __future__ import annotations

import math

import pytest

from src.models.registry import build_model
from src.models.spec import Kernel, LayerSpec, UnitSpec

MODELS = [
    {"name": "clip", "scale": "tiny"},
    {"name": "coca"},
    {"name": "lit", "scale": "multi_node"},
    {"name": "mllm_72b", "scale": "tiny"},
    {"name": "mllm_9b", "images_per_sequence": 2},
    {"name": "optimus", "encoders": ["vit_3b", "vit_5b"], "llm": "llama_70b"},
    {"name": "optimus", "scale": "tiny"},
    {"name": "gpt", "preset": "llama3_8b"},
    {"name": "gpt", "preset": None, "layers": 2, "hidden": 64, "heads": 4, "vocab": 128},
    {"name": "unet", "preset": "unet_50m", "image_size": 16},
]


def _kernel(layer: LayerSpec, name: str) -> Kernel:
    return next(k for k in layer.kernels if k.name == name)


def _heads_of_vocabulary(unit: UnitSpec) -> list[Kernel]:
    return [_kernel(layer, "projection") for layer in unit.layers if layer.name in ("head", "caption_head")]


@pytest.mark.parametrize("config", MODELS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_a_unit_s_architecture_states_the_shapes_its_kernels_price(config):
    model = build_model(config)
    for unit in model.units:
        arch = unit.arch
        if unit.layers[0].name == "patch_embedding":
            patchify = _kernel(unit.layers[0], "patchify")
            assert arch.reads_images and patchify.k == 3 * arch.patch_size**2
            assert patchify.m == arch.images * (arch.image_size // arch.patch_size) ** 2
        else:
            assert not arch.reads_images
        for head in _heads_of_vocabulary(unit):
            assert head.n == arch.vocab
        if unit.layers[0].name == "embedding" and arch.style == "gpt":  # token + learned position rows
            assert unit.layers[0].params == (arch.vocab + unit.seq_len) * unit.hidden
        blocks = [layer for layer in unit.layers if layer.name == "block"]
        if blocks and arch.style == "llama":
            fc1, fc2, qkv = (_kernel(blocks[0], k) for k in ("fc1", "fc2", "attn_qkv"))
            assert fc1.n == 2 * fc2.k == 2 * arch.ffn
            assert qkv.n == unit.hidden + 2 * arch.kv_heads * (unit.hidden // unit.heads)
        if unit.kind == "unet":
            side = arch.latent_size or arch.image_size
            assert unit.seq_len == arch.images * side * side
        if unit.name == "llm" and any(u.arch.reads_images for u in model.units):
            encoders = [u for u in model.units if u.arch.reads_images]
            per_image = [math.isqrt(_kernel(u.layers[0], "patchify").m // u.arch.images) for u in encoders]
            assert arch.image_tokens == sum(arch.images * side * side for side in per_image)
