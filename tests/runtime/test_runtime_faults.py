"""Faults injected into a real run through the front door: SIGKILL and SIGTERM to the door
(every process it started is gone within 5 s, the run directory says it was killed and
holds no summary; a run killed after its checkpoint resumes to the losses of one never
killed), SIGTERM while DeepSpeed's op builds and Ctrl-C while the start waits on another
process's build lock (one line, error.txt, the compilers and the forkserver gone within
5 s), SIGSTOP to one rank (named, with where it stopped, before any peer's collective
times out), a disk that fills up (one line naming the file, exit 2, error.txt written on
the full disk, no traceback). Each run is two tiny CPU workers; every process is torn down
whatever fails."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from src.runtime.op_build import LOCK_FILE, op_cache_dir
from tests.conftest import REPO_ROOT, cli_env, run_cli
from tests.runtime.support import (
    CLIP,
    TWO_WORKERS,
    alive,
    descendants,
    door_at_its_first_step,
    finish,
    kill_all,
    launch_cases,
    start_door,
    still_alive,
    build_deepspeed_ops,
    summary_of,
    wait_for,
)

pytestmark = pytest.mark.slow  # starts worker processes

DDP_ZERO2 = [*TWO_WORKERS, *CLIP, "strategy=ddp", "strategy.zero_stage=2"]
GONE_WITHIN_S = 5.0


def _gone_after(pids: dict[int, str]) -> float:
    """Seconds until none of `pids` is alive (or GONE_WITHIN_S + 5, when some still are)."""
    start = time.monotonic()
    while any(map(alive, pids)) and time.monotonic() - start < GONE_WITHIN_S + 5:
        time.sleep(0.02)
    return time.monotonic() - start


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["type"] == "step"}


def test_sigkill_to_the_door_takes_every_worker_with_it_and_the_run_resumes(tmp_path):
    killed = tmp_path / "killed"
    door = start_door(killed, [*DDP_ZERO2, "train.steps=100000", "train.checkpoint_every=2"])
    started: dict[int, str] = {}
    try:
        wait_for(door, (killed / "checkpoint" / "latest").exists, "its first checkpoint")
        started = descendants(door.pid)  # the forkserver, its resource tracker, the workers
        assert "mmdist-rank0" in started.values() and len(started) >= 3, started
        os.kill(door.pid, signal.SIGKILL)
        gone_s = _gone_after(started)
    finally:
        kill_all(door, also=started)
    print(f"SIGKILL to the door: its {len(started)} processes gone in {gone_s:.2f} s")
    print((killed / "error.txt").read_text().strip())
    assert gone_s < GONE_WITHIN_S, [f"{pid} {name}" for pid, name in started.items() if alive(pid)]
    error = (killed / "error.txt").read_text()
    assert re.fullmatch(rf"the front door \(pid {door.pid}\) died while rank 0 was .+: workers stopped, no results written\n", error)
    assert not (killed / "summary.json").exists() and not (killed / "trace.json").exists()
    assert not (killed / ".lifeline").exists()  # the heartbeat board: rank 0 removes it for the dead door

    done = int((killed / "checkpoint" / "latest").read_text().removeprefix("step"))
    steps = f"train.steps={done + 2}"
    resumed = run_cli(*DDP_ZERO2, steps, f"train.resume={killed}", "logger=none", f"hydra.run.dir={tmp_path}/resumed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # The never-killed run is the losses' reference, not a door under test: launched from
    # here, it starts no door of its own (seconds of imports).
    expected = _losses(launch_cases(tmp_path, {"whole": [*DDP_ZERO2, steps]}, 2)["whole"])
    assert _losses(tmp_path / "resumed") == {step: expected[step] for step in (done, done + 1)}
    assert all(expected[step] == loss for step, loss in _losses(killed).items() if step < done)  # before the kill
    summary = summary_of(tmp_path / "resumed")["measured"]
    assert summary["first_step"] == done
    assert summary["checkpoint"]["resumed_from"] == {"run_dir": str(killed), "steps_done": done}
    meta = json.loads((killed / "checkpoint" / f"step{done}" / "meta.json").read_text())
    print(f"ddp ZeRO-2 tiny CLIP checkpoint of {done} steps: {meta['bytes'] / 2**20:.2f} MiB saved in {meta['save_s']:.3f} s")


def test_sigterm_to_the_door_stops_every_worker_and_says_so(tmp_path):
    door, workers = door_at_its_first_step(tmp_path, DDP_ZERO2)
    try:
        started = descendants(door.pid)
        os.kill(door.pid, signal.SIGTERM)
        gone_s = _gone_after(started)
        stderr = finish(door)
    finally:
        kill_all(door)
    print(f"SIGTERM to the door: its {len(started)} processes gone in {gone_s:.2f} s")
    assert gone_s < GONE_WITHIN_S
    assert door.returncode == 128 + signal.SIGTERM
    line = stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: terminated by SIGTERM while in step \d+: all 2 workers stopped, no results written", line), line
    assert "Traceback" not in stderr
    assert (tmp_path / "error.txt").read_text() == line.removeprefix("error: ") + "\n"
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / ".lifeline").exists()


def test_a_stopped_rank_is_named_with_where_it_stopped_before_any_peer_times_out(tmp_path):
    timeout_s = 15  # the peers' collectives give up after this; the driver names the stalled rank at a third
    door, workers = door_at_its_first_step(tmp_path, [*DDP_ZERO2, f"backend.timeout_s={timeout_s}"])
    try:
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        stderr = finish(door)
        named_s = time.monotonic() - stopped
    finally:
        kill_all(door)
    print(f"rank 1 stopped: named after {named_s:.2f} s (backend.timeout_s={timeout_s}): {stderr.strip().splitlines()[-1]}")
    assert named_s < timeout_s
    assert door.returncode == 1
    lines = [line for line in stderr.splitlines() if line.strip()]
    silent = rf"no heartbeat for [\d.]+ s \(backend.timeout_s={timeout_s}\)"
    where = r"in step \d+, (at instruction \d+ of \d+ \(.+\)|before its first instruction|after its last instruction)"
    assert re.fullmatch(rf"error: rank 1 stopped making progress: {silent} while {where}; all workers stopped", lines[-1]), lines[-1]
    assert not any("rank 0" in line or "Traceback" in line for line in lines), lines  # the stalled rank first, its peers' fates unsaid
    assert not still_alive(workers.values()), still_alive(workers.values())
    assert not (tmp_path / "summary.json").exists()


def _stopped_in_one_line(door, started: dict[int, str], run_dir: Path, sig: int, line: str) -> None:
    """Send `sig` to the door (SIGINT: to its process group, as Ctrl-C does): the door and
    `started` gone within GONE_WITHIN_S, its exit code 128 + `sig`, its last line `line` (a
    regex) and in error.txt, no traceback."""
    try:
        if sig == signal.SIGINT:
            os.killpg(door.pid, sig)
        else:
            os.kill(door.pid, sig)
        gone_s = _gone_after({door.pid: "door", **started})
        stderr = finish(door)
    finally:
        kill_all(door, also=started)
    print(f"{signal.Signals(sig).name}: the door and its {len(started)} processes gone in {gone_s:.2f} s")
    assert gone_s < GONE_WITHIN_S, [f"{pid} {name}" for pid, name in started.items() if alive(pid)]
    assert door.returncode == 128 + sig
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(line, last), last
    assert "Traceback" not in stderr, stderr
    assert (run_dir / "error.txt").read_text() == last.removeprefix("error: ") + "\n"
    assert not (run_dir / "summary.json").exists()


def test_sigterm_while_deepspeeds_op_builds_stops_the_compilers_too(tmp_path):
    run_dir = tmp_path / "run"
    door = start_door(run_dir, DDP_ZERO2, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")})  # nothing built there
    compiling = lambda: any(name == "cc1plus" for name in descendants(door.pid).values())  # noqa: E731
    wait_for(door, compiling, "compiling DeepSpeed's op")
    started = descendants(door.pid)
    building = r"error: terminated by SIGTERM while building DeepSpeed's CPU op, first start only: no worker had started, no results "
    building += "written"
    _stopped_in_one_line(door, started, run_dir, signal.SIGTERM, building)


def test_ctrl_c_while_waiting_on_another_processs_build_lock_writes_error_txt(tmp_path):
    build_deepspeed_ops()
    lock = op_cache_dir() / LOCK_FILE
    with open(lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's build, as far as the door can tell
        run_dir = tmp_path / "run"
        door = start_door(run_dir, DDP_ZERO2)

        def waiting() -> bool:  # the forkserver has the lock file open: it waits in its flock
            for pid in descendants(door.pid):
                try:
                    if any(os.readlink(fd.path) == str(lock) for fd in os.scandir(f"/proc/{pid}/fd")):
                        return True
                except OSError:
                    continue
            return False

        wait_for(door, waiting, "the build lock's wait")
        started = descendants(door.pid)
        line = r"error: interrupted by Ctrl-C \(SIGINT\) while starting 2 workers: no worker had started, no results written"
        _stopped_in_one_line(door, started, run_dir, signal.SIGINT, line)


def _mounts_a_tmpfs(path: Path) -> bool:
    """Whether a tmpfs can be mounted at `path` in a mount namespace of our own (unshare,
    as root or through a user namespace)."""
    if shutil.which("unshare") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {path}"], capture_output=True)
    return probe.returncode == 0


def test_a_full_disk_ends_the_run_in_one_line_naming_the_file(tmp_path):
    """The run directory on a 256 KiB tmpfs: the first checkpoint (1 MiB of model states)
    fills it. One line naming the file the disk refused, exit 2, error.txt written on the
    full disk, the steps' metrics whole, no checkpoint sealed, no summary."""
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    if not _mounts_a_tmpfs(disk):
        pytest.skip("cannot mount a tmpfs here (unshare -rm)")
    build_deepspeed_ops()
    overrides = [*DDP_ZERO2, "train.steps=4", "train.checkpoint_every=2", "logger=none", f"hydra.run.dir={disk}/run"]
    script = (
        f"mount -t tmpfs -o size=256k tmpfs {disk} && {sys.executable} -m src.run {' '.join(overrides)}; "
        f"code=$?; cp -r {disk}/run {kept}; exit $code"
    )
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=600
    )
    print(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    refused = rf"error: rank \d: WriteError: cannot write {re.escape(str(disk))}/run/checkpoint/step2/\S+\.pt: "
    assert re.fullmatch(refused + r"No space left on device \(errno 28, ENOSPC\)", line), line
    assert (kept / "error.txt").read_text() == line.removeprefix("error: ") + "\n"
    steps = [json.loads(record) for record in (kept / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in steps] == [0, 1]
    assert not (kept / "checkpoint" / "latest").exists() and not (kept / "summary.json").exists()
