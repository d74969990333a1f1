"""A GEMM kernel's fixed time (cluster.gemm_fixed_s): every GEMM pays it once and nothing else
does, a measured GEMM table still gives back its times, the hopper preset states what
src.gemm_fixed fits to its measured file, and a bad file is one line."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from src import gemm_fixed
from src.costmodel.compute import ComputeModel
from src.errors import ConfigError
from src.setup import validate
from tests.composing import composed


def _preset(name: str):
    return validate(composed(["model=gpt", f"cluster={name}", "strategy=ddp", "logger=none"])).cluster


def test_each_gemm_pays_the_fixed_time_once_and_a_memory_kernel_none() -> None:
    cluster = replace(_preset("hopper"), gemm_fixed_s=0.0)
    plain, fixed = ComputeModel(cluster, "bf16"), ComputeModel(replace(cluster, gemm_fixed_s=3e-6), "bf16")
    for shape in [(256, 256, 256, 1.0), (4096, 12288, 1536, 1.0), (512, 512, 4096, 4.0)]:
        assert fixed.gemm_time(*shape) - plain.gemm_time(*shape) == pytest.approx(3e-6, rel=1e-9)
    assert fixed.memory_time(1e6) == plain.memory_time(1e6)
    assert fixed.gemm_time(0, 8, 8) == 0.0  # no GEMM, no kernel


def test_a_measured_table_gives_its_times_back_whatever_the_fixed_time() -> None:
    cluster = replace(_preset("frontier"), gemm_fixed_s=5e-6)
    assert cluster.gemm_measurements is not None
    model = ComputeModel(cluster, "bf16")
    for p in cluster.gemm_measurements.points:
        assert model.gemm_time(p.m, p.n, p.k) == pytest.approx(p.seconds, rel=1e-9)


def test_the_hopper_preset_states_the_fit_of_its_file() -> None:
    data = gemm_fixed.load(gemm_fixed.DEFAULT)
    cluster = _preset(data.cluster)
    fitted = gemm_fixed.fit(cluster, data)
    assert cluster.gemm_fixed_s == pytest.approx(round(fitted, 7), abs=1e-12)  # stated to a tenth of a microsecond
    # The fit is what the small GEMMs say: without it the model prices them at a third of their time or less.
    small = [g for g in data.gemms if g.m <= 512]
    assert all(t < 0.35 * g.seconds for g, t in zip(small, gemm_fixed.model_seconds(cluster, data, small, 0.0)))
    errors = [t / g.seconds - 1 for g, t in zip(small, gemm_fixed.model_seconds(cluster, data, small, fitted))]
    assert max(map(abs, errors)) < 0.1


def test_a_kernel_duration_leaves_the_gap_between_kernels_out() -> None:
    data = gemm_fixed.load(gemm_fixed.DEFAULT)
    cluster = _preset(data.cluster)
    kernel = gemm_fixed.model_seconds(cluster, data, data.gemms[:1], 1e-6)
    stream = gemm_fixed.model_seconds(cluster, replace(data, timing="stream"), data.gemms[:1], 1e-6)
    assert stream[0] - kernel[0] == pytest.approx(cluster.kernel_overhead_s, rel=1e-9)
    assert cluster.kernel_overhead_s > 0


def test_the_fit_finds_a_fixed_time_it_was_built_from() -> None:
    cluster = _preset("hopper")
    shapes = [(1, 256, 256, 256), (2, 512, 512, 512), (4, 2048, 1024, 512)]
    data = replace(gemm_fixed.load(gemm_fixed.DEFAULT), gemms=tuple(gemm_fixed.BatchedGemm(*s, flop_per_s=1.0) for s in shapes))
    times = gemm_fixed.model_seconds(cluster, data, data.gemms, 2.5e-6)
    gemms = tuple(gemm_fixed.BatchedGemm(b, m, n, k, 2.0 * b * m * n * k / t) for (b, m, n, k), t in zip(shapes, times))
    assert gemm_fixed.fit(cluster, replace(data, gemms=gemms)) == pytest.approx(2.5e-6, abs=gemm_fixed.STEP_S / 2)


HEAD = "source: s\ncluster: hopper\nprecision: bf16\n"
ROW = "gemms: [[2, 256, 256, 256, 1000000000000]]\n"


@pytest.mark.parametrize(
    "text, message",
    [
        (HEAD + "timing: kernel\ngemms: [[2, 256, 256, 256]]\n", "a GEMM is \\[b, m, n, k, flop_per_s\\]"),
        (HEAD + "timing: kernel\ngemms: [[2, 256, 256, 0, 1000000000000]]\n", "whole and positive"),
        ("cluster: hopper\nprecision: bf16\ntiming: kernel\n" + ROW, "must say its source"),
        (HEAD + "timing: wall\n" + ROW, "timing is one of"),
        ("source: s\ncluster: nonsense\nprecision: bf16\ntiming: kernel\n" + ROW, "not a preset"),
        (HEAD + "timing: kernel\ngemms: []\nextra: 1\n", "extra"),
    ],
)
def test_a_bad_file_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        gemm_fixed.load(path)
    assert "\n" not in str(err.value)


def test_the_command_fits_and_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gemm_fixed.main([]) == 0
    assert "gemm_fixed_s fitted 5.30 us (preset states 5.30 us)" in capsys.readouterr().out
    assert gemm_fixed.main([str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_hopper_curve_is_its_measurements_fitted_under_the_preset_s_own_gemm_overhead() -> None:
    """The curve's fit holds what a GEMM costs beyond its arithmetic (kernel_overhead_s +
    gemm_fixed_s), as the fixed time's fit holds the curve (the test above): the preset
    states a point where each gives back the other."""
    import importlib.util
    import json
    import math

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("calibrate_gpu", root / "benchmarks" / "calibrate_gpu.py")
    assert spec is not None and spec.loader is not None
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    stored = json.loads((root / "benchmarks" / "results" / "hopper_h100_calibration.json").read_text())
    cluster = _preset("hopper")
    points = [((g["m"], g["n"], g["k"]), g["efficiency"]) for g in stored["gemms"]]
    fitted = [(s, e) for s, e in points if 2.0 * math.prod(s) / (e * stored["datasheet_peak"]) > calibrate.FIT_ABOVE_S]
    overhead = cluster.kernel_overhead_s + cluster.gemm_fixed_s
    max_eff, half, _ = calibrate.fit(fitted, stored["datasheet_peak"], stored["copy_bytes_per_s"], overhead, 2)
    assert (max_eff, half) == (cluster.gemm_max_efficiency, cluster.gemm_half_dim)
    assert stored["fit"]["gemm_overhead_s"] == pytest.approx(overhead)  # as the stored file says it was fitted


def _fit_script(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/fit_gemm_curve.py as a module."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("fit_gemm_curve", root / "benchmarks" / "fit_gemm_curve.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclass looks its module up
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize(
    ("fitted", "presets"),
    [("dgx_a100", ("dgx_a100", "a800", "perlmutter")), ("p3_16xlarge", ("p3_16xlarge",)), ("frontier", ("frontier",))],
)
def test_a_presets_curve_is_its_public_gemms_fitted_as_the_model_prices_them(
    fitted: str, presets: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/fit_gemm_curve.py gives back what the presets state: the A100 presets' curve
    from the public A100 GEMMs (a bmm's b GEMMs priced as one of b x m rows), the V100's and the
    MI250X's from their measured tables, the curve alone."""
    max_efficiency, half_dim, _ = _fit_script(monkeypatch).fit(fitted)
    for name in presets:
        cluster = _preset(name)
        assert (cluster.gemm_max_efficiency, cluster.gemm_half_dim) == (max_efficiency, half_dim), name


@pytest.mark.parametrize("preset", ["hopper", "no_such_preset"])
def test_the_fit_refuses_a_preset_it_has_no_gemms_for_in_one_line(
    preset: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _fit_script(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["fit_gemm_curve.py", preset])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert preset in error and "dgx_a100" in error and "p3_16xlarge" in error
