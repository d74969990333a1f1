"""An fp32 run keeps and moves 4-byte activations (src/models/activation_bytes.py)."""

from __future__ import annotations

import pytest

from src.config import composed
from src.models.activation_bytes import with_activation_bytes
from src.models.registry import build_model
from src.setup import validate

GPT = {"name": "gpt", "preset": None, "layers": 2, "hidden": 64, "heads": 2, "vocab": 128, "dropout": True}


def test_fp32_doubles_the_activations_and_the_bandwidth_bound_kernels_but_not_the_loss() -> None:
    half = build_model(GPT, 32, attention="eager", cross_entropy="fp32")
    full = with_activation_bytes(half, 4)
    assert with_activation_bytes(half, 2) is half
    for before, after in zip((layer for u in half.units for layer in u.layers), (layer for u in full.units for layer in u.layers)):
        a, b = before.activations, after.activations
        kept = (a.replicated, a.split, a.attention, a.checkpoint)
        assert (b.replicated, b.split, b.attention, b.checkpoint) == pytest.approx(tuple(2 * x for x in kept))
        assert b.flash_attention == a.flash_attention  # fp32 statistics either way
        for k, j in zip(before.kernels, after.kernels):
            expected = k.bytes if k.kind == "gemm" or k.cross_entropy else 2 * k.bytes
            assert j.bytes == pytest.approx(expected), k.name
    # A repeated layer stays one object (the cost model caches by identity).
    blocks = [layer for layer in full.units[0].layers if layer.name == "block"]
    assert len(blocks) == 2 and blocks[0] is blocks[1]


def test_a_run_builds_its_model_at_its_precision() -> None:
    def activations(precision: str) -> float:
        run = ["model=gpt", "model.preset=gpt_5b", "cluster=hopper", f"train.precision={precision}", "logger=none"]
        setup = validate(composed(run))
        return next(layer for layer in setup.model.units[0].layers if layer.name == "block").activations.split

    assert activations("fp32") == pytest.approx(2 * activations("bf16"))
    assert activations("fp16") == pytest.approx(activations("bf16"))
