"""Par4D's ADM U-Net on the real backend: each layer is its LayerSpec's, a sample is one
diffusion step of Improved DDPM's cosine schedule, and a pass scores the predicted noise."""

from __future__ import annotations

import torch

from src.data.synthetic import collate
from src.data.synthetic_diffusion import SyntheticDiffusion, cosine_alpha_bars
from src.models.registry import build_model
from src.runtime.inputs import unit_fields
from src.runtime.modules.units import build_units, unit_layers
from tests.runtime.support import TINY_UNET


def _tiny():
    model = build_model({"name": "unet", "preset": None, **TINY_UNET}, None)
    unit = model.units[0]
    return model, unit_layers(build_units(model, 0, {}, {"unet": set(range(unit.num_layers))}), "unet")


def test_each_layer_holds_the_parameters_its_spec_counts():
    model, layers = _tiny()
    counted = [layer.params for layer in model.units[0].layers]
    assert [sum(p.numel() for p in module.parameters()) for module in layers] == counted


def test_a_pass_pops_every_skip_it_pushed_and_scores_only_the_noise_channels():
    model, layers = _tiny()
    state = unit_fields(model, "unet", collate([SyntheticDiffusion(0, 8)[i] for i in range(4)]))
    for module in layers:
        state = module(state)
    assert not [key for key in state if key.startswith("skip.")]
    assert state["x"].shape == (4, 6, 8, 8) and torch.isfinite(state["loss"])
    state["loss"].backward()
    out = layers[-1].conv.weight.grad  # 6 output channels: the noise (3), then the variance (3)
    assert out[:3].abs().sum() > 0 and out[3:].abs().sum() == 0


def test_the_cosine_schedule_and_samples():
    alpha = cosine_alpha_bars()
    assert alpha.shape == (4000,) and alpha[0] > 0.9999 and alpha[-1] < 1e-6 and bool((alpha[1:] < alpha[:-1]).all())
    data = SyntheticDiffusion(0, 8)
    first, again, other = data[3], data[3], data[4]
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["noise"], other["noise"])
    assert first["alpha"] == alpha[int(first["timestep"])]
