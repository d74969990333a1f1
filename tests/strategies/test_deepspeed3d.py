"""DeepSpeed-3D as the codebase Par4D cites for it runs: its attention kernel and its parameter
gradients' reductions are its own."""

from __future__ import annotations

import pytest

from src.errors import ConfigError
from src.models.spec import ModelSpec
from src.setup import validate
from tests.test_configs import compose_config

GPT_PERLMUTTER = ["model=gpt", "model.preset=gpt_5b", "cluster=perlmutter", "cluster.nodes=16", "train.global_batch=64"]


def _eager(model: ModelSpec) -> bool:
    """Whether the attention cores keep their scores in memory (an attention-dropout kernel
    of its own is the eager core's; FlashAttention runs it inside)."""
    kernels = [kernel for unit in model.units for layer in unit.layers for kernel in layer.kernels]
    assert any(kernel.attention_scores for kernel in kernels)
    return any(kernel.attention_dropout for kernel in kernels)


def test_deepspeed3d_runs_its_codebases_eager_attention_on_a_flash_era_cluster():
    assert not _eager(validate(compose_config(*GPT_PERLMUTTER, "strategy=megatron")).model)  # perlmutter: flash
    assert _eager(validate(compose_config(*GPT_PERLMUTTER, "strategy=deepspeed3d")).model)


def test_model_attention_set_by_hand_wins_and_null_takes_the_clusters():
    assert not _eager(validate(compose_config(*GPT_PERLMUTTER, "strategy=deepspeed3d", "model.attention=flash")).model)
    assert not _eager(validate(compose_config(*GPT_PERLMUTTER, "strategy=deepspeed3d", "strategy.attention=null")).model)


def test_a_bad_attention_kernel_is_one_line():
    with pytest.raises(ConfigError, match=r"strategy.attention='fused'; choose one of \['flash', 'flash1', 'flash2', 'eager'\]"):
        validate(compose_config(*GPT_PERLMUTTER, "strategy=deepspeed3d", "strategy.attention=fused"))


def _separate(model) -> bool:
    return any(kernel.grad_reduction_bytes for unit in model.units for layer in unit.layers for kernel in layer.kernels)


def test_deepspeed3d_reduces_its_parameter_gradients_in_kernels_of_their_own_on_a_fused_era_cluster():
    """hopper's software (Transformer Engine) fuses them; DeepSpeed-3D's codebase does not,
    unless model.param_grad_kernels says otherwise or strategy.param_grad_kernels leaves it
    to the run."""
    gpt_hopper = ["model=gpt", "model.preset=gpt_5b", "cluster=hopper", "cluster.nodes=2", "train.global_batch=64"]
    assert not _separate(validate(compose_config(*gpt_hopper, "strategy=megatron")).model)
    assert _separate(validate(compose_config(*gpt_hopper, "strategy=deepspeed3d")).model)
    assert not _separate(validate(compose_config(*gpt_hopper, "strategy=deepspeed3d", "model.param_grad_kernels=fused")).model)
    assert not _separate(validate(compose_config(*gpt_hopper, "strategy=deepspeed3d", "strategy.param_grad_kernels=null")).model)
    with pytest.raises(ConfigError, match=r"strategy.param_grad_kernels='te'; choose one of \['separate', 'fused'\]"):
        validate(compose_config(*gpt_hopper, "strategy=deepspeed3d", "strategy.param_grad_kernels=te"))
