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
from tests.strategies.megatron.test_megatron import request

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
    with pytest.raises(ConfigError, match=r"model.attention='xformers' is not one of: flash, flash1, flash2, eager"):
        build_model({**LONG_GPT, "attention": "xformers"})


def test_flash_removes_the_softmax_and_dropout_traffic_and_recomputes_the_scores_in_backward() -> None:
    eager = build_model({**LONG_GPT, "attention": "eager"}, 4096).unit("llm").layers[1]
    flash = build_model({**LONG_GPT, "attention": "flash"}, 4096).unit("llm").layers[1]
    compute = ComputeModel(request(LONG_GPT, "hopper", 1, 8).cluster, "bf16")
    e, f = compute.layer_times(eager, 1), compute.layer_times(flash, 1)
    times = {name: compute.kernel_times(next(k for k in eager.kernels if k.name == name), 1, Sharding(), 1) for name in KERNELS}
    softmax, dropout, scores = (times[name] for name in KERNELS)
    assert f.fwd == pytest.approx(e.fwd - softmax.fwd - dropout.fwd)
    assert f.bwd_input == pytest.approx(e.bwd_input - softmax.bwd_input - dropout.bwd_input + scores.fwd)
    # FlashAttention drops out inside its kernel: no launch of its own either.
    assert [k.name for k in eager.kernels if k.name not in [k.name for k in flash.kernels]] == ["attn_dropout"]


KERNELS = ("attn_softmax", "attn_dropout", "attn_scores")


def test_eager_attention_dropout_moves_five_bytes_per_score_each_way() -> None:
    """16 heads x 4096² scores: the forward reads the probabilities and writes the output
    and a byte of mask, the backward reads the gradient and the mask and writes the
    gradient: 5 · 16 · 4096² bytes each, at the H100's bandwidth; a model without dropout
    (model.dropout=false, a Llama block) has no such kernel."""
    block = build_model({**LONG_GPT, "attention": "eager"}, 4096).unit("llm").layers[1]
    compute = ComputeModel(request(LONG_GPT, "hopper", 1, 8).cluster, "bf16")
    dropout = next(k for k in block.kernels if k.name == "attn_dropout")
    seconds = 5 * 16 * 4096**2 / (compute.cluster.memory_bandwidth * compute.cluster.memory_efficiency)
    t = compute.kernel_times(dropout, 1, Sharding(), 1)
    assert (t.fwd, t.bwd_input) == pytest.approx((seconds + compute.cluster.kernel_overhead_s,) * 2)
    assert dropout.attention_core  # selective recomputation re-runs it (Korthikanti et al.)
    for cfg in ({**LONG_GPT, "dropout": False}, {**LONG_GPT, "style": "llama"}):
        assert not any(k.attention_dropout for k in build_model(cfg, 4096).unit("llm").layers[1].kernels)


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
