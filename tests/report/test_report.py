"""The sinks of a run's results, on a small hand-built Timeline and summary."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from src.report import JobInfo, RunFiles, format_step, format_summary, open_sinks, write_chrome_trace
from src.timeline import BREAKDOWN_CATEGORIES, RankTimeline, Span, Timeline
from tests.conftest import SUMMARY_KEYS


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The W&B sink sets WANDB_SILENT when unset; keep that from leaking out of a test.
    monkeypatch.setenv("WANDB_SILENT", "true")


def make_timeline() -> Timeline:
    def breakdown(compute: float, comm_dp: float, warmup: float) -> dict[str, float]:
        out = dict.fromkeys(BREAKDOWN_CATEGORIES, 0.0)
        out.update(compute=compute, comm_dp=comm_dp, bubble_warmup=warmup)
        return out

    vision = RankTimeline(
        ranks=tuple(range(0, 8)) + tuple(range(64, 72)),
        label="vision stage 0",
        units=("vision",),
        end=1.0,
        breakdown=breakdown(0.75, 0.05, 0.2),
        spans=[
            Span("compute", 0.0, 0.25, "fwd", "compute", "vision", 0),
            Span("compute", 0.25, 0.75, "bwd", "compute", "vision", 0),
            Span("comm", 0.75, 0.8, "reduce_scatter", "comm_dp", "vision"),
            Span("compute", 0.8, 1.0, "optimizer", "compute", "vision"),
        ],
    )
    text = RankTimeline(
        ranks=tuple(range(8, 16)),
        label="",
        units=("text",),
        end=1.0,
        breakdown=breakdown(0.5, 0.25, 0.25),
        spans=[Span("comm", 0.5, 0.75, "all_reduce", "comm_dp", "text"), Span("compute", 0.25, 0.5, "fwd", "compute", "text", 1)],
    )
    return Timeline(iteration_time=1.0, ranks=[vision, text], events=6)


def make_summary() -> dict:
    timeline = make_timeline()
    return {
        "model": "clip",
        "strategy": "distmm",
        "cluster": "p3_16xlarge",
        "backend": "sim",
        "devices": 24,
        "global_batch": 512,
        "precision": "fp16",
        "iteration_time_s": 1.0,
        "mfu": 0.4123,
        "hfu": 0.45,
        "throughput_samples_per_s": 512.0,
        "tflops_per_device": 51.3,
        "model_flops_per_iteration": 1.2e15,
        "breakdown_s": timeline.mean_breakdown(),
        "breakdown_by_unit_s": timeline.unit_breakdown(),
        "peak_memory_gib": 12.5,
        "memory_gib": {"params": 1.5, "activations": 11.0},
        "plan": {
            "strategy": "distmm",
            "devices": 24,
            "units": {
                "vision": {
                    "dp": 2,
                    "tp": 8,
                    "pp": 1,
                    "vpp": 1,
                    "devices": 16,
                    "ranks": "0-7,64-71",
                    "micro_batch": 8,
                    "num_microbatches": 4,
                    "batch_per_replica": 32,
                    "stage_layers": [[0, 24]],
                    "grid_x": 2,
                },
                "text": {
                    "dp": 8,
                    "tp": 1,
                    "pp": 1,
                    "vpp": 1,
                    "devices": 8,
                    "ranks": "8-15",
                    "micro_batch": 16,
                    "num_microbatches": 4,
                    "batch_per_replica": 64,
                    "stage_layers": [[0, 12]],
                },
            },
        },
        "events": 6,
        "an_unknown_key": {"nested": [1, 2]},
    }


CONFIG_NONE = {
    "model": {"name": "clip"},
    "strategy": {"name": "distmm"},
    "cluster": {"name": "p3_16xlarge"},
    "backend": {"name": "sim"},
    "logger": {"name": "none"},
    "train": {"global_batch": 512},
    "run": {"name": "clip-distmm-p3_16xlarge"},
}


def wandb_config(mode: str = "offline") -> dict:
    return {
        **CONFIG_NONE,
        "logger": {"name": "wandb", "mode": mode, "project": "test", "entity": None, "group": None, "tags": ["unit-test"]},
    }


def run_all(run_dir: Path, config: dict, job: JobInfo | None = None) -> None:
    with open_sinks(run_dir, config, job or JobInfo(config["run"]["name"])) as sinks:
        sinks.log_step({"step": 0, "iteration_time_s": 1.0, "mfu": 0.4123})
        sinks.finish(make_summary(), make_timeline())


def test_summary_json_has_required_keys_and_is_byte_identical(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        run_all(tmp_path / name, CONFIG_NONE)
    first = (tmp_path / "a" / "summary.json").read_bytes()
    assert first == (tmp_path / "b" / "summary.json").read_bytes()
    summary = json.loads(first)
    assert set(SUMMARY_KEYS) <= set(summary)
    assert set(summary["breakdown_s"]) == set(BREAKDOWN_CATEGORIES)
    assert summary["plan"]["units"]["vision"]["ranks"] == "0-7,64-71"
    assert not list((tmp_path / "a").glob(".*tmp"))  # the atomic write left no temp file


def test_metrics_jsonl_steps_then_one_summary_last(tmp_path: Path) -> None:
    with open_sinks(tmp_path, CONFIG_NONE, JobInfo("r")) as sinks:
        for step in range(3):
            sinks.log_step({"step": step, "loss": 2.0 - step, "step_time_s": 0.4})
        sinks.finish(make_summary(), make_timeline())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["type"] for line in lines] == ["step", "step", "step", "summary"]
    assert [line["step"] for line in lines[:3]] == [0, 1, 2]
    assert lines[-1]["mfu"] == pytest.approx(0.4123)


def test_failed_run_leaves_no_summary(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text("{}")  # left by an earlier run in this dir
    with pytest.raises(RuntimeError):
        with open_sinks(tmp_path, CONFIG_NONE, JobInfo("r")) as sinks:
            sinks.log_step({"step": 0, "loss": 1.0, "step_time_s": 0.1})
            raise RuntimeError("the plan does not fit")
    assert not (tmp_path / "summary.json").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_chrome_trace(tmp_path: Path) -> None:
    timeline = make_timeline()
    write_chrome_trace(timeline, tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names.values()) == ["ranks 8-15", "vision stage 0 (ranks 0-7,64-71)"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(len(r.spans) for r in timeline.ranks)
    assert {e["pid"] for e in spans} == set(names)
    bwd = next(e for e in spans if e["name"] == "bwd")
    assert (bwd["ts"], bwd["dur"], bwd["cat"]) == (250000.0, 500000.0, "compute")
    assert bwd["args"] == {"unit": "vision", "microbatch": 0}
    # compute is the first thread of every process, even where it is not the first span
    threads = {(e["pid"], e["args"]["name"]): e["tid"] for e in events if e["name"] == "thread_name"}
    text_pid = next(pid for pid, name in names.items() if name == "ranks 8-15")
    assert threads[(text_pid, "compute")] < threads[(text_pid, "comm")]


def test_chrome_trace_spans_back_to_back_never_overlap(tmp_path: Path) -> None:
    # Boundaries whose start and duration round apart in opposite directions (as GPT-175B's did).
    bounds = [0.0]
    for i in range(200):
        bounds.append(bounds[-1] + 1e-6 * (1.0004 + 0.0003 * (i % 7)) + 3.7e-10)
    spans = [Span("compute", a, b, f"op{i}", "compute") for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    timeline = Timeline(
        iteration_time=bounds[-1],
        ranks=[
            RankTimeline(
                ranks=(0,), label="", units=(), end=bounds[-1], breakdown=dict.fromkeys(BREAKDOWN_CATEGORIES, 0.0), spans=spans
            )
        ],
        events=len(spans),
    )
    write_chrome_trace(timeline, tmp_path / "trace.json")
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    ns = [(round(e["ts"] * 1e3), round((e["ts"] + e["dur"]) * 1e3)) for e in events]
    assert all(end <= next_start for (_, end), (next_start, _) in zip(ns, ns[1:]))
    assert ns[-1][1] == round(bounds[-1] * 1e9)


def test_console_table_and_step_line() -> None:
    text = format_summary(make_summary())
    assert "41.23 %" in text  # MFU
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert rows["compute"][1:3] == ["0.6667", "66.7"]  # 16 ranks at 0.75 s, 8 at 0.5 s
    assert rows["bubble_warmup"][1] == "0.2167"
    assert "comm_tp" not in rows  # zero rows are hidden
    assert rows["total"][1:3] == ["1.0000", "100.0"]
    assert rows["vision"][1:4] == ["2", "8", "1"] and "grid_x" in text
    assert format_step({"step": 3, "loss": 1.23454, "step_time_s": 0.4123}) == "step 3 | loss 1.2345 | 0.412 s"
    # The simulator trains nothing: its one priced iteration does not read as a step.
    assert format_step({"step": 0, "iteration_time_s": 2.0381, "mfu": 0.0934}) == "simulated iteration | 2.038 s | MFU 9.34 %"


def _spy_wandb(wandb, monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Spy on W&B's calls, not on its files: their layout is wandb's business."""
    calls: dict[str, list] = {"init": [], "log": [], "finish": [], "artifact": []}
    real_init = wandb.init

    def spy_init(**kwargs):
        calls["init"].append(kwargs)
        run = real_init(**kwargs)
        real_log, real_finish, real_artifact = run.log, run.finish, run.log_artifact
        monkeypatch.setattr(run, "log", lambda data, **kw: (calls["log"].append(data), real_log(data, **kw))[1])
        monkeypatch.setattr(run, "finish", lambda **kw: (calls["finish"].append(kw), real_finish(**kw))[1])
        monkeypatch.setattr(run, "log_artifact", lambda a, **kw: (calls["artifact"].append(a), real_artifact(a, **kw))[1])
        return run

    monkeypatch.setattr(wandb, "init", spy_init)
    return calls


def test_an_offline_run_imports_no_wandb_and_keeps_its_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    run_all(tmp_path, wandb_config("offline"))
    record = json.loads((tmp_path / "wandb.json").read_text())
    assert record["config"]["plan"] == make_summary()["plan"]  # the chosen plan, beside the requested config
    assert record["job"] == {"run_name": CONFIG_NONE["run"]["name"], "sweep_name": None, "override_dirname": None}
    assert not record["failed"]


@pytest.mark.slow
def test_wandb_sync_logs_an_offline_run_as_it_would_have_been_online(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wandb = pytest.importorskip("wandb")
    from src.report.wandb_sync import main

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    run_dir = tmp_path / "sweep" / "0"
    run_dir.mkdir(parents=True)
    run_all(run_dir, wandb_config("offline"))
    calls = _spy_wandb(wandb, monkeypatch)
    assert main(["--offline", str(tmp_path / "sweep")]) == 0  # a multirun's directory: every run in it
    assert "wandb: disabled" not in capsys.readouterr().err
    (init,) = calls["init"]
    assert init["dir"] == str(tmp_path / "wandb_home") and init["mode"] == "offline"
    assert init["job_type"] == CONFIG_NONE["backend"]["name"]
    assert init["tags"][-1] == "unit-test" and CONFIG_NONE["strategy"]["name"] in init["tags"]
    assert init["config"]["plan"] == make_summary()["plan"]
    assert calls["log"][0] == {"step": 0, "iteration_time_s": 1.0, "mfu": 0.4123}  # step: the x axis
    assert {"breakdown", "breakdown_chart", "breakdown_by_unit"} <= set(calls["log"][-1])
    assert calls["finish"] == [{}] and "run-results" in [a.type for a in calls["artifact"]]
    assert main(["--offline", str(run_dir)]) == 0 and len(calls["init"]) == 1  # logged once
    assert main([str(tmp_path / "nothing")]) == 2


@pytest.mark.slow
def test_wandb_name_group_and_dir_in_a_multirun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from src.report.wandb_sync import sync

    monkeypatch.delenv("WANDB_DIR", raising=False)
    seen: list[dict] = []
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kw: (seen.append(kw), real_init(**kw))[1])
    job = JobInfo("clip-distmm", sweep_name="2025-01-01_00-00-00", override_dirname="train.global_batch=1024")
    run_all(tmp_path, wandb_config("offline"), job)
    sync(tmp_path / "wandb.json", "disabled")  # disabled: no W&B process needed
    assert seen[0]["name"] == "clip-distmm train.global_batch=1024"
    assert seen[0]["group"] == "2025-01-01_00-00-00"
    assert seen[0]["dir"] == str(tmp_path)


@pytest.mark.parametrize("breakage", ["unwritable_dir", "no_package"])
def test_wandb_failure_warns_and_run_goes_on(
    breakage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if breakage == "unwritable_dir":
        (tmp_path / "a_file").write_text("")
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a_file" / "wandb"))
    else:
        monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_all(run_dir, wandb_config("online"))  # both fail before any server is asked
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("wandb")]
    assert len(warnings) == 1 and warnings[0].startswith("wandb: disabled for this run: ")
    assert (run_dir / "summary.json").exists() and (run_dir / "trace.json").exists()


@pytest.mark.slow
def test_wandb_unreachable_server_costs_seconds_then_the_run_logs_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("wandb")
    from src.report import wandb_sink

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    # The give-up itself is what is tested, not its 12 s: a shorter wait spares the suite the rest.
    monkeypatch.setattr(wandb_sink, "INIT_TIMEOUT_S", 2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    start = time.monotonic()
    run_all(run_dir, wandb_config("online"))
    # W&B's own default waits 90 s for an unreachable server; ours gives up after INIT_TIMEOUT_S.
    # Bounded by W&B's 90 s, not by what a loaded machine takes to log offline afterwards.
    assert time.monotonic() - start < 90
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("wandb")]
    assert len(warnings) == 1 and "server unreachable" in warnings[0] and "wandb sync " in warnings[0]
    assert list((tmp_path / "wandb_home" / "wandb").glob("offline-run-*"))
    assert (run_dir / "summary.json").exists()


def test_reused_run_dir_starts_afresh(tmp_path: Path) -> None:
    files = RunFiles(tmp_path)
    files.log_step({"step": 0})
    RunFiles(tmp_path).finish({"mfu": 0.5})  # a second run in the same dir starts afresh
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["summary"]


@pytest.mark.slow
def test_a_figure_is_logged_as_one_wandb_run_with_table_plot_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wandb = pytest.importorskip("wandb")
    from src.report.wandb_sink import log_figure
    from src.report.wandb_sync import main

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    calls = _spy_wandb(wandb, monkeypatch)
    out = tmp_path / "fig"
    (out / "0_megatron").mkdir(parents=True)
    (out / "results.json").write_text(json.dumps({"rows": [{"group": "g", "series": "s", "value": 1.5, "paper": 2}]}))
    (out / "results.md").write_text("| g | s |\n")
    job = {"model": {"name": "gpt"}, "strategy": {"name": "megatron"}, "cluster": {"name": "perlmutter"}}
    (out / "0_megatron" / "resolved.yaml").write_text(json.dumps(job))
    log_figure({"logger": {"name": "none"}}, out, "fig")
    assert not (out / "wandb.json").exists()  # no W&B unless the multirun logs to it
    log_figure(wandb_config("offline"), out, "fig")  # the multirun's defaults: clip, distmm, p3_16xlarge
    assert calls["init"] == [] and main(["--offline", str(out)]) == 0
    assert "wandb:" not in capsys.readouterr().err
    (init,) = calls["init"]
    assert init["job_type"] == "figure" and init["group"] == "fig"
    assert {"gpt", "megatron", "perlmutter"} <= set(init["tags"]) and not {"clip", "distmm"} & set(init["tags"])  # its own
    assert calls["log"][0]["results"].data == [["g", "s", 1.5, "2"]]
    assert "figure-results" in [a.type for a in calls["artifact"]]  # (W&B logs the table as one of its own)


def test_wandb_mode_comes_from_the_command_line_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from src.config import wandb_mode
    from src.errors import ConfigError

    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode({"mode": None}) == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode({"mode": None}) == "online"  # W&B users' habit
    assert wandb_mode({"mode": "disabled"}) == "disabled"  # logger.mode=... on the command line wins
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode({"mode": None}) == "offline"
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ConfigError, match=r"^WANDB_MODE='sometimes' in the environment; choose one of"):
        wandb_mode({"mode": None})
