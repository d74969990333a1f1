"""Measured FlashAttention tables (conf/cluster/measured/attention/): a table gives back its
source's rates at its points, interpolates between them as the data runs, prices a named
version's core by them (a measured version's causal core at half the FLOPs), and a preset
without a table, a precision it was not measured at or a bad table is refused in one line."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from src.attention_measurements import ATTENTION_DIR, measured_attention
from src.costmodel.compute import ComputeModel
from src.errors import ConfigError
from src.mesh import Sharding
from src.models.spec import LayerSpec
from src.setup import preset_cluster, validate
from tests.composing import composed

# Bars of Dao-AILab/flash-attention's assets/flash2_a100_fwd_bwd_benchmark.png (TFLOP/s):
# (kernel, causal, head dimension, sequence, rate).
SOURCE_BARS = [
    ("flash1", True, 128, 512, 55),
    ("flash1", True, 128, 16384, 83),
    ("flash2", True, 128, 2048, 155),
    ("flash2", True, 64, 8192, 165),
    ("flash2", False, 128, 16384, 203),
    ("flash1", False, 64, 1024, 92),
]


@pytest.mark.parametrize("kernel, causal, head_dim, seq, tflops", SOURCE_BARS)
def test_the_a100_table_gives_back_its_source_bars(kernel: str, causal: bool, head_dim: int, seq: int, tflops: float) -> None:
    assert measured_attention("a100_flash_attention").rate(kernel, causal, head_dim, seq) == pytest.approx(tflops * 1e12)


def test_between_and_past_the_measured_points() -> None:
    table = measured_attention("a100_flash_attention")
    # Halfway in log2 between 2048 (155) and 4096 (173); past 16k the 16k rate, below 512 the 512 one.
    assert table.rate("flash2", True, 128, 2048 * math.sqrt(2)) == pytest.approx(164e12)
    assert table.rate("flash2", True, 128, 65536) == table.rate("flash2", True, 128, 16384)
    assert table.rate("flash2", True, 128, 256) == table.rate("flash2", True, 128, 512)
    # Head dimension 96, halfway between 64 (140) and 128 (155) at 2k; 40 runs as 64 does; past 128 the
    # table says nothing.
    assert table.rate("flash2", True, 96, 2048) == pytest.approx(147.5e12)
    assert table.rate("flash2", True, 40, 2048) == table.rate("flash2", True, 64, 2048)
    assert table.covers("flash2", True, 128) and not table.covers("flash2", True, 256)
    # A point the source's legend hides (FlashAttention-2, no mask, 128 at 1k) is interpolated from its neighbours.
    assert table.rate("flash2", False, 128, 1024) == table.rate("flash2", False, 128, 2048)


@pytest.mark.parametrize("name", sorted(p.stem for p in ATTENTION_DIR.glob("*.yaml")))
def test_every_table_rises_with_the_sequence_where_its_source_does(name: str) -> None:
    """FlashAttention's rate grows with the sequence (more tiles per launch), overall in every
    series; from one bar to the next the source's own fall by at most 6 % (FlashAttention 1 on
    an A100 without a mask at 128, 76 to 72): the interpolation keeps them."""
    table = measured_attention(name)
    for kernel in table.kernels:
        for mask, by_dim in table.series[kernel].items():
            for dim, series in by_dim.items():
                rates = series.rates
                assert rates[-1] > rates[0], (kernel, mask, dim)
                assert all(b >= 0.94 * a for a, b in zip(rates, rates[1:])), (kernel, mask, dim, rates)


def _block(mode: str) -> LayerSpec:
    """A GPT block of hidden 2048 and 16 heads of 128 over 8192 tokens, its attention as `mode`."""
    size = ["model.preset=null", "model.layers=1", "model.hidden=2048", "model.heads=16", "model.vocab=50304", "train.seq_len=8192"]
    overrides = ["model=gpt", *size, f"model.attention={mode}", "cluster=dgx_a100", "strategy=ddp", "logger=none"]
    model = validate(composed(overrides)).model
    return next(layer for layer in model.units[0].layers if any(k.attention_core for k in layer.kernels))


def test_a_measured_version_prices_its_core_at_the_measured_rate() -> None:
    """On the benchmark's own grid (16,384 tokens: two samples of 8k, 16 heads of 128)."""
    cluster = preset_cluster("dgx_a100")
    compute = ComputeModel(cluster, "bf16")
    s, d, heads, samples = 8192, 128, 16, 2
    forward_flops = 4 * s * s * d * heads * samples / 2  # the benchmark's count: causal, halved
    for mode, tflops in (("flash1", 80), ("flash2", 182)):  # the table's causal 128 at 8k
        layer = _block(mode)
        core = [k for k in layer.kernels if k.attention_core and k.kind == "gemm"]
        assert {k.flash_kernel for k in core} == {mode}
        times = [compute.kernel_times(k, samples, Sharding(), 1, causal=True) for k in core]
        fwd = sum(t.fwd for t in times)
        bwd = sum(t.bwd_input for t in times)
        assert fwd == pytest.approx(forward_flops / (tflops * 1e12))
        assert bwd == pytest.approx(2.5 * fwd)  # two input gradients each and the recomputed scores
    # flash: the same core on the GEMM curve, which rates both versions alike
    assert {k.flash_kernel for k in _block("flash").kernels} == {""}


def test_a_grid_of_few_heads_is_bound_by_its_longest_blocks() -> None:
    """FlashAttention 2 at head dimension 128 (the table's grid): 2 x 16 heads of 8k fill the
    A100's 216 forward slots as the benchmark did; a causal forward of one sample's 4 heads (TP 8
    of 32) is 256 blocks of 1 to 64 key blocks, bound by the heaviest (1.7x the table's time);
    its backward, heaviest first on 108 slots, less so. Other kernels and head dimensions keep
    the measured rate, and a full mask's equal blocks lose only the last wave's slots."""
    table = measured_attention("a100_flash_attention")
    assert table.packing("flash2", True, 128, 8192, 32) == pytest.approx((1.0, 1.0))
    forward, backward = table.packing("flash2", True, 128, 8192, 4)
    assert forward == pytest.approx(1.70, abs=0.01) and 1.0 < backward < forward
    by_heads = [table.packing("flash2", True, 128, 8192, g)[0] for g in (32, 16, 8, 4, 1)]
    assert by_heads == sorted(by_heads)
    assert table.packing("flash1", True, 128, 8192, 4) == (1.0, 1.0)
    assert table.packing("flash2", True, 64, 8192, 4) == (1.0, 1.0)
    # A full mask: the benchmark's 2048 equal blocks in 10 waves of 216, these 256 in 2.
    full = table.packing("flash2", False, 128, 8192, 4)[0]
    assert full == pytest.approx((2048 / (216 * 10)) / (256 / (216 * 2)), rel=1e-12)
    # The compute model scales the core by it: TP 8's share of the heads.
    compute = ComputeModel(preset_cluster("dgx_a100"), "bf16")
    scores = next(k for k in _block("flash2").kernels if k.attention_scores and k.kind == "gemm")
    whole = compute.kernel_times(scores, 2, Sharding(), 1, causal=True)
    few = compute.kernel_times(replace(scores, batch=2), 1, Sharding(), 1, causal=True)  # 2 heads of one sample
    # A sixteenth of the FLOPs, in more than a sixteenth of the time: the packing's share more.
    assert few.fwd == pytest.approx(whole.fwd / 16 * table.packing("flash2", True, 128, 8192, 2)[0])
    assert few.bwd_input == pytest.approx(whole.bwd_input / 16 * table.packing("flash2", True, 128, 8192, 2)[1])
    # A pass priced in quarters that launches its core once (StepCCL's chunks) packs the whole grid.
    quarter = compute.kernel_times(scores, 0.5, Sharding(), 1, causal=True, grid_rows=2)
    assert quarter.fwd == pytest.approx(whole.fwd / 4) and quarter.bwd_input == pytest.approx(whole.bwd_input / 4)


def test_a_head_wider_than_the_table_measured_stays_on_the_curve() -> None:
    compute = ComputeModel(preset_cluster("dgx_a100"), "bf16")
    layer = _block("flash2")
    scores = next(k for k in layer.kernels if k.attention_scores and k.kind == "gemm")
    wide = replace(scores, k=512, batch=4)  # a VAE's one 512-wide head (four of them here)
    on_curve = compute.kernel_times(replace(wide, flash_kernel=""), 1, Sharding(), 1, causal=True)
    assert compute.kernel_times(wide, 1, Sharding(), 1, causal=True) == on_curve


def test_a_measured_version_needs_its_preset_s_table_and_precision() -> None:
    base = ["model=gpt", "strategy=ddp", "logger=none"]
    with pytest.raises(ConfigError, match="measured FlashAttention rates; cluster p3_16xlarge has none"):
        validate(composed([*base, "model.attention=flash2", "cluster=p3_16xlarge"]))
    with pytest.raises(ConfigError, match="measured at fp16, bf16, not train.precision=fp32"):
        validate(composed([*base, "model.attention=flash1", "cluster=dgx_a100", "train.precision=fp32"]))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("method"), "must say its method"),
        (lambda d: d.update(sequences=[1024, 512]), "increasing positive lengths"),
        (lambda d: d["rates"]["flash1"].pop("full"), "needs rates under both masks"),
        (lambda d: d["rates"]["flash1"]["causal"].update({64: [1, 2]}), "one rate per sequence"),
        (lambda d: d["rates"]["flash1"]["causal"][64].__setitem__(0, -3), "rates are positive TFLOP/s"),
        (lambda d: d.update(precisions=["fp32"]), "16-bit precisions"),
        (lambda d: d.pop("sms"), "a grid needs the device's sms and the benchmark's tokens and hidden"),
        (lambda d: d["grid"]["flash2"][128]["forward"].update(rows=0), "forward and backward positive rows and per_sm"),
        (lambda d: d["grid"].update(flash3={128: {}}), "grid.flash3 is not a rated kernel"),
    ],
)
def test_a_bad_table_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change, message: str) -> None:
    import src.attention_measurements as attention_measurements

    data = yaml.safe_load((ATTENTION_DIR / "a100_flash_attention.yaml").read_text())
    change(data)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setattr(attention_measurements, "ATTENTION_DIR", tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        measured_attention("bad")
    assert "\n" not in str(err.value)
