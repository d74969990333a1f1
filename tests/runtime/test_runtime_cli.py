"""The real backend through the front door, as a user runs it: a training run end to end,
a worker that fails, a worker killed outright, Ctrl-C, a plan that needs more workers than
there are."""

from __future__ import annotations

import pytest

import io
import json
import os
import re
import signal
import tarfile
import time

from tests.conftest import run_cli
from tests.runtime.support import CLIP, TWO_WORKERS, build_deepspeed_ops, door_at_its_first_step, finish, still_alive

pytestmark = pytest.mark.slow  # starts worker processes


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory):
    build_deepspeed_ops()
    run_dir = tmp_path_factory.mktemp("clip_ddp")
    return run_cli(*TWO_WORKERS, *CLIP, "strategy=ddp", "train.steps=3", f"hydra.run.dir={run_dir}"), run_dir


def test_a_tiny_clip_trains_for_real_and_reports_like_the_simulator(clip_run):
    result, tmp_path = clip_run
    assert result.returncode == 0, result.stderr[-2000:]
    step_lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3 and all("| loss " in line and " s" in line for line in step_lines)
    assert "built successfully" not in result.stdout  # DeepSpeed's op-load notice, once per worker
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "step"] == [0, 1, 2]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["backend"] == "torch" and summary["devices"] == 2
    assert summary["peak_flops_source"].startswith("measured")
    for name in ("resolved.yaml", "trace.json", "plan.json", "run.json"):
        assert (tmp_path / name).exists()
    assert not (tmp_path / ".error.reserve").exists()  # the room kept for error.txt, given back


def test_every_progress_line_of_a_real_start_is_in_run_log(clip_run):
    """However many the machine's speed makes (the workers' start speaks every 15 s, its
    first line after 3 s): each one printed is in run.log too."""
    result, run_dir = clip_run
    progress = [line for line in result.stderr.splitlines() if re.match(r"^[^\[]+ \[\d+ s\]: ", line)]
    log = (run_dir / "run.log").read_text()
    assert all(f"[progress][INFO] - {line}" in log for line in progress), (progress, log[-2000:])


def test_a_written_plan_runs_again_with_the_same_losses(clip_run, tmp_path):
    result, first = clip_run
    assert result.returncode == 0, result.stderr[-2000:]
    again = run_cli("backend=torch", "logger=none", f"plan={first}", "train.steps=3", f"hydra.run.dir={tmp_path}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "plan.json").read_text() == (first / "plan.json").read_text()
    losses = [json.loads((run / "summary.json").read_text())["measured"]["loss"] for run in (first, tmp_path)]
    assert losses[0] == losses[1]


def _shard_with_a_broken_second_half(path) -> None:
    """8 samples; samples 4-7 (the second worker's rows of step 0) are not images."""
    from PIL import Image

    with tarfile.open(path, "w") as tar:
        for i in range(8):
            if i < 4:
                buffer = io.BytesIO()
                Image.new("RGB", (8, 8), (i * 30, 0, 0)).save(buffer, format="PNG")
                image = buffer.getvalue()
            else:
                image = b"not a png"
            for name, data in ((f"{i:04d}.png", image), (f"{i:04d}.txt", b"a caption")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


TIMEOUT_S = 600  # a collective's: a run that waited for one would take this long


@pytest.mark.parametrize("preprocess", ["inline", "disaggregated"])  # disaggregated: the producer's error is the trainer's
def test_a_failing_worker_stops_the_run_with_its_error_line(tmp_path, preprocess):
    build_deepspeed_ops()
    _shard_with_a_broken_second_half(tmp_path / "shard-0.tar")
    start = time.monotonic()
    data = [f"backend.data={tmp_path}/shard-*.tar", f"backend.preprocess={preprocess}", f"backend.timeout_s={TIMEOUT_S}"]
    result = run_cli(*TWO_WORKERS, *CLIP, "strategy=ddp", *data, f"hydra.run.dir={tmp_path}/run", timeout=2 * TIMEOUT_S)
    # Rank 0 is blocked in the feature all-gather when rank 1 fails: the driver stops it,
    # long before that collective's timeout (however slow the machine's start-up).
    assert time.monotonic() - start < TIMEOUT_S
    assert result.returncode == 2  # bad data: the user's to fix
    line = f"error: rank 1: DataError: backend.data: shard {tmp_path}/shard-0.tar member 0004.png: not a decodable image"
    assert line in result.stderr
    assert (tmp_path / "run" / "error.txt").exists() and not (tmp_path / "run" / "summary.json").exists()


def test_a_plan_needing_more_workers_is_refused_before_anything_starts(tmp_path):
    result = run_cli("backend=torch", "cluster=local", "backend.workers=2", *CLIP, "strategy=ddp", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: the ddp plan needs 4 workers but backend.workers=2"
    assert not (tmp_path / "errors").exists()


def test_ctrl_c_stops_every_worker_and_exits_130(tmp_path):
    driver, workers = door_at_its_first_step(tmp_path, [*TWO_WORKERS, *CLIP, "strategy=ddp"])
    os.killpg(driver.pid, signal.SIGINT)
    stderr = finish(driver)
    assert driver.returncode == 130
    line = stderr.strip().splitlines()[-1]
    expected = r"error: interrupted by Ctrl-C \(SIGINT\) while in step \d+: all 2 workers stopped, no results written"
    assert re.fullmatch(expected, line), line
    assert "Traceback" not in stderr
    assert (tmp_path / "error.txt").read_text() == line.removeprefix("error: ") + "\n"
    assert not still_alive(workers.values()), still_alive(workers.values())
    assert not (tmp_path / "summary.json").exists()


def test_a_killed_worker_is_named_first_not_the_peers_it_broke(tmp_path):
    driver, workers = door_at_its_first_step(tmp_path, [*TWO_WORKERS, *CLIP, "strategy=ddp"])
    os.kill(workers[1], signal.SIGKILL)  # as the OOM killer would: no error line of its own
    stderr = finish(driver)
    assert driver.returncode == 1
    assert stderr.strip().splitlines()[-1] == "error: rank 1: worker killed by signal SIGKILL (exit code -9)"
    assert not still_alive(workers.values()), still_alive(workers.values())
    assert not (tmp_path / "summary.json").exists()
