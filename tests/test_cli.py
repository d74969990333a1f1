"""The front door end to end: `python -m src.run ...` in a subprocess, as a user runs it.

Checks the output contract of a run (docs/design.md): the console table, the run directory's
files and summary.json's figures; a Hydra multirun; determinism; and that every bad input
ends with exit code 2, one `error:` line naming the constraint and its numbers, no
traceback and no summary.json.

Runs use `logger=none` (fast) except the one that checks the W&B offline sink.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import yaml

from src.timeline import BREAKDOWN_CATEGORIES
from tests.conftest import SUMMARY_KEYS

pytestmark = pytest.mark.slow  # every test here starts the front door in a process

RUN_FILES = ("resolved.yaml", "summary.json", "metrics.jsonl", "trace.json")


def _run(cli, run_dir: Path, *overrides: str, logger: str = "none"):
    """One run into `run_dir`; `cli` is conftest's runner of `python -m src.run`."""
    return cli(*overrides, f"logger={logger}", f"hydra.run.dir={run_dir}")


# --------------------------------------------------------------------------- the happy path


@pytest.fixture(scope="module")
def clip_run(cli, tmp_path_factory: pytest.TempPathFactory):
    """`python -m src.run model=clip strategy=megatron`, once for the module."""
    run_dir = tmp_path_factory.mktemp("clip_megatron")
    start = time.monotonic()
    proc = _run(cli, run_dir, "model=clip", "strategy=megatron")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    return proc, run_dir, summary, elapsed


def test_clip_megatron_exits_zero_quickly_without_errors(clip_run) -> None:
    proc, _, _, elapsed = clip_run
    assert proc.returncode == 0
    assert "Traceback" not in proc.stderr
    assert "error:" not in proc.stderr
    # "Within seconds": about 1 s on a laptop; generous for a loaded 2-core CI machine.
    assert elapsed < 30, f"the default run took {elapsed:.1f} s"


def test_clip_megatron_writes_the_run_directory(clip_run) -> None:
    proc, run_dir, _, _ = clip_run
    # run.log keeps what the console showed, stamped.
    log = (run_dir / "run.log").read_text()
    assert "iteration time" in log and proc.stdout.splitlines()[0] in log
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), f"{name} missing from {sorted(p.name for p in run_dir.iterdir())}"
        assert (run_dir / name).stat().st_size > 0, f"{name} is empty"
    # No stray temporary file from the atomic summary write.
    assert not list(run_dir.glob(".summary.json*"))


def test_summary_json_has_the_contract_fields(clip_run) -> None:
    _, _, s, _ = clip_run
    missing = [k for k in SUMMARY_KEYS if k not in s]
    assert not missing, f"summary.json lacks {missing}"
    assert (s["model"], s["strategy"], s["cluster"], s["backend"]) == ("clip", "megatron", "p3_16xlarge", "sim")
    assert s["devices"] == 64  # the default cluster: 8 p3.16xlarge x 8 V100
    assert 0 < s["mfu"] < 1
    for key in ("iteration_time_s", "throughput_samples_per_s", "tflops_per_device", "peak_memory_gib"):
        assert isinstance(s[key], float) and math.isfinite(s[key]) and s[key] > 0, (key, s[key])
    # A V100 has 16 GiB, 1 GiB of which the preset reserves: a plan that was kept must fit.
    assert s["peak_memory_gib"] <= 15.0 + 1e-9


def test_summary_figures_are_consistent(clip_run) -> None:
    _, _, s, _ = clip_run
    t = s["iteration_time_s"]
    assert s["throughput_samples_per_s"] == pytest.approx(s["global_batch"] / t, rel=1e-12)
    # TFLOP/s per device is MFU times the device's peak, in TFLOP/s.
    assert s["tflops_per_device"] == pytest.approx(s["mfu"] * s["peak_flops_per_device"] / 1e12, rel=1e-9)
    assert s["peak_flops_per_device"] == 125e12  # V100 fp16, the preset's default precision


def test_breakdown_adds_up_to_the_iteration_time(clip_run) -> None:
    _, _, s, _ = clip_run
    breakdown = s["breakdown_s"]
    assert set(breakdown) == set(BREAKDOWN_CATEGORIES)
    assert all(v >= 0 for v in breakdown.values()), breakdown
    total = sum(breakdown.values())
    assert abs(total - s["iteration_time_s"]) <= 1e-9 * s["iteration_time_s"], (total, s["iteration_time_s"])
    assert breakdown["compute"] > 0


def test_summary_plan_per_unit(clip_run) -> None:
    _, _, s, _ = clip_run
    plan = s["plan"]
    assert plan["devices"] == s["devices"]
    units = plan["units"]
    assert set(units) == {"vision", "text", "interaction"}
    for name, unit in units.items():
        for key in ("dp", "tp", "pp", "micro_batch", "ranks", "batch_per_replica", "num_microbatches"):
            assert key in unit, f"plan unit {name} lacks {key}"
        assert unit["dp"] * unit["tp"] * unit["pp"] == s["devices"], (name, unit)
        assert unit["dp"] * unit["batch_per_replica"] == s["global_batch"], (name, unit)
        assert unit["micro_batch"] * unit["num_microbatches"] == unit["batch_per_replica"], (name, unit)
        assert unit["pp"] == 1  # the Megatron baseline of a contrastive model does not pipeline
        assert unit["ranks"]


def test_console_prints_the_table(clip_run) -> None:
    proc, _, s, _ = clip_run
    out = proc.stdout
    # Who ran where.
    for word in ("model", "clip", "strategy", "megatron", "cluster", "p3_16xlarge", "devices"):
        assert word in out, f"{word!r} not in the console output"
    assert re.search(r"^devices\s+64\s*$", out, re.M)
    # The plan per unit, with dp/tp/pp and micro-batch columns.
    header = next((line for line in out.splitlines() if line.startswith("unit ")), None)
    assert header is not None, out
    for col in ("dp", "tp", "pp", "micro-batch"):
        assert re.search(rf"(^|\s){re.escape(col)}(\s|$)", header), (col, header)
    for unit in ("vision", "text", "interaction"):
        assert re.search(rf"^{unit}\s+\d+\s+\d+\s+\d+", out, re.M), unit
    # The figures, matching summary.json.
    assert "iteration time" in out and f"{s['iteration_time_s']:.4f} s" in out
    assert "MFU" in out and f"{100 * s['mfu']:.2f} %" in out
    assert "throughput" in out and f"{s['throughput_samples_per_s']:,.1f} samples/s" in out
    assert "TFLOP/s per device" in out and f"{s['tflops_per_device']:.1f}" in out
    # The breakdown, with a total row equal to the iteration time.
    assert re.search(r"^breakdown\s", out, re.M)
    assert re.search(rf"^total\s+{re.escape(format(s['iteration_time_s'], '.4f'))}\s", out, re.M)


def test_metrics_jsonl_steps_then_the_summary(clip_run) -> None:
    _, run_dir, s, _ = clip_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(lines) >= 2
    assert all(line["type"] == "step" for line in lines[:-1])
    assert lines[0]["step"] == 0
    assert lines[-1]["type"] == "summary"
    last = {k: v for k, v in lines[-1].items() if k != "type"}
    assert last == s


def test_trace_json_is_a_chrome_trace(clip_run) -> None:
    _, run_dir, _, _ = clip_run
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert isinstance(events, list) and events
    assert all("ph" in e and "pid" in e for e in events)
    assert any(e["ph"] == "X" for e in events), "no duration events in the trace"


def test_resolved_yaml_is_the_composed_config(clip_run) -> None:
    _, run_dir, _, _ = clip_run
    resolved = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    for group in ("model", "strategy", "cluster", "backend", "logger", "train"):
        assert group in resolved, group
    assert resolved["model"]["name"] == "clip"
    assert resolved["strategy"]["name"] == "megatron"
    assert resolved["cluster"]["name"] == "p3_16xlarge"
    assert resolved["logger"]["name"] == "none"
    assert resolved["run"]["name"] == "clip-megatron-p3_16xlarge"  # interpolations resolved


def test_same_config_twice_gives_byte_identical_summary(cli, clip_run, tmp_path: Path) -> None:
    _, first_dir, _, _ = clip_run
    proc = _run(cli, tmp_path, "model=clip", "strategy=megatron")
    assert proc.returncode == 0, proc.stderr
    # Byte for byte, but for how long the plan search took on this machine.
    first, second = ((path / "summary.json").read_text() for path in (first_dir, tmp_path))
    assert re.subn(WALL_TIME, "", first)[1] == 1
    assert re.sub(WALL_TIME, "", first) == re.sub(WALL_TIME, "", second)


WALL_TIME = r'"wall_time_s": [0-9.e+-]+'


# --------------------------------------------------------------------------- multirun, W&B


def test_multirun_failing_job_is_recorded_and_the_rest_go_on(cli, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # tp=3 does not divide CLIP's heads; a value with a slash must not nest job directories.
    proc = cli("-m", "strategy.tp=3,1", "run.name=a/b", "logger=none", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    assert "does not divide" in (sweep / "0" / "error.txt").read_text()
    assert not (sweep / "0" / "summary.json").exists() and (sweep / "1" / "summary.json").exists()


def test_multirun_three_models(cli, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = cli("-m", "model=clip,coca,lit", "strategy=megatron", "logger=none", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 3, sorted(p.name for p in sweep.iterdir())
    assert len({p.parent for p in summaries}) == 3  # each job has its own run dir
    models = set()
    for path in summaries:
        for name in RUN_FILES:
            assert (path.parent / name).is_file(), (path.parent.name, name)
        s = json.loads(path.read_text())
        assert 0 < s["mfu"] < 1
        assert s["strategy"] == "megatron"
        models.add(s["model"])
        resolved = yaml.safe_load((path.parent / "resolved.yaml").read_text())
        assert resolved["model"]["name"] == s["model"]
    assert models == {"clip", "coca", "lit"}


def test_wandb_offline_sink_does_not_break_the_run(cli, tmp_path: Path) -> None:
    proc = _run(cli, tmp_path, "model=clip", "strategy=megatron", logger="wandb")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for name in RUN_FILES:
        assert (tmp_path / name).is_file(), name
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["model"] == "clip" and 0 < s["mfu"] < 1
    # Offline, the run keeps its W&B record for src.report.wandb_sync, and starts no W&B.
    record = json.loads((tmp_path / "wandb.json").read_text())
    assert record["config"]["plan"]["tp"] == s["plan"]["tp"] and not (tmp_path / "wandb").exists()


# --------------------------------------------------------------------------- bad input


def assert_one_line_error(proc, run_dir: Path, *needles: str) -> str:
    """Exit code 2, exactly one stderr line `error: ...` containing every needle (regexes),
    no traceback, no summary.json (resolved.yaml may be there)."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith("error:"), line
    for needle in needles:
        assert re.search(needle, line), f"{needle!r} not in {line!r}"
    assert not (run_dir / "summary.json").exists(), "a failed run left summary.json behind"
    if (run_dir / "run.log").exists():  # absent only where Hydra refused the overrides
        assert (run_dir / "run.log").read_text().rstrip().endswith(line), "run.log lacks the error line"
    return line


BAD_INPUTS = {
    # id: (overrides, regexes the one error line must contain)
    "tp_not_dividing_heads": (["strategy.tp=3"], [r"\btp=3\b", r"does not divide", r"\b16\b", r"heads"]),
    # GPT-5B has 24 blocks; 5 nodes x 4 A100 = 20 devices, so tp x pp = 1 x 5 divides the
    # devices (dp=4, 512 % 4 == 0) and only the layers do not divide.
    "pp_not_dividing_layers": (
        ["model=gpt", "strategy.pp=5", "strategy.tp=1", "cluster=perlmutter", "cluster.nodes=5"],
        [r"\bpp=5\b", r"does not divide", r"\b24\b", r"blocks|layers"],
    ),
    # Every dp on 64 devices is a power of two, and so is 512: 3 never divides.
    "batch_not_divisible_by_dp_x_micro_batch": (
        ["train.global_batch=512", "strategy.micro_batch_size=3"],
        [r"\b512\b", r"not divisible", r"micro-batch", r"\b3\b"],
    ),
    "devices_not_nodes_x_devices_per_node": (["cluster.devices=10"], [r"cluster\.devices=10", r"8 x 8 = 64"]),
    # CLIP multi_node on V100s with tp fixed at 1: the weights alone exceed 16 GiB.
    "plan_does_not_fit_memory": (
        ["model=clip", "model.scale=multi_node", "strategy.tp=1", "train.global_batch=512"],
        [r"tp=1", r"[\d.]+ GiB", r"V100", r"short by [\d.]+ GiB"],
    ),
    "global_batch_zero": (["train.global_batch=0"], [r"train\.global_batch", r"positive", r"\b0\b"]),
    "gpt_custom_layers_negative": (
        ["model=gpt", "model.preset=null", "model.layers=-1", "model.hidden=1024", "model.heads=16", "model.vocab=51200"],
        [r"model\.layers=-1", r"positive"],
    ),
    "gpt_preset_layers_negative": (["model=gpt", "model.layers=-1"], [r"model\.layers=-1", r"positive"]),
    "cluster_nodes_zero": (["cluster.nodes=0"], [r"cluster\.nodes", r"positive", r"\b0\b"]),
    "cluster_devices_per_node_zero": (["cluster.devices_per_node=0"], [r"cluster\.devices_per_node", r"positive", r"\b0\b"]),
    "train_steps_zero": (["train.steps=0"], [r"train\.steps", r"positive", r"\b0\b"]),
    "strategy_tp_zero": (["strategy.tp=0"], [r"strategy\.tp", r"positive", r"\b0\b"]),
    # Typos and bad types in every group, answered at the door (no worker started).
    "train_key_typo": (["+train.stepz=5"], [r"unknown train key", r"stepz", r"steps"]),
    "cluster_key_typo": (["+cluster.x=1"], [r"unknown cluster key", r"'x'"]),
    "backend_key_typo": (["+backend.x=1"], [r"unknown backend=sim key", r"'x'"]),
    "unknown_experiment": (["+experiment=anything"], [r"experiment/anything", r"choose one of", r"distmm_fig7"]),
    "unknown_top_level_key": (["+foo=1"], [r"unknown top-level", r"'foo'"]),
    "key_not_in_the_group": (["model=gpt", "model.scale=tiny"], [r"Could not override 'model\.scale'", r"\+model"]),
    "option_not_in_the_group": (["model=nope"], [r"model/nope", r"choose one of", r"\bclip\b"]),
    "seed_not_a_number": (["train.seed=abc"], [r"train\.seed", r"integer", r"abc"]),
    "torch_backend_workers_not_a_number": (
        ["backend=torch", "cluster=local", "model.scale=tiny", "strategy=ddp", "backend.workers=abc"],
        [r"backend\.workers", r"positive integer", r"abc"],
    ),
    "torch_backend_unknown_dist_backend": (
        ["backend=torch", "cluster=local", "model.scale=tiny", "strategy=ddp", "backend.dist_backend=mpi"],
        [r"backend\.dist_backend", r"mpi", r"gloo"],
    ),
    "torch_backend_unknown_preprocess": (
        ["backend=torch", "cluster=local", "model.scale=tiny", "strategy=ddp", "backend.preprocess=remote"],
        [r"backend\.preprocess", r"remote", r"disaggregated"],
    ),
    "torch_backend_prefetch_steps_zero": (
        ["backend=torch", "cluster=local", "model.scale=tiny", "strategy=ddp", "backend.prefetch_steps=0"],
        [r"backend\.prefetch_steps", r"positive integer", r"\b0\b"],
    ),
}


@pytest.mark.parametrize("overrides,needles", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_one_line_exit_2_no_summary(cli, tmp_path: Path, overrides: list[str], needles: list[str]) -> None:
    proc = _run(cli, tmp_path, *overrides)
    assert_one_line_error(proc, tmp_path, *needles)


def test_non_numeric_cluster_field_is_a_one_line_error(cli, tmp_path: Path) -> None:
    proc = _run(cli, tmp_path, "cluster.memory_gib=abc")
    assert_one_line_error(proc, tmp_path, r"memory_gib", r"abc")


def test_boolean_node_count_is_a_one_line_error(cli, tmp_path: Path) -> None:
    proc = _run(cli, tmp_path, "cluster.nodes=true")
    assert_one_line_error(proc, tmp_path, r"cluster\.nodes", r"positive")


def test_failed_run_in_a_reused_run_dir_leaves_no_summary(cli, tmp_path: Path) -> None:
    ok = _run(cli, tmp_path, "model=clip", "strategy=megatron", "train.global_batch=64", "cluster.nodes=1")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "summary.json").exists()
    proc = _run(cli, tmp_path, "model=clip", "strategy=megatron", "strategy.tp=3")
    assert_one_line_error(proc, tmp_path, r"\btp=3\b")
