"""python -m src.reproduce: the scorecard from stored figure results, one small figure re-run
end to end, figures without current results named and their rows not run, and bad input as
one line with exit 2."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from src.reproduce import main
from src.reproduction.catalogue import Presets, load_catalogue, papers_in
from src.reproduction.results import STORE, stale
from src.sweep import load_sweep, preset_hash
from tests.test_sweep import TINY_GPT as SWEEP_TINY_GPT

TINY_GPT = [*SWEEP_TINY_GPT, "strategy.pp=1", "strategy.micro_batch_size=2"]
SWEEP = {
    "name": "tiny_tp",
    "title": "tiny: TP 2 against TP 1",
    "source": "a test",
    "metric": "iteration_time_s",
    "metric_label": "speed-up over TP 1 (x)",
    "normalize": {"by": "tp1", "invert": True},
    "extra_metrics": ["iteration_time_s"],
    "base": TINY_GPT,
    "series": {"tp1": ["strategy.tp=1"], "tp2": ["strategy.tp=2"]},
    "groups": [{"label": "8 GPUs"}],
}
CATALOGUE = {
    "paper": "tiny",
    "title": "A tiny paper",
    "text": "tiny.txt",
    "figures": [
        {
            "figure": "Fig. 1",
            "preset": "tiny_tp",
            "series": "tp2",
            "kind": "ratio",
            "miss": {"cause": "implementation", "evidence": "TP two takes {tp2:iteration_time_s} s"},
            "headlines": [
                {"id": "holds", "quantity": "TP 2 over TP 1", "paper": [0.01, 100.0], "where": "§1", "group": "8 GPUs"},
                {"id": "misses", "quantity": "TP 2 over TP 1", "paper": 1000.0, "where": "§1", "group": "8 GPUs"},
            ],
        }
    ],
}


def layout(tmp_path: Path, sweep: dict = SWEEP, catalogue: dict = CATALOGUE) -> dict[str, Path]:
    dirs = {name: tmp_path / name for name in ("sweeps", "catalogue", "results", "out")}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    (dirs["sweeps"] / f"{sweep['name']}.yaml").write_text(yaml.safe_dump(sweep))
    (dirs["catalogue"] / f"{catalogue['paper']}.yaml").write_text(yaml.safe_dump(catalogue))
    return dirs


def args(dirs: dict[str, Path], *extra: str) -> list[str]:
    return [*extra, *(arg for name, path in dirs.items() for arg in (f"--{name}", str(path)))]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_the_stored_results_score_every_paper_within_ten_seconds(tmp_path: Path) -> None:
    start = time.perf_counter()
    assert main(["--out", str(tmp_path)]) == 0
    assert time.perf_counter() - start < 10
    scorecard = json.loads((tmp_path / "reproduction.json").read_text())
    assert sorted(scorecard["papers"]) == ["distmm", "disttrain", "optimus", "par4d"]
    rows = [row for paper in scorecard["papers"].values() for row in paper["rows"]]
    assert {row["status"] for row in rows} <= {"holds", "consistent", "misses", "not run"}
    assert all(row["cause"] and row["evidence"] for row in rows if row["status"] in ("misses", "consistent"))
    # a row reads 'not run' only where a figure it needs has no current results (a preset added or
    # changed since the figures were last re-run), and the scorecard says which
    not_run = [row for row in rows if row["status"] == "not run"]
    assert all(
        row["preset"] in scorecard["not_current"] or "not judged" in row["note"] or row["note"].startswith("not run")
        for row in not_run
    )
    assert (tmp_path / "reproduction.md").read_text().startswith("# Reproduction scorecard")
    assert (tmp_path / "reproduction.png").stat().st_size > 10_000


def test_the_committed_store_holds_current_results_of_every_preset_the_catalogue_names() -> None:
    """A sweep changed without its figure re-run leaves the scorecard's rows 'not run': the
    committed store must hold what the committed presets give (python -m src.reproduce --rerun)."""
    presets = Presets()
    names = {name for paper in papers_in() for name in load_catalogue(paper, presets).presets()}
    assert {name: why for name in sorted(names) if (why := stale(presets[name], STORE))} == {}


def test_rerun_stale_runs_nothing_where_every_figure_is_current(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["paper=distmm", "--rerun-stale", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "none re-run" in printed and "re-running" not in printed
    assert (tmp_path / "reproduction_distmm.json").is_file()


def test_rerun_and_rerun_stale_are_refused_together(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--rerun", "--rerun-stale"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_an_unknown_paper_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["paper=distrain"]) == 2
    assert "unknown selection 'paper=distrain'" in one_error_line(capsys)


def test_a_row_naming_a_missing_field_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    catalogue = json.loads(json.dumps(CATALOGUE))
    catalogue["figures"][0]["headlines"][0]["field"] = "mfu"
    assert main(args(layout(tmp_path, catalogue=catalogue))) == 2
    assert "tiny.yaml, headline 'holds': preset tiny_tp's results have no field 'mfu'" in one_error_line(capsys)


def test_results_of_another_version_of_the_preset_leave_its_rows_not_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = layout(tmp_path)
    (dirs["results"] / "tiny_tp.json").write_text(json.dumps({"preset_hash": "0" * 16, "rows": []}))
    assert main(args(dirs, "paper=tiny")) == 0
    assert "no current results of tiny_tp (results of another version of the preset)" in capsys.readouterr().err
    scorecard = json.loads((dirs["out"] / "reproduction_tiny.json").read_text())
    assert scorecard["not_current"] == {"tiny_tp": "results of another version of the preset"}
    paper = scorecard["papers"]["tiny"]
    assert {row["status"] for row in paper["rows"]} == {"not run"} and paper["not_run"] == 2 and paper["hold"] == 0
    assert "**Not current**: `tiny_tp`" in (dirs["out"] / "reproduction_tiny.md").read_text()  # nothing that looks complete


def test_unreadable_results_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = layout(tmp_path)
    (dirs["results"] / "tiny_tp.json").write_text("{not json")
    assert main(args(dirs)) == 2
    assert "tiny_tp.json is not JSON" in one_error_line(capsys)
    assert not (dirs["out"] / "reproduction.md").exists()


def test_the_scorecard_cites_the_paper_s_text_where_papers_says_and_refuses_a_folder_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = layout(tmp_path)
    (dirs["results"] / "tiny_tp.json").write_text(json.dumps({"preset_hash": "0" * 16, "rows": []}))
    assert main(args(dirs, "paper=tiny")) == 0
    assert "Paper text: `tiny.txt`." in (dirs["out"] / "reproduction_tiny.md").read_text()
    capsys.readouterr()  # the note that the figure has no current results
    papers = tmp_path / "papers"
    papers.mkdir()
    assert main(args(dirs, "paper=tiny", "--papers", str(papers))) == 2
    assert f"--papers {papers}: no tiny.txt there" in one_error_line(capsys)
    (papers / "tiny.txt").write_text("A tiny paper.")
    assert main(args(dirs, "paper=tiny", "--papers", str(papers))) == 0
    assert f"Paper text: `{papers}/tiny.txt`." in (dirs["out"] / "reproduction_tiny.md").read_text()


@pytest.mark.slow
def test_one_small_figure_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = layout(tmp_path)
    assert main(args(dirs, "paper=tiny", "--rerun", "--jobs", "1")) == 0
    printed = capsys.readouterr().out
    assert "[1/1] tiny_tp: " in printed and "ok" in printed
    stored = json.loads((dirs["results"] / "tiny_tp.json").read_text())
    assert stored["preset_hash"] == preset_hash(load_sweep(dirs["sweeps"] / "tiny_tp.yaml"))
    scorecard = json.loads((dirs["out"] / "reproduction_tiny.json").read_text())["papers"]["tiny"]
    rows = {row["id"]: row for row in scorecard["rows"]}
    ours = next(r["value"] for r in stored["rows"] if r["series"] == "tp2")
    assert rows["holds"]["ours"] == ours and rows["holds"]["holds"]
    assert not rows["misses"]["holds"] and rows["misses"]["cause"] == "implementation"
    assert rows["misses"]["evidence"].startswith("TP two takes ") and scorecard["hold"] == 1
    # from the stored results alone, without --rerun, the same scorecard
    assert main(args(dirs, "paper=tiny")) == 0
    assert json.loads((dirs["out"] / "reproduction_tiny.json").read_text())["papers"]["tiny"]["rows"] == scorecard["rows"]
    # --rerun-stale re-runs a figure whose stored results are gone, and only it
    (dirs["results"] / "tiny_tp.json").unlink()
    capsys.readouterr()
    assert main(args(dirs, "paper=tiny", "--rerun-stale", "--jobs", "1")) == 0
    assert "re-running 1 figures" in capsys.readouterr().out
    assert json.loads((dirs["results"] / "tiny_tp.json").read_text())["preset_hash"] == stored["preset_hash"]
