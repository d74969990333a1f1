"""src.validate's re-pricing of stored measurements (no real run: the simulator only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from src import validate
from src.errors import ConfigError


def test_reprice_prices_each_stored_case_again_and_keeps_its_measurement() -> None:
    rows = [
        {"case": "gpt-s/ddp-z0", "workers": 2, "measured_s": 0.05, "predicted_s": 1.0, "error_pct": 1900.0},
        {"case": "gpt-s/ddp-z2", "workers": 4, "error": "torch: exit 1"},
    ]
    repriced = validate.reprice(rows)
    assert repriced[1] == rows[1]  # nothing measured: left as it was
    row = repriced[0]
    assert row["measured_s"] == 0.05 and row["predicted_s"] != 1.0
    assert row["predicted_s"] == pytest.approx(validate.predict(validate.grid()[0])["iteration_time_s"])
    assert row["error_pct"] == pytest.approx(100 * (row["predicted_s"] - 0.05) / 0.05)
    assert set(row["predicted_breakdown_s"]) <= set(validate.BREAKDOWN_CATEGORIES)


def test_reprice_writes_a_table_that_says_it_ran_nothing(tmp_path: Path) -> None:
    stored = tmp_path / "validation.json"
    stored.write_text(
        json.dumps(
            {
                "rows": [{"case": "gpt-s/ddp-z0", "workers": 2, "measured_s": 0.05, "measured_breakdown_s": {}}],
                "mape_pct": 3.0,
                "load": [1.0],
                "host": {"cpu_model": "AMD EPYC", "cores": 2},
            }
        )
    )
    validate._write_repriced(stored, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "repriced.json").read_text())
    assert summary["stored_mape_pct"] == 3.0 and summary["mape_pct"] == pytest.approx(abs(summary["rows"][0]["error_pct"]))
    assert "no case was run again" in (tmp_path / "out" / "repriced.md").read_text()
    assert summary["host"]["cpu_model"] == "AMD EPYC"


def test_stored_measurements_are_priced_with_the_profile_of_the_cpu_that_measured_them(tmp_path: Path) -> None:
    # Both CPU models' profiles are committed: each prices the same case its own way, whatever this host is.
    rows = [{"case": "gpt-s/ddp-z0", "workers": 2, "measured_s": 0.05}]
    intel = validate.reprice(rows, "Intel(R) Xeon(R) Processor")[0]["predicted_s"]
    amd = validate.reprice(rows, "AMD EPYC")[0]["predicted_s"]
    assert intel != pytest.approx(amd, rel=0.01)
    stored = tmp_path / "validation.json"
    assert validate.measuring_cpu({"host": {"cpu_model": "AMD EPYC"}}, stored, None) == "AMD EPYC"
    assert validate.measuring_cpu({}, stored, "AMD EPYC") == "AMD EPYC"
    with pytest.raises(ConfigError, match=r"does not say which CPU measured it: pass --host .*'AMD EPYC'"):
        validate.measuring_cpu({}, stored, None)
    with pytest.raises(ConfigError, match="was measured on 'AMD EPYC'"):
        validate.measuring_cpu({"host": {"cpu_model": "AMD EPYC"}}, stored, "Intel(R) Xeon(R) Processor")


def test_every_committed_validation_says_which_cpu_measured_it() -> None:
    from src.cluster_profile import profiled_cpu_models

    folder = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "validation"
    stored = [folder / "validation.json", *(folder / "repriced").glob("run*_validation.json")]
    for path in stored:
        assert json.loads(path.read_text())["host"]["cpu_model"] in profiled_cpu_models("local"), path
