"""A figure as a Hydra multirun: every (group, series) one job, the paper's values beside
ours, a failing job recorded while the others go on, an interrupted figure resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from src.sweep import main

TINY_GPT = [
    "model=gpt",
    "model.preset=null",
    "model.layers=2",
    "model.hidden=256",
    "model.heads=4",
    "model.vocab=1000",
    "train.seq_len=128",
    "cluster=perlmutter",
    "cluster.nodes=2",
    "logger=none",
    "train.global_batch=16",
    "strategy.recompute=none",
    "strategy.zero_stage=0",
]


@pytest.mark.slow
def test_sweep_writes_table_plot_and_normalised_values(tmp_path: Path) -> None:
    sweep = {
        "name": "tiny",
        "title": "tiny sweep",
        "source": "a test",
        "metric": "iteration_time_s",
        "metric_label": "speed-up over tp1",
        "normalize": {"by": "tp1", "invert": True},
        "base": TINY_GPT,
        "series": {"tp1": ["strategy.tp=1", "strategy.pp=1"], "tp2": ["strategy.tp=2", "strategy.pp=1"]},
        "groups": [
            {"label": "mb1", "overrides": ["strategy.micro_batch_size=1"], "paper": {"tp2": 1.5}},
            {"label": "mb2", "overrides": ["strategy.micro_batch_size=2"], "paper": {"tp2": [0.5, 0.9]}},
            {"label": "bad", "overrides": ["strategy.micro_batch_size=3"]},
        ],
        "notes": "why these settings",
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    rows = {(r["group"], r["series"]): r for r in results["rows"]}
    assert rows[("mb1", "tp1")]["value"] == 1.0  # the baseline against itself
    summaries = {s: json.loads((out / f"{i:02d}_{s}" / "summary.json").read_text()) for i, s in enumerate(("tp1", "tp2"))}
    assert rows[("mb1", "tp2")]["value"] == summaries["tp1"]["iteration_time_s"] / summaries["tp2"]["iteration_time_s"]
    assert rows[("bad", "tp2")]["value"] is None and "micro-batch" in rows[("bad", "tp2")]["error"]
    table = (out / "results.md").read_text()
    assert "| mb1 | tp2 |" in table and "| 1.5 |" in table and "0.5–0.9" in table and "not run:" in table
    assert "why these settings" in table
    assert (out / "tiny.png").stat().st_size > 1000


@pytest.mark.slow
def test_a_figure_resumes_skipping_the_jobs_that_have_a_summary(tmp_path: Path) -> None:
    sweep = {
        "name": "resume",
        "title": "resume",
        "source": "a test",
        "metric": "iteration_time_s",
        "base": TINY_GPT + ["strategy.tp=1", "strategy.pp=1"],
        "series": {"mb1": ["strategy.micro_batch_size=1"], "mb2": ["strategy.micro_batch_size=2"]},
        "groups": [{"label": "g", "overrides": []}],
    }
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out)]) == 0
    first = (out / "00_mb1" / "summary.json").stat().st_mtime_ns
    (out / "01_mb2" / "summary.json").unlink()  # as if interrupted before the second job finished
    assert main([str(path), "--out", str(out)]) == 0
    assert (out / "00_mb1" / "summary.json").stat().st_mtime_ns == first  # not run again
    assert (out / "01_mb2" / "summary.json").exists()
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert all(row["value"] > 0 for row in rows)


def test_plan_column_gives_par4d_its_grid_and_others_their_degrees() -> None:
    from src.sweep import plan_facts, plan_text

    par4d = {"dp": 1, "tp": 1, "pp": 1, "grid": "(1,1,64,1)", "micro_batch": 128, "zero_stage": 0}
    assert plan_facts(par4d) == {"grid": "(1,1,64,1)", "micro_batch": 128}
    megatron = {"dp": 2, "tp": 4, "pp": 8, "micro_batch": 4, "zero_stage": 1}
    assert plan_facts(megatron) == {"dp": 2, "tp": 4, "pp": 8, "micro_batch": 4}
    assert plan_text({"llm": plan_facts(par4d)}) == "llm: grid(1,1,64,1) micro_batch128"


def test_figure_diff_gives_before_after_change_and_paper(tmp_path) -> None:
    import json

    from src.figure_diff import figure_table

    def results(value: float | None) -> dict:
        return {
            "metric": "speedup",
            "rows": [
                {"group": "g", "series": "distmm", "value": value, "paper": [1.2, 1.4]},
                {"group": "g", "series": "megatron", "value": 1.0, "paper": None},
            ],
        }

    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps(results(1.0)))
    after.write_text(json.dumps(results(1.25)))
    text = figure_table("fig", before, after)
    assert "| g | distmm | 1 | 1.25 | +25.0% | 1.2–1.4 |" in text
    assert "| g | megatron | 1 | 1 | +0.0% | – |" in text


def test_figure_diff_reads_stored_figures_beside_multirun_directories(tmp_path, monkeypatch, capsys) -> None:
    import json

    from src import figure_diff

    def results(value: float) -> str:
        return json.dumps({"metric": "mfu", "rows": [{"group": "g", "series": "s", "value": value, "paper": None}]})

    before, after = tmp_path / "before", tmp_path / "after"
    (before / "fig_b").mkdir(parents=True)
    (after / "fig_b").mkdir(parents=True)
    (before / "fig_a.json").write_text(results(0.4))  # as benchmarks/results/figures stores them
    (after / "fig_a.json").write_text(results(0.5))
    (before / "fig_b" / "results.json").write_text(results(2.0))  # as a multirun writes them
    (after / "fig_b" / "results.json").write_text(results(1.0))
    (after / "notes.json").write_text(json.dumps({"not": "a figure"}))
    monkeypatch.setattr("sys.argv", ["figure_diff", str(before), str(after)])
    figure_diff.main()
    out = capsys.readouterr().out
    assert "| g | s | 0.4 | 0.5 | +25.0% | – |" in out and "| g | s | 2 | 1 | -50.0% | – |" in out
    assert "notes" not in out


def test_figure_diff_changed_keeps_the_rows_that_moved_and_names_the_figures_that_did_not(tmp_path, monkeypatch, capsys) -> None:
    import json

    from src import figure_diff

    def results(*values: float | None) -> str:
        rows = [{"group": "g", "series": f"s{i}", "value": v, "paper": None} for i, v in enumerate(values)]
        return json.dumps({"metric": "mfu", "rows": rows})

    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    (before / "moved.json").write_text(results(1.0, 2.0, 3.0, None))
    (after / "moved.json").write_text(results(1.0, 2.0004, 3.3, 4.0))  # 0.02 % is not a move; none -> 4 is
    (before / "still.json").write_text(results(5.0))
    (after / "still.json").write_text(results(5.0))
    monkeypatch.setattr("sys.argv", ["figure_diff", str(before), str(after), "--changed"])
    figure_diff.main()
    out = capsys.readouterr().out
    assert "| g | s2 | 3 | 3.3 | +10.0% | – |" in out and "| g | s3 | – | 4 | – | – |" in out
    assert "| g | s0 |" not in out and "| g | s1 |" not in out
    assert "## still" not in out and out.rstrip().endswith("Unchanged: still")


def test_fastest_of_runs_every_variant_and_keeps_the_fastest_skip_runs_none(tmp_path: Path) -> None:
    from src.sweep import figure_jobs, load_sweep, preset_hash, write_report

    sweep = {
        "name": "variants",
        "title": "variants",
        "source": "a test",
        "metric": "iteration_time_s",
        "normalize": {"by": "base", "invert": True},
        "base": ["model=gpt"],
        "series": {
            "base": ["strategy=ddp"],
            "pp": {"overrides": ["strategy=megatron"], "fastest_of": [["strategy.pp=2"], ["strategy.pp=4"]]},
        },
        "labels": {"pp": "Megatron-LM, PP > 1"},
        "groups": [{"label": "g"}, {"label": "h", "skip": ["pp"]}],
    }
    path = tmp_path / "variants.yaml"
    path.write_text(yaml.safe_dump(sweep))
    spec = load_sweep(path)
    jobs = figure_jobs(spec)
    assert [(j.group, j.series, j.variant, j.subdir) for j in jobs] == [
        ("g", "base", None, "00_base"),
        ("g", "pp", 0, "01_pp_0"),
        ("g", "pp", 1, "02_pp_1"),
        ("h", "base", None, "03_base"),
    ]
    assert jobs[2].overrides == ("model=gpt", "strategy=megatron", "strategy.pp=4")

    def summary(seconds: float) -> dict:
        return {"iteration_time_s": seconds, "plan": {"units": {"llm": {"dp": 1, "tp": 1, "pp": 1, "micro_batch": 1}}}}

    outcomes = {jobs[0].key: summary(6.0), jobs[1].key: summary(4.0), jobs[2].key: summary(3.0), jobs[3].key: summary(5.0)}
    table = write_report(spec, outcomes, tmp_path / "out")
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {(r["group"], r["series"]): r for r in results["rows"]}
    assert rows[("g", "pp")]["value"] == 2.0 and rows[("g", "pp")]["variant"] == ["strategy.pp=4"]  # the faster variant
    assert ("h", "pp") not in rows and results["preset_hash"] == preset_hash(spec)
    assert "| g | Megatron-LM, PP > 1 | 2 |" in table and "fastest of its variants: strategy.pp=4" in table
    outcomes[jobs[2].key] = {"error": "does not fit"}  # a variant that fails leaves the other
    write_report(spec, outcomes, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "results.json").read_text())["rows"][1]["value"] == 1.5
    sweep["groups"][0]["overrides"] = ["model.layers=2"]  # another version of the preset
    path.write_text(yaml.safe_dump(sweep))
    assert preset_hash(load_sweep(path)) != results["preset_hash"]


def test_the_fingerprint_follows_the_cluster_presets_values_not_their_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Results priced on a preset whose constants (or measured tables) changed are another
    version; its sources' wording, or a preset no job runs on, is not."""
    import shutil

    from src import cluster_inputs
    from src.sweep import load_sweep, preset_hash

    clusters = tmp_path / "conf" / "cluster"
    shutil.copytree(cluster_inputs.CLUSTERS, clusters)
    shutil.copy(cluster_inputs.CLUSTERS.parent / "config.yaml", clusters.parent / "config.yaml")
    monkeypatch.setattr(cluster_inputs, "CLUSTERS", clusters)
    sweep = {
        "name": "fp",
        "title": "fp",
        "source": "a test",
        "metric": "iteration_time_s",
        "base": ["model=gpt"],
        "series": {"a": ["cluster=perlmutter"], "b": []},
        "groups": [{"label": "g"}],
    }
    path = tmp_path / "fp.yaml"
    path.write_text(yaml.safe_dump(sweep))

    def fingerprint() -> str:
        cluster_inputs._values.cache_clear()
        return preset_hash(load_sweep(path))

    def edit(name: str, old: str, new: str) -> None:
        file = clusters / name
        assert old in file.read_text()
        file.write_text(file.read_text().replace(old, new, 1))

    first = fingerprint()
    edit("perlmutter.yaml", 'kernel_overhead_s: "RRZE', 'kernel_overhead_s: "Reworded: RRZE')
    edit("hopper.yaml", "kernel_overhead_s: 1.2e-6", "kernel_overhead_s: 9.9e-6")  # no job runs on hopper
    assert fingerprint() == first
    edit("p3_16xlarge.yaml", "kernel_overhead_s: 1.2e-6", "kernel_overhead_s: 9.9e-6")  # series b: the default cluster
    second = fingerprint()
    assert second != first
    edit("measured/perlmutter_nccl.yaml", "16: [0.222,", "16: [0.223,")  # a measured table perlmutter names
    assert fingerprint() not in (first, second)


def test_timed_repeats_take_the_least_running_time_and_refuse_repeats_that_disagree(tmp_path: Path) -> None:
    from src.errors import ConfigError
    from src.sweep import figure_jobs, load_sweep, write_report

    sweep = {
        "name": "timed",
        "title": "timed",
        "source": "a test",
        "metric": "plan.search.solve_cpu_s",
        "extra_metrics": ["plan.search.solved"],
        "timed": {"repeats": 3, "metrics": ["plan.search.solve_cpu_s"]},
        "base": ["model=gpt"],
        "series": {"s": ["strategy=ddp"]},
        "groups": [{"label": "g"}],
    }
    path = tmp_path / "timed.yaml"
    path.write_text(yaml.safe_dump(sweep))
    spec = load_sweep(path)
    jobs = figure_jobs(spec)
    assert [(j.subdir, j.repeat) for j in jobs] == [("00_s", 0), ("00_s_r1", 1), ("00_s_r2", 2)]
    assert len({j.overrides for j in jobs}) == 1

    def summary(cpu: float, iteration: float = 2.0) -> dict:
        units = {"llm": {"dp": 1, "tp": 1, "pp": 1, "micro_batch": 1}}
        return {"iteration_time_s": iteration, "plan": {"units": units, "search": {"solve_cpu_s": cpu, "solved": 7}}}

    outcomes = {jobs[0].key: summary(0.16), jobs[1].key: summary(0.14), jobs[2].key: {"error": "killed"}}
    table = write_report(spec, outcomes, tmp_path / "out")
    row = json.loads((tmp_path / "out" / "results.json").read_text())["rows"][0]
    assert row["value"] == 0.14 and row["plan.search.solved"] == 7 and row["timed_repeats"] == 2
    assert row["timed_spread"] == {"value": [0.14, 0.16]}  # the largest kept beside the least
    assert "the least of 3 runs of each job" in table
    outcomes[jobs[2].key] = summary(0.12, iteration=2.5)  # a repeat that priced another iteration
    write_report(spec, outcomes, tmp_path / "out")
    row = json.loads((tmp_path / "out" / "results.json").read_text())["rows"][0]
    assert row["value"] is None and "price different iterations" in row["error"]
    for bad in ({"repeats": 1, "metrics": ["x"]}, {"repeats": 3, "metrics": []}, {"repeats": 3}):
        path.write_text(yaml.safe_dump({**sweep, "timed": bad}))
        with pytest.raises(ConfigError, match="timed"):
            load_sweep(path)
