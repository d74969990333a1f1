"""The tiny MLLMs (model.scale=tiny): the paper's structure at a few MB, and real modules for
every layer that the runtime builds from their LayerSpecs."""

from __future__ import annotations

import pytest
import torch

from src.models.flows import chain_key
from src.models.registry import build_model
from src.batch_layout import BatchLayout
from src.runtime.inputs import Batches, StepSamples, dataset_for
from src.runtime.modules.units import build_units, llama_style, unit_layers

MODELS = ("mllm_9b", "mllm_15b", "mllm_72b")


@pytest.mark.parametrize("name", MODELS)
def test_a_tiny_mllm_keeps_the_structure_at_a_few_mb(name):
    tiny, paper = build_model({"name": name, "scale": "tiny"}), build_model({"name": name})
    assert tiny.params * 4 < 5e6 < paper.params
    for small, large in zip(tiny.units, paper.units):
        assert {layer.name for layer in small.layers} == {layer.name for layer in large.layers}
    assert [layer.name for layer in tiny.unit("generator").layers] == [layer.name for layer in paper.unit("generator").layers]
    # MLLM-72B's Llama has grouped-query attention; the others do not, at both scales.
    tiny_llama, paper_llama = llama_style(tiny.unit("llm")), llama_style(paper.unit("llm"))
    assert tiny_llama is not None and paper_llama is not None
    assert (tiny_llama.kv_heads < tiny.unit("llm").heads) == (paper_llama.kv_heads < paper.unit("llm").heads) == (name == "mllm_72b")


def test_the_runtime_builds_every_layer_with_the_parameters_the_spec_counts():
    model = build_model({"name": "mllm_72b", "scale": "tiny", "train_projectors": True, "frozen": ["encoder", "generator"]})
    units = build_units(model, 0, {}, {u.name: set(range(u.num_layers)) for u in model.units})
    for name in ("encoder", "generator"):
        spec = model.unit(name)
        assert sum(p.numel() for p in units[name].parameters()) == spec.params
        trained = sum(p.numel() for p in units[name].parameters() if p.requires_grad)
        assert trained == spec.trainable_params() > 0  # the projector only: the ViT, U-Net and VAE are frozen


def test_the_generator_scores_the_noise_and_uses_every_skip_it_keeps():
    model = build_model({"name": "mllm_9b", "scale": "tiny"})
    generator = model.unit("generator")
    units = build_units(model, 0, {}, {"generator": set(range(generator.num_layers))})
    whole = BatchLayout(2, micro_batch=2)
    batches = Batches(StepSamples(model, dataset_for(model, 0, "synthetic"), 2, {"generator": (whole, 0)}))
    batches.start_step(0)
    state = dict(batches("generator", 0))
    state[chain_key("llm")] = torch.randn(2, generator.layers[0].kernels[0].m * generator.layers[0].kernels[0].k)
    for layer in unit_layers(units, "generator"):
        state = layer(state)
    assert state["loss"].shape == () and state["loss"] > 0
    assert state["x"].shape == state["noise"].shape
    assert not [key for key in state if key.startswith("skip.")]
