"""The headline catalogue: every paper's file parses and every row resolves to a preset, its
groups, series and fields; a row that does not is one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from src.errors import ConfigError
from src.reproduction.catalogue import Presets, load_catalogue, papers_in

SWEEP = {
    "name": "tiny_fig",
    "title": "a tiny figure",
    "source": "a test",
    "metric": "iteration_time_s",
    "normalize": {"by": "base", "invert": True},
    "extra_metrics": ["mfu"],
    "base": [],
    "series": {"base": [], "base_best": [], "new": []},
    "groups": [{"label": "g1"}, {"label": "g2", "skip": ["base_best"]}],
}


def catalogue(tmp_path: Path, headline: dict, claims: list | None = None) -> Path:
    (tmp_path / "sweeps").mkdir(exist_ok=True)
    (tmp_path / "sweeps" / "tiny_fig.yaml").write_text(yaml.safe_dump(SWEEP))
    figure = {"figure": "Fig. 1", "preset": "tiny_fig", "series": "new", "kind": "ratio", "headlines": [headline]}
    if claims:
        figure["claims"] = claims
    (tmp_path / "cat").mkdir(exist_ok=True)
    (tmp_path / "cat" / "toy.yaml").write_text(
        yaml.safe_dump({"paper": "toy", "title": "Toy", "text": "toy.txt", "figures": [figure]})
    )
    return tmp_path


def load(tmp_path: Path):
    return load_catalogue("toy", Presets(tmp_path / "sweeps"), tmp_path / "cat")


ROW = {"id": "r1", "quantity": "speed-up", "paper": 1.5, "where": "§1", "group": "g1"}


def test_every_papers_catalogue_resolves_to_its_presets() -> None:
    presets = Presets()
    papers = papers_in()
    assert papers == ["distmm", "disttrain", "optimus", "par4d"]
    total = 0
    for paper in papers:
        cat = load_catalogue(paper, presets)
        total += len(cat.headlines)
        assert cat.headlines and all(h.where and h.quantity for h in cat.headlines)
        assert all(h.miss is not None for h in cat.headlines)  # a miss after any re-run still has its cause
        for name in cat.presets():
            assert presets.path(name).is_file()
    assert 140 <= total <= 180  # issue 25: about 160 numbers


def test_a_row_that_resolves_loads_with_its_figures_defaults(tmp_path: Path) -> None:
    cat = load(catalogue(tmp_path, ROW))
    (headline,) = cat.headlines
    assert (headline.locus.preset, headline.locus.series, headline.locus.field, headline.kind) == ("tiny_fig", "new", "value", "ratio")
    assert cat.presets() == ["tiny_fig"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"preset": "nope"}, "no preset 'nope'"),
        ({"group": "g9"}, "has no group 'g9'"),
        ({"series": "old"}, "has no series 'old'"),
        ({"field": "hfu"}, "have no field 'hfu'"),
        ({"over": "other"}, "has no series 'other'"),
        ({"kind": "speed"}, "kind 'speed' is not one of"),
        ({"series": "base_best", "group": "g2"}, "does not run base_best in ['g2']"),
        ({"group": ["g1", "g2"]}, "several groups go with an extreme"),
        ({"miss": {"cause": "luck", "evidence": "x"}}, "cause 'luck' is not one of"),
        ({"miss": {"cause": "simulator", "evidence": "{ghost:value}"}}, "evidence names series 'ghost'"),
        ({"miss": {"cause": "simulator", "evidence": "{base:hfu}"}}, "have no field 'hfu'"),
        ({"paper": [2, 1]}, "paper value [2, 1]"),
    ],
)
def test_a_row_that_does_not_resolve_is_one_line_naming_it(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="toy.yaml, headline 'r1'") as err:
        load(catalogue(tmp_path, {**ROW, **change}))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_claim_that_does_not_resolve_is_refused(tmp_path: Path) -> None:
    claim = {
        "id": "c1",
        "claim": "new wins",
        "where": "§1",
        "check": {"kind": "highest", "series": "new", "than": ["x"], "groups": ["g1"]},
    }
    with pytest.raises(ConfigError, match="claim 'c1': preset tiny_fig has no series 'x'"):
        load(catalogue(tmp_path, ROW, [claim]))


def test_repeated_ids_are_refused(tmp_path: Path) -> None:
    claim = {
        "id": "r1",
        "claim": "new wins",
        "where": "§1",
        "check": {"kind": "highest", "series": "new", "than": ["base"], "groups": ["g1"]},
    }
    with pytest.raises(ConfigError, match=r"ids \['r1'\] appear more than once"):
        load(catalogue(tmp_path, ROW, [claim]))
