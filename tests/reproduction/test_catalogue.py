"""The headline catalogue: every paper's file parses and every row resolves to a preset, its
groups, series and fields; every evidence text's numbers come from placeholders that resolve;
every sensitivity sweep matches its rows' figure groups over its declared range. A row that
does not is one line naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from src.errors import ConfigError
from src.reproduction.catalogue import PLACEHOLDER, Presets, load_catalogue, load_ranges, papers_in, typed_numbers
from src.reproduction.results import STORE, load_results, stale
from src.sweep import REPO, load_sweep

SWEEP = {
    "name": "tiny_fig",
    "title": "a tiny figure",
    "source": "a test",
    "metric": "iteration_time_s",
    "normalize": {"by": "base", "invert": True},
    "extra_metrics": ["mfu", "iteration_time_s"],
    "base": ["model=gpt"],
    "series": {"base": ["strategy=ddp"], "base_best": [], "new": ["strategy=megatron"]},
    "groups": [
        {"label": "g1", "overrides": ["train.global_batch=8"], "series_overrides": {"new": ["strategy.tp=2"]}},
        {"label": "g2", "skip": ["base_best"]},
    ],
}
# Sweeps tiny_fig's g1 over new's strategy.tp: 2 is the figure's own, 1 and 4 are run here;
# base does not depend on it, so the sweep skips it and the scorecard reads the figure's.
SENSITIVITY = {
    "name": "tiny_sens",
    "title": "tiny_fig against new's TP",
    "source": "a test",
    "metric": "iteration_time_s",
    "extra_metrics": ["mfu"],
    "base": ["model=gpt"],
    "series": {"base": ["strategy=ddp"], "new": ["strategy=megatron"]},
    "groups": [
        {"label": "g1, tp 1", "overrides": ["train.global_batch=8"], "series_overrides": {"new": ["strategy.tp=1"]}, "skip": ["base"]},
        {"label": "g1, tp 4", "overrides": ["train.global_batch=8"], "series_overrides": {"new": ["strategy.tp=4"]}, "skip": ["base"]},
    ],
}
RANGES = {"ranges": [{"id": "tp", "parameter": "new's TP", "override": "strategy.tp", "values": [1, 2, 4], "source": "a test"}]}
HELDOUT = {"rows": [{"id": "run-1", "error_pct": -12.5}]}


def catalogue(tmp_path: Path, headline: dict, claims: list | None = None, extra: dict | None = None, sweeps: tuple = ()) -> Path:
    (tmp_path / "sweeps").mkdir(exist_ok=True)
    for spec in (SWEEP, SENSITIVITY, *sweeps):
        (tmp_path / "sweeps" / f"{spec['name']}.yaml").write_text(yaml.safe_dump(spec))
    figure = {"figure": "Fig. 1", "preset": "tiny_fig", "series": "new", "kind": "ratio", "headlines": [headline]}
    if claims:
        figure["claims"] = claims
    (tmp_path / "cat").mkdir(exist_ok=True)
    (tmp_path / "cat" / "ranges.yaml").write_text(yaml.safe_dump(RANGES))
    (tmp_path / "heldout.json").write_text(json.dumps(HELDOUT))
    content = {"paper": "toy", "title": "Toy", "text": "toy.txt", "figures": [figure], **(extra or {})}
    (tmp_path / "cat" / "toy.yaml").write_text(yaml.safe_dump(content))
    return tmp_path


def load(tmp_path: Path) -> Any:
    return load_catalogue("toy", Presets(tmp_path / "sweeps"), tmp_path / "cat", root=tmp_path)


ROW = {"id": "r1", "quantity": "speed-up", "paper": 1.5, "where": "§1", "group": "g1"}
UNSTATED = {"cause": "unstated", "sensitivity": "s1", "evidence": "new runs at {new:mfu%} MFU"}
SENSITIVITY_ENTRY = {"sensitivity": [{"id": "s1", "range": "tp", "preset": "tiny_sens"}]}


def test_every_papers_catalogue_resolves_to_its_presets() -> None:
    presets = Presets()
    papers = papers_in()
    assert papers == ["distmm", "disttrain", "optimus", "par4d"]  # ranges.yaml is no paper
    total = 0
    for paper in papers:
        cat = load_catalogue(paper, presets)
        total += len(cat.headlines)
        assert cat.headlines and all(h.where and h.quantity for h in cat.headlines)
        assert all(h.miss for h in cat.headlines)  # a miss after any re-run still has its explanation
        for name in cat.presets():
            assert presets.path(name).is_file()
        unstated = [e for h in cat.headlines for e in h.miss if e.cause == "unstated"]
        assert all(e.sensitivity for e in unstated)  # every unstated cause with its declared range
    assert 150 <= total <= 190


def test_no_evidence_text_of_the_catalogues_states_a_number_of_its_own() -> None:
    for paper in papers_in():
        raw = yaml.safe_load((REPO / "benchmarks" / "reproduction" / f"{paper}.yaml").read_text())
        texts = [
            str(e["evidence"])
            for f in raw["figures"]
            for row in [f, *(f.get("headlines") or []), *(f.get("claims") or [])]
            for e in (row.get("miss") if isinstance(row.get("miss"), list) else [row.get("miss")] if row.get("miss") else [])
        ]
        assert texts and not [t for t in texts if typed_numbers(t)], paper


def test_every_placeholder_of_the_catalogues_resolves_against_the_stored_results() -> None:
    # Stale evidence: a placeholder naming a row or field the current results of its figure do not
    # hold (the loader has checked the presets' groups, series and fields, the measurements and the
    # config values already).
    presets = Presets()
    for paper in papers_in():
        cat = load_catalogue(paper, presets)
        rows = [(h.id, h.locus.preset, h.locus.groups[0], h.miss) for h in cat.headlines]
        rows += [(c.id, c.preset, c.check["groups"][0], c.miss) for c in cat.claims]
        for row_id, preset, group, miss in rows:
            if stale(presets[preset], STORE):
                continue  # a preset added or changed since the last re-run: its rows read "not run"
            results = load_results(presets[preset], STORE)
            for explanation in miss:
                for source, field_name, at in PLACEHOLDER.findall(explanation.evidence):
                    if source.startswith(("measured.", "config.", "paper.")):
                        continue
                    row = results.rows.get((at or group, source))
                    assert row is not None, (paper, row_id, source, at or group)
                    if row.get("value") is not None:
                        results.field(at or group, source, field_name.removesuffix("%"))  # refused where it is gone


def test_typed_numbers_are_found_outside_placeholders_and_names() -> None:
    assert typed_numbers("largest here 4.05 (Perlmutter 1024)") == ["4.05", "1024"]
    assert typed_numbers("{zero3:value@Perlmutter U-Net-4B / 1024} on MLLM-72B, A800, ZeRO-3, Table 5, Fig. 5(c), §8.1") == []
    assert typed_numbers("TP 8 and 1e9") == ["8", "1e9"]


def test_a_row_that_resolves_loads_with_its_figures_defaults(tmp_path: Path) -> None:
    cat = load(catalogue(tmp_path, ROW))
    (headline,) = cat.headlines
    # Evidence may name a degree of a row's plan, which every row of a figure's results holds.
    plan = {"cause": "implementation", "evidence": "TP {base:plan.llm.tp}, micro-batch {new:plan.llm.micro_batch}"}
    assert load(catalogue(tmp_path, {**ROW, "miss": plan})).headlines[0].miss[0].evidence.startswith("TP {base:plan.llm.tp}")
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
        ({"over_field": "mfu"}, "over_field 'mfu' needs 'over'"),
        ({"kind": "speed"}, "kind 'speed' is not one of"),
        ({"series": "base_best", "group": "g2"}, "does not run base_best in ['g2']"),
        ({"group": ["g1", "g2"]}, "several groups go with an extreme"),
        ({"miss": {"cause": "luck", "evidence": "x"}}, "cause 'luck' is not one of"),
        ({"miss": {"cause": "implementation", "evidence": "{ghost:value}"}}, "evidence names series 'ghost'"),
        ({"miss": {"cause": "implementation", "evidence": "{base:hfu}"}}, "have no field 'hfu'"),
        ({"miss": {"cause": "implementation", "evidence": "{base:plan.tp}"}}, "have no field 'plan.tp'"),
        ({"miss": {"cause": "implementation", "evidence": "{base_best:value@g2}"}}, "where preset tiny_fig does not run it"),
        ({"miss": {"cause": "implementation", "evidence": "ours cites 4.05 here"}}, "evidence states ['4.05'] outside a placeholder"),
        ({"miss": {"cause": "implementation", "evidence": "{config.new:train.seq_len}"}}, "sets no train.seq_len"),
        ({"miss": {"cause": "simulator", "evidence": "ours"}}, "names a measurement where the simulator errs"),
        ({"miss": {"cause": "unstated", "evidence": "ours"}}, "names the sensitivity sweeps"),
        ({"miss": [{"cause": "implementation", "evidence": "a"}, UNSTATED]}, "an unstated cause comes first"),
        ({"miss": {"cause": "not explained", "when": "sideways", "evidence": "x"}}, "when is 'above' or 'below'"),
        ({"paper": [2, 1]}, "paper value [2, 1]"),
    ],
)
def test_a_row_that_does_not_resolve_is_one_line_naming_it(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="toy.yaml, headline 'r1'") as err:
        load(catalogue(tmp_path, {**ROW, **change}))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("measured", "evidence", "message"),
    [
        ({"held": {"file": "heldout.json", "row": {"id": "run-1"}}}, "{measured.held:error_pct} %", ""),
        ({"held": {"file": "heldout.json", "row": {"id": "run-2"}}}, "{measured.held:error_pct} %", "has 0 rows with {'id': 'run-2'}"),
        ({"held": {"file": "heldout.json", "row": {"id": "run-1"}}}, "{measured.held:mape_pct} %", "has no field 'mape_pct'"),
        ({"held": {"file": "heldout.json", "row": {"id": "run-1"}}}, "{measured.other:error_pct}", "names measurement 'other'"),
        ({"held": {"file": "gone.json", "row": {"id": "run-1"}}}, "{measured.held:error_pct}", "gone.json does not exist"),
    ],
)
def test_a_simulator_cause_names_a_measurement_that_resolves(tmp_path: Path, measured: dict, evidence: str, message: str) -> None:
    errs = [[f"measured.{next(iter(measured))}:error_pct", 0]]
    row = {**ROW, "miss": {"cause": "simulator", "measured": measured, "errs": errs, "evidence": evidence}}
    if not message:
        (headline,) = load(catalogue(tmp_path, row)).headlines
        assert headline.miss[0].measured["held"].row == {"id": "run-1"}
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(catalogue(tmp_path, row))


HELD = {"held": {"file": "heldout.json", "row": {"id": "run-1"}}}


@pytest.mark.parametrize(
    ("cause", "errs", "message"),
    [
        ("simulator", None, "a simulator cause says what in its measurements errs its way (errs)"),
        ("implementation", [["measured.held:error_pct", 0]], "and only it does"),
        ("simulator", [["measured.held:error_pct"]], "errs is a list of [a, b] pairs"),
        ("simulator", [["measured.other:error_pct", 0]], "an errs term is a number or measured.NAME:field"),
        ("simulator", [["measured.held:mape_pct", 0]], "has no field 'mape_pct'"),
    ],
)
def test_a_simulator_cause_says_how_its_measurement_errs(tmp_path: Path, cause: str, errs: list | None, message: str) -> None:
    miss = {"cause": cause, "measured": HELD, "evidence": "ours"} | ({"errs": errs} if errs is not None else {})
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(catalogue(tmp_path, {**ROW, "miss": miss}))


def test_a_sensitivity_matches_each_value_of_its_range_to_a_group(tmp_path: Path) -> None:
    cat = load(catalogue(tmp_path, {**ROW, "miss": [UNSTATED]}, extra=SENSITIVITY_ENTRY))
    match = cat.sensitivities["s1"].matches["r1"]
    sens = "tiny_sens"
    assert match.settings["g1"] == (
        {"new": (sens, "g1, tp 1"), "base": ("tiny_fig", "g1")},  # base skipped there: read from the figure
        {"new": ("tiny_fig", "g1"), "base": ("tiny_fig", "g1")},  # 2: the figure's own setting
        {"new": (sens, "g1, tp 4"), "base": ("tiny_fig", "g1")},
    )
    # the figure normalises by base, the sweep does not: the figure's 'value' is built from each preset's
    # iteration time (the figure's its extra metric, the sweep's its own 'value'), normalised as the figure's
    assert (match.raw, match.normalize) == ({"tiny_sens": "value", "tiny_fig": "iteration_time_s"}, SWEEP["normalize"])


def _both_spellings(label: str, new_tp: int, base_tp: int) -> dict:
    return {
        "label": label,
        "overrides": ["train.global_batch=8"],
        "series_overrides": {"new": [f"strategy.tp={new_tp}"], "base": [f"strategy.llm.tp={base_tp}"]},
    }


def test_a_range_spelled_per_strategy_is_set_alike_on_every_series(tmp_path: Path) -> None:
    # One parameter under two Hydra keys (a Megatron-LM baseline's strategy.recompute, Optimus's
    # strategy.llm.recompute): a group matches where every series sets it to one value, whichever key.
    both = {"ranges": [{**RANGES["ranges"][0], "override": ["strategy.tp", "strategy.llm.tp"]}]}
    groups = [_both_spellings("g1, tp 1", 1, 1), _both_spellings("g1, tp 4", 4, 4)]
    catalogue(tmp_path, {**ROW, "miss": [UNSTATED]}, extra=SENSITIVITY_ENTRY, sweeps=(_with_sensitivity(groups=groups),))
    (tmp_path / "cat" / "ranges.yaml").write_text(yaml.safe_dump(both))
    cat = load(tmp_path)
    assert cat.sensitivities["s1"].range.keys == ("strategy.tp", "strategy.llm.tp")
    assert cat.sensitivities["s1"].matches["r1"].settings["g1"] == (
        {"new": ("tiny_sens", "g1, tp 1"), "base": ("tiny_sens", "g1, tp 1")},
        {"new": ("tiny_fig", "g1"), "base": ("tiny_fig", "g1")},
        {"new": ("tiny_sens", "g1, tp 4"), "base": ("tiny_sens", "g1, tp 4")},
    )
    # the series set apart: the group is no setting of the range, and 4 is missing
    mixed = [_both_spellings("g1, tp 1", 1, 1), _both_spellings("g1, tp 4", 4, 1)]
    catalogue(tmp_path, {**ROW, "miss": [UNSTATED]}, extra=SENSITIVITY_ENTRY, sweeps=(_with_sensitivity(groups=mixed),))
    (tmp_path / "cat" / "ranges.yaml").write_text(yaml.safe_dump(both))
    with pytest.raises(ConfigError, match=re.escape("set strategy.tp / strategy.llm.tp to ['1', '2'], range tp declares")):
        load(tmp_path)
    bad = {"ranges": [{**RANGES["ranges"][0], "override": ["strategy.tp", "strategy.tp"]}]}
    (tmp_path / "cat" / "ranges.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="override must be a Hydra key or a list of distinct ones"):
        load(tmp_path)


def _with_sensitivity(**change: Any) -> dict:
    return {**SENSITIVITY, **change}


def _group(label: str, tp: int, *extra: str, skip: tuple[str, ...] = ("base",)) -> dict:
    return {
        "label": label,
        "overrides": ["train.global_batch=8", *extra],
        "series_overrides": {"new": [f"strategy.tp={tp}"]},
        "skip": list(skip),
    }


@pytest.mark.parametrize(
    ("sensitivity", "ranges", "message"),
    [
        # a group's job differs from the figure's in more than the parameter: it matches nothing, 4 is missing
        (
            _with_sensitivity(groups=[_group("a", 1), _group("b", 4, "train.seq_len=64")]),
            None,
            "set strategy.tp to ['1', '2'], range tp declares ['1', '2', '4']",
        ),
        # a series the figure runs otherwise
        (
            _with_sensitivity(series={"base": ["strategy=ddp"], "new": ["strategy=megatron", "strategy.pp=2"]}),
            None,
            "set strategy.tp to ['2'], range tp declares ['1', '2', '4']; nearest, 'g1, tp 1': new strategy.pp=2 (figure: (unset))",
        ),
        # the skipped series would not run as the figure's does
        (
            _with_sensitivity(series={"base": ["strategy=ddp", "strategy.zero_stage=1"], "new": ["strategy=megatron"]}),
            None,
            "set strategy.tp to ['2']",
        ),
        # two groups at the same setting
        (_with_sensitivity(groups=[_group("a", 1), _group("b", 1)]), None, "matches 'g1' twice"),
        (
            SENSITIVITY,
            {"ranges": [{"id": "tp", "parameter": "p", "override": "strategy.tp", "values": [1], "source": "s"}]},
            "values must list at least two settings",
        ),
        (
            SENSITIVITY,
            {"ranges": [{"id": "tp", "parameter": "p", "override": "strategy.tp", "values": [1, 2, 4], "source": " "}]},
            "a range needs its source",
        ),
        (SENSITIVITY, {"ranges": []}, "no range 'tp' in ranges.yaml"),
    ],
)
def test_a_sensitivity_that_does_not_match_its_range_is_refused(
    tmp_path: Path, sensitivity: dict, ranges: dict | None, message: str
) -> None:
    catalogue(tmp_path, {**ROW, "miss": [UNSTATED]}, extra=SENSITIVITY_ENTRY, sweeps=(sensitivity,))
    if ranges is not None:
        (tmp_path / "cat" / "ranges.yaml").write_text(yaml.safe_dump(ranges))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(tmp_path)


def test_a_sensitivity_must_be_declared_and_used(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'r1': no sensitivity 's1'"):
        load(catalogue(tmp_path, {**ROW, "miss": [UNSTATED]}))
    with pytest.raises(ConfigError, match="sensitivity 's1': no row names it"):
        load(catalogue(tmp_path, ROW, extra=SENSITIVITY_ENTRY))


def test_the_ranges_of_the_repository_state_their_sources() -> None:
    ranges = load_ranges()
    assert ranges and all(r.source and len(r.values) >= 2 for r in ranges.values())
    for sweep in (REPO / "sweeps").glob("*sensitivity.yaml"):
        load_sweep(sweep)  # every sensitivity preset loads


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


# Par4D's §I (line 27) and §VII-C (line 299): on Perlmutter's weak-scaling runs, Table III's runs,
# Par4D is "25-45%" faster than Megatron-LM and "32-50%" faster than DeepSpeed-3D.
PAR4D_STATED = {"megatron": (25.0, 45.0), "deepspeed3d": (32.0, 50.0)}


def test_par4d_s_percent_improvements_are_read_as_its_table_iii_gives_them() -> None:
    """Table III's utilisations are one FLOP count over each system's batch time, so they give
    the time Par4D saves on each run: within the paper's rounding of §I's ranges as a share of
    the baseline's time, far outside them as 1 + X/100; the catalogue reads every "by X %" so."""
    table = load_sweep(REPO / "sweeps" / "par4d_table3.yaml")
    headlines = {h.id: h.value for h in load_catalogue("par4d", Presets()).headlines}
    for series, (low, high) in PAR4D_STATED.items():
        utilisation = [(group["paper"][series], group["paper"]["par4d"]) for group in table.groups]
        saved = [100 * (1 - theirs / ours) for theirs, ours in utilisation]
        assert low - 1.5 <= min(saved) and max(saved) <= high + 1.5, saved
        assert max(100 * (ours / theirs - 1) for theirs, ours in utilisation) > high + 30
        short = {"megatron": "megatron", "deepspeed3d": "ds3d"}[series]
        ranges = {(v.low, v.high) for key, v in headlines.items() if key.startswith(f"f11-{short}-p")}
        assert ranges == {(round(100 / (100 - low), 3), round(100 / (100 - high), 3))}
