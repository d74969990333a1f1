"""Scoring a catalogue against hand-made figure results: ours, the verdict, the best plan,
"up to", a miss's evidence filled from the results, claims, sensitivity, counts and files;
results of another version of a preset are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from src.errors import ConfigError
from src.reproduction.catalogue import Presets, load_catalogue
from src.reproduction.results import load_results
from src.reproduction.scorecard import NOT_EXPLAINED, as_json, goal_met, markdown, score
from src.sweep import load_sweep, preset_hash

SWEEP = {
    "name": "toy_fig",
    "title": "toy",
    "source": "a test",
    "metric": "iteration_time_s",
    "normalize": {"by": "base", "invert": True},
    "extra_metrics": ["iteration_time_s", "mfu"],
    "base": [],
    "series": {"base": [], "base_best": [], "new": []},
    "groups": [{"label": "small"}, {"label": "large"}],
}
# iteration times: the paper's plan (base), our best plan (base_best), the new system
TIMES = {"small": {"base": 3.0, "base_best": 2.4, "new": 2.0}, "large": {"base": 6.0, "base_best": 5.0, "new": 3.0}}
CATALOGUE = {
    "paper": "toy",
    "title": "Toy (a test)",
    "text": "toy.txt",
    "figures": [
        {
            "figure": "Fig. 1",
            "preset": "toy_fig",
            "series": "new",
            "kind": "ratio",
            "miss": {"cause": "unstated", "evidence": "new takes {new:iteration_time_s} s, base {base:iteration_time_s@large} s"},
            "headlines": [
                {"id": "small", "quantity": "speed-up, small", "paper": [1.4, 1.6], "where": "§1", "group": "small"},
                {"id": "large", "quantity": "speed-up, large", "paper": 1.5, "where": "§1", "group": "large"},
                {"id": "up-to", "quantity": "largest speed-up", "paper": {"up_to": 2.0}, "where": "§1", "group": ["small", "large"]},
                {
                    "id": "mfu",
                    "quantity": "MFU",
                    "paper": 0.5,
                    "kind": "mfu",
                    "field": "mfu",
                    "where": "§2",
                    "group": "small",
                    "miss": {"cause": "simulator", "evidence": "ours {new:mfu}"},
                },
            ],
            "claims": [
                {
                    "id": "wins",
                    "claim": "new wins",
                    "where": "§1",
                    "check": {"kind": "highest", "series": "new", "than": ["base"], "groups": ["small", "large"]},
                },
                {
                    "id": "grows",
                    "claim": "the gain shrinks",
                    "where": "§1",
                    "check": {"kind": "decreasing", "series": "new", "groups": ["small", "large"]},
                    "miss": {"cause": "implementation", "evidence": "gain {new:value@small} then {new:value@large}"},
                },
            ],
        },
        {
            "figure": "Fig. 2",
            "preset": "toy_fig",
            "series": "new",
            "kind": "ratio",
            "headlines": [{"id": "bare", "quantity": "a miss nobody explained", "paper": 9.0, "where": "§3", "group": "small"}],
        },
    ],
    "sensitivity": [{"id": "sens", "parameter": "size", "preset": "toy_fig", "headline": "large", "series": "new"}],
}


def setup(tmp_path: Path, version: str | None = None) -> tuple[Path, Path, Path]:
    sweeps, cat, results = tmp_path / "sweeps", tmp_path / "cat", tmp_path / "results"
    for d in (sweeps, cat, results):
        d.mkdir()
    (sweeps / "toy_fig.yaml").write_text(yaml.safe_dump(SWEEP))
    (cat / "toy.yaml").write_text(yaml.safe_dump(CATALOGUE))
    rows = []
    for group, times in TIMES.items():
        for series, t in times.items():
            value = times["base"] / t
            rows.append({"group": group, "series": series, "value": value, "iteration_time_s": t, "mfu": 0.3 * value})
    spec = load_sweep(sweeps / "toy_fig.yaml")
    (results / "toy_fig.json").write_text(json.dumps({"preset_hash": version or preset_hash(spec), "rows": rows}))
    return sweeps, cat, results


def test_scoring_a_catalogue(tmp_path: Path) -> None:
    sweeps, cat, results = setup(tmp_path)
    presets = Presets(sweeps)
    catalogue = load_catalogue("toy", presets, cat)
    figures = {"toy_fig": (presets["toy_fig"], load_results(presets["toy_fig"], results))}
    paper = score(catalogue, figures)
    rows = {r.headline.id: r for r in paper.headlines}
    assert rows["small"].ours == pytest.approx(1.5) and rows["small"].holds  # inside the range
    assert rows["small"].best == pytest.approx(2.4 / 2.0)  # against the best plan
    assert rows["large"].ours == pytest.approx(2.0) and not rows["large"].holds  # 33 % over 1.5
    assert rows["large"].cause == "unstated" and rows["large"].evidence == "new takes 3 s, base 6 s"
    assert rows["up-to"].ours == pytest.approx(2.0) and rows["up-to"].holds and rows["up-to"].note == "largest at large"
    assert rows["mfu"].ours == pytest.approx(0.45) and not rows["mfu"].holds  # 5 points
    assert rows["mfu"].evidence == "ours 0.45"
    assert rows["bare"].cause == NOT_EXPLAINED
    assert paper.held == 2 and paper.misses("unstated") == 1 and paper.misses(NOT_EXPLAINED) == 1
    claims = {c.claim.id: c for c in paper.claims}
    assert claims["wins"].holds is True
    assert claims["grows"].holds is False and claims["grows"].miss == "implementation: gain 1.5 then 2"
    assert [(s.setting, s.holds) for s in paper.settings] == [("small", True), ("large", False)]
    assert not goal_met([paper])
    text = markdown([paper], "results/", "../papers")
    assert "| up-to | Fig. 1 | largest speed-up | up to 2 | §1 | 2 (largest at large) | 1.67 | 1.00 | holds |  |" in text
    assert "| toy | 5 | 2 | 40 % | 1 | 1 | 0 | 0 | 1 | 1 / 2 |" in text
    assert as_json([paper], "results/")["papers"]["toy"]["hold"] == 2


def test_results_of_another_version_of_the_preset_are_refused(tmp_path: Path) -> None:
    sweeps, _, results = setup(tmp_path, version="0123456789abcdef")
    spec = Presets(sweeps)["toy_fig"]
    with pytest.raises(ConfigError, match="written by another version of preset toy_fig \\(fingerprint 0123456789abcdef"):
        load_results(spec, results)
    with pytest.raises(ConfigError, match="no results of figure toy_fig"):
        load_results(spec, tmp_path)
