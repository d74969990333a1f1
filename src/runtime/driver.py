"""The local driver: start N worker processes on this machine, watch them, tear down.

Workers rendezvous through the environment (MASTER_ADDR/PORT on localhost), exactly as
under torchrun. If one fails, the others are stopped at once and its error line is
raised; Ctrl-C stops every worker. Each worker runs in its own session so that stopping
it stops whatever it started.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from src.runtime.errors import WorkerFailure
from src.runtime.worker import ERRORS_DIR, JOB_FILE

POLL_S = 0.1
KILL_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, world: int, port: int, backend: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(backend["threads_per_worker"])})
    return env


def launch(run_dirs: list[Path], world: int, backend: dict[str, Any], jobs: list[dict[str, Any]]) -> None:
    """Run `world` workers on this machine until all finish (over each run directory in
    turn); raise WorkerFailure if one fails."""
    for run_dir, job in zip(run_dirs, jobs):
        (run_dir / JOB_FILE).write_text(json.dumps(job))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "src.runtime.worker", *map(str, run_dirs)],
                              env=worker_env(r, world, port, backend), start_new_session=True)
             for r in range(world)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                stop(procs)
                raise WorkerFailure(_error_line(run_dirs, failed[0], codes[failed[0]]))
            if all(c == 0 for c in codes):
                return
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        stop(procs)
        raise


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live worker's process group, SIGKILL what is left after a grace."""
    for proc in procs:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _error_line(run_dirs: list[Path], rank: int, code: int) -> str:
    for run_dir in run_dirs:
        path = run_dir / ERRORS_DIR / f"rank{rank}.txt"
        if path.exists():
            return path.read_text().strip()
    return f"rank {rank}: worker exited with code {code}"
