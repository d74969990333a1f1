"""The real backend through the front door, as a user runs it: a training run end to end,
a worker that fails, a worker killed outright, Ctrl-C, a plan that needs more workers than
there are."""

from __future__ import annotations

import pytest

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

from tests.conftest import REPO_ROOT, cli_env, run_cli
from tests.runtime.support import CLIP, TWO_WORKERS, build_deepspeed_ops

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


@pytest.mark.parametrize("preprocess", ["inline", "disaggregated"])  # disaggregated: the producer's error is the trainer's
def test_a_failing_worker_stops_the_run_with_its_error_line(tmp_path, preprocess):
    build_deepspeed_ops()
    _shard_with_a_broken_second_half(tmp_path / "shard-0.tar")
    start = time.monotonic()
    data = [f"backend.data={tmp_path}/shard-*.tar", f"backend.preprocess={preprocess}"]
    result = run_cli(*TWO_WORKERS, *CLIP, "strategy=ddp", *data, f"hydra.run.dir={tmp_path}/run")
    # Rank 0 is blocked in the feature all-gather when rank 1 fails: the driver stops it.
    assert time.monotonic() - start < 60
    assert result.returncode == 2  # bad data: the user's to fix
    line = f"error: rank 1: DataError: backend.data: shard {tmp_path}/shard-0.tar member 0004.png: not a decodable image"
    assert line in result.stderr
    assert (tmp_path / "run" / "error.txt").exists() and not (tmp_path / "run" / "summary.json").exists()


def test_a_plan_needing_more_workers_is_refused_before_anything_starts(tmp_path):
    result = run_cli("backend=torch", "cluster=local", "backend.workers=2", *CLIP, "strategy=ddp", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: the ddp plan needs 4 workers but backend.workers=2"
    assert not (tmp_path / "errors").exists()


def _workers_of(driver_pid: int) -> dict[int, int]:
    """rank -> pid of the workers the driver started (named mmdist-rank<r>), wherever in its
    process tree they are (forked from its forkserver, or its children)."""
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,comm="], capture_output=True, text=True).stdout.splitlines()
    children: dict[int, list[tuple[int, str]]] = {}
    for row in rows:
        pid, ppid, comm = row.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), comm.strip()))
    workers, todo = {}, [driver_pid]
    while todo:
        for pid, comm in children.get(todo.pop(), []):
            todo.append(pid)
            if comm.startswith("mmdist-rank"):
                workers[int(comm.removeprefix("mmdist-rank"))] = pid
    return workers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _long_run_at_its_first_step(tmp_path) -> tuple[subprocess.Popen, dict[int, int]]:
    """The front door on a run of many steps, once its workers train, and their pids by rank."""
    build_deepspeed_ops()
    # Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the driver's.
    # The child restores Python's SIGINT handler in case this test runs where SIGINT is ignored.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['src.run'] + sys.argv[1:]; runpy.run_module('src.run', run_name='__main__')"
    )
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            start,
            *TWO_WORKERS,
            *CLIP,
            "strategy=ddp",
            "train.steps=100000",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO_ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and '"step"' in metrics.read_text()):
        if driver.poll() is not None or time.monotonic() > deadline:
            os.killpg(driver.pid, signal.SIGKILL)
            raise AssertionError("the run never reached its first step")
        time.sleep(0.5)
    workers = _workers_of(driver.pid)
    assert sorted(workers) == [0, 1]
    return driver, workers


def _finish(driver: subprocess.Popen) -> str:
    try:
        _, stderr = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    return stderr


def test_ctrl_c_stops_every_worker_and_exits_130(tmp_path):
    driver, workers = _long_run_at_its_first_step(tmp_path)
    os.killpg(driver.pid, signal.SIGINT)
    stderr = _finish(driver)
    assert driver.returncode == 130
    assert stderr.strip().splitlines()[-1] == "error: interrupted; all workers stopped"
    assert "Traceback" not in stderr
    assert not any(map(_alive, workers.values())) and not (tmp_path / "summary.json").exists()


def test_a_killed_worker_is_named_first_not_the_peers_it_broke(tmp_path):
    driver, workers = _long_run_at_its_first_step(tmp_path)
    os.kill(workers[1], signal.SIGKILL)  # as the OOM killer would: no error line of its own
    stderr = _finish(driver)
    assert driver.returncode == 1
    assert stderr.strip().splitlines()[-1] == "error: rank 1: worker killed by signal SIGKILL (exit code -9)"
    assert not any(map(_alive, workers.values())) and not (tmp_path / "summary.json").exists()
