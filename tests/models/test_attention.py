"""model.attention: FlashAttention keeps O(s) softmax statistics instead of the s x s
scores and recomputes QK^T in backward; eager keeps the scores (Korthikanti et al.)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.costmodel.compute import ComputeModel
from src.errors import ConfigError, PlanError
from src.mesh import Sharding
from src.metrics import iteration_flops
from src.models.registry import build_model
from src.strategies import planner_for
from tests.strategies.test_megatron import request

SEQ = 32768
LONG_GPT = {"name": "gpt", "preset": None, "layers": 8, "hidden": 1024, "heads": 16, "vocab": 32000}


def long_request(attention: str, **options):
    """8 blocks of 32768 tokens on one H100 node at TP 8: the eager scores alone are
    5·16·32768² bytes per block / 8 = 10.7 GB, 86 GB for the 8 blocks."""
    req = request(LONG_GPT, "hopper", 1, 8, tp=8, pp=1, vpp=1, micro_batch_size=1, sequence_parallel=True, zero_stage=0, **options)
    return replace(req, model=build_model({**LONG_GPT, "attention": attention}, SEQ))


@pytest.mark.parametrize("mode", ["flash", "eager"])
def test_the_default_is_the_one_given(mode: str) -> None:
    block = build_model(LONG_GPT, 4096, mode).unit("llm").layers[1]
    heads, seq = 16, 4096
    kept = 4 * heads * seq if mode == "flash" else 5 * heads * seq * seq  # fp32 stats | GPT's 5as²
    assert block.activations.attention == kept
    assert build_model(LONG_GPT, 4096).unit("llm").layers[1].activations.attention == 5 * heads * seq * seq


def test_unknown_attention_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"model.attention='xformers' is not one of: flash, eager"):
        build_model({**LONG_GPT, "attention": "xformers"})


def test_flash_removes_the_softmax_traffic_and_recomputes_the_scores_in_backward() -> None:
    eager = build_model({**LONG_GPT, "attention": "eager"}, 4096).unit("llm").layers[1]
    flash = build_model({**LONG_GPT, "attention": "flash"}, 4096).unit("llm").layers[1]
    compute = ComputeModel(request(LONG_GPT, "hopper", 1, 8).cluster, "bf16")
    e, f = compute.layer_times(eager, 1), compute.layer_times(flash, 1)
    softmax = next(k for k in eager.kernels if k.name == "attn_softmax")
    scores = next(k for k in eager.kernels if k.name == "attn_scores")
    softmax_time = compute.kernel_times(softmax, 1, Sharding(), 1)
    scores_time = compute.kernel_times(scores, 1, Sharding(), 1)
    assert f.fwd == pytest.approx(e.fwd - softmax_time.fwd)
    assert f.bwd_input == pytest.approx(e.bwd_input - softmax_time.bwd_input + scores_time.fwd)


def test_long_sequence_needs_recompute_under_eager_and_none_under_flash() -> None:
    megatron = planner_for("megatron")
    with pytest.raises((PlanError, ConfigError), match="short by"):
        megatron(long_request("eager", recompute="none"))
    flash = megatron(long_request("flash", recompute="none"))
    assert flash.unit("llm").recompute == "none"
    # Searched: eager has to drop (and recompute) the scores, flash keeps everything.
    assert megatron(long_request("eager")).unit("llm").recompute != "none"
    assert megatron(long_request("flash")).unit("llm").recompute == "none"


def test_mfu_model_flops_do_not_change_hfu_counts_the_backward_scores() -> None:
    megatron = planner_for("megatron")
    eager_req, flash_req = long_request("eager", recompute="none"), long_request("flash", recompute="none")
    plan = megatron(flash_req)
    eager_model, eager_hw = iteration_flops(eager_req.model, plan, eager_req.train)
    flash_model, flash_hw = iteration_flops(flash_req.model, plan, flash_req.train)
    assert flash_model == eager_model == eager_hw
    # One more QK^T per block per sample: 2·s·s·h FLOPs.
    assert flash_hw - flash_model == pytest.approx(8 * 8 * 2 * SEQ * SEQ * 1024)
