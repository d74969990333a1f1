"""Measured GEMM tables (conf/cluster/measured/gemm/): a preset's table gives back its
source's times at its shapes, corrects the curve between them, is not extrapolated past
its largest dimensions, and a bad table is refused in one line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from src.cluster import ClusterSpec
from src.costmodel.compute import ComputeModel
from src.errors import ConfigError
from src.gemm_measurements import GEMM_DIR, measured_gemms
from src.setup import validate
from tests.composing import composed

# Every preset and the table it names (conf/cluster/*.yaml's gemm_measurements).
PRESETS_WITH_TABLES = sorted(
    p.stem for p in (GEMM_DIR.parents[2] / "cluster").glob("*.yaml") if yaml.safe_load(p.read_text()).get("gemm_measurements")
)

# Rows of huizhg/gpu-perf-mi250x at 45c52de, results/rocblas.csv: M, N, K, ms, TFLOPS.
SOURCE_ROWS = [
    (8192, 8192, 8192, 10.34318, 106.3),
    (2048, 11008, 4096, 1.6613, 111.17),
    (1024, 1280, 1280, 0.05488, 61.14),
    (512, 512, 512, 0.01776, 15.11),
]


def _frontier() -> ClusterSpec:
    return validate(composed(["model=gpt", "cluster=frontier", "strategy=ddp", "logger=none"])).cluster


@pytest.mark.parametrize("m, n, k, ms, tflops", SOURCE_ROWS)
def test_the_frontier_table_prices_its_source_rows_as_measured(m: int, n: int, k: int, ms: float, tflops: float) -> None:
    model = ComputeModel(_frontier(), "bf16")
    seconds = model.gemm_time(m, n, k)
    assert seconds == pytest.approx(ms / 1e3, rel=1e-9)
    assert 2 * m * n * k / seconds / 1e12 == pytest.approx(tflops, abs=0.006)  # the file's two decimals


def test_the_presets_with_tables_are_found() -> None:
    assert PRESETS_WITH_TABLES == ["frontier", "p3_16xlarge"]


def test_the_v100_table_keeps_the_gemms_its_rule_keeps() -> None:
    """Its header's rule: a GEMM whose FLOPs over its fp16 operands' bytes reach the V100's
    125 TFLOP/s over its copy rate (0.90 x 900 GB/s); 41 of the sheet's 83 shapes."""
    table = measured_gemms("v100_deepbench")
    ridge = 125e12 / (0.90 * 900e9)
    assert len(table.points) == 41
    assert all(p.flops / (2.0 * (p.m * p.k + p.k * p.n + p.m * p.n)) >= ridge for p in table.points)


@pytest.mark.parametrize("preset", PRESETS_WITH_TABLES)
def test_every_measured_gemm_comes_back_unchanged(preset: str) -> None:
    cluster = validate(composed(["model=gpt", f"cluster={preset}", "strategy=ddp", "logger=none"])).cluster
    assert cluster.gemm_measurements is not None
    for precision in cluster.gemm_measurements.precisions:
        model = ComputeModel(cluster, precision)
        for p in cluster.gemm_measurements.points:
            assert model.gemm_time(p.m, p.n, p.k) == pytest.approx(p.seconds, rel=1e-9)


def test_the_table_corrects_the_curve_where_the_library_levels_off() -> None:
    cluster = _frontier()
    measured, curve = ComputeModel(cluster, "bf16"), ComputeModel(replace(cluster, gemm_measurements=None), "bf16")
    peak = cluster.peak_flops["bf16"]
    # The curve keeps rising past 4096 where rocBLAS levels off at 101-106 TFLOP/s.
    assert curve.efficiency(8192, 8192, 8192) * peak > 130e12
    assert measured.efficiency(8192, 8192, 8192) * peak == pytest.approx(106.3e12, rel=2e-3)
    # Not extrapolated: past every measured dimension a GEMM runs as the table's largest.
    assert measured.efficiency(32768, 32768, 32768) == measured.efficiency(8192, 11008, 11008)
    # Below the smallest it falls off as the curve does from the smallest's measured rate.
    ratio = measured.efficiency(128, 512, 512) / measured.efficiency(512, 512, 512)
    assert ratio == pytest.approx(curve.efficiency(128, 512, 512) / curve.efficiency(512, 512, 512), rel=1e-12)
    # fp32 was not measured: the curve prices it.
    assert ComputeModel(cluster, "fp32").efficiency(4096, 4096, 4096) == ComputeModel(
        replace(cluster, gemm_measurements=None), "fp32"
    ).efficiency(4096, 4096, 4096)


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("library: x\nsource: y\nprecisions: [bf16]\ngemms: []\n", "gemms lists"),
        ("library: x\nsource: y\nprecisions: [int8]\ngemms: [[1, 1, 1, 1]]\n", "precisions"),
        ("library: x\nprecisions: [bf16]\ngemms: [[1, 1, 1, 1]]\n", "source"),
        ("library: x\nsource: y\nprecisions: [bf16]\ngemms: [[1, 1, 1]]\n", r"\[m, n, k, ms\]"),
        ("library: x\nsource: y\nprecisions: [bf16]\ngemms: [[0, 1, 1, 1]]\n", "whole and positive"),
        ("library: x\nsource: y\nprecisions: [bf16]\ngemms: [[2, 2, 2, 1], [2, 2, 2, 3]]\n", "measured twice"),
        ("library: x\nsource: y\nprecisions: [bf16]\ngemms: [[2, 2, 2, 1]]\ntable: 1\n", "table"),
    ],
)
def test_a_bad_gemm_table_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, complaint: str) -> None:
    monkeypatch.setattr("src.gemm_measurements.GEMM_DIR", tmp_path)
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError, match=complaint) as err:
        measured_gemms("bad")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no conf/cluster/measured/gemm/missing.yaml"):
        measured_gemms("missing")


def test_a_preset_names_at_most_one_table() -> None:
    with pytest.raises(ConfigError, match="at most one table"):
        validate(composed(["model=gpt", "cluster=frontier", "strategy=ddp", "logger=none", "cluster.gemm_measurements=[a,b]"]))


def test_a_measured_time_within_the_kernel_overhead_is_refused() -> None:
    cluster = _frontier()
    with pytest.raises(ConfigError, match="no longer than the preset's per-kernel overhead"):
        ComputeModel(replace(cluster, kernel_overhead_s=1.0), "bf16")
