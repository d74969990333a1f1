"""The local driver: start N worker processes on this machine, watch them, tear down.

Workers rendezvous through the environment (MASTER_ADDR/PORT on localhost), exactly as
under torchrun. CPU (gloo) workers are forked from a forkserver that imported torch and
DeepSpeed once (src/runtime/preload.py): on a few cores, each worker importing them
itself costs seconds of start-up. GPU workers start as fresh processes (`python -m
src.runtime.worker`), since CUDA must not be touched in a process that forks.
If one worker fails, the others are stopped at once and the error line of the rank that
failed first is raised (its peers' failures are consequences); Ctrl-C stops every
worker. Each worker runs in its own session so that stopping it stops whatever it started.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from src.config import TorchBackendSpec
from src.runtime.errors import WorkerFailure
from src.runtime.worker import ERRORS_DIR

POLL_S = 0.1
KILL_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, world: int, port: int, backend: TorchBackendSpec) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(backend.threads_per_worker),
        }
    )
    return env


class ForkedWorker:
    """A worker forked from the preloaded forkserver, with the Popen calls the driver uses."""

    def __init__(self, run_dirs: list[Path], env: dict[str, str]) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["src.runtime.preload"])
        self._process = context.Process(target=_forked_worker, args=(run_dirs, env), daemon=False)
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("worker", timeout or 0.0)
        return self._process.exitcode


def _forked_worker(run_dirs: list[Path], env: dict[str, str]) -> None:
    """In the child: the process a fresh `python -m src.runtime.worker` would be (its own
    session, the worker's environment, default signal handling), then the worker."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    from src.runtime.worker import main

    sys.exit(main(run_dirs))


def _cpu_workers(backend: TorchBackendSpec) -> bool:
    """Whether the workers will run gloo on CPUs, told without importing torch here: with
    dist_backend=auto, a machine without an NVIDIA or AMD GPU driver has no CUDA device."""
    requested = backend.dist_backend
    if requested != "auto":
        return requested == "gloo"
    return not any(os.path.exists(path) for path in ("/proc/driver/nvidia/gpus", "/dev/kfd"))


def start_worker(run_dirs: list[Path], env: dict[str, str], backend: TorchBackendSpec) -> ForkedWorker | subprocess.Popen:
    if _cpu_workers(backend):
        return ForkedWorker(run_dirs, env)
    return subprocess.Popen([sys.executable, "-m", "src.runtime.worker", *map(str, run_dirs)], env=env, start_new_session=True)


def launch(run_dirs: list[Path], world: int, backend: TorchBackendSpec) -> None:
    """Run `world` workers on this machine until all finish (over each run directory in
    turn, as its plan.json and run.json say); raise WorkerFailure if one fails."""
    port = free_port()
    procs = [start_worker(run_dirs, worker_env(r, world, port, backend), backend) for r in range(world)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                stop(procs)
                raise WorkerFailure(_first_failure(run_dirs, codes))
            if all(c == 0 for c in codes):
                return
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        stop(procs)
        raise


def stop(procs: list[ForkedWorker | subprocess.Popen]) -> None:
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


def _signal(proc: ForkedWorker | subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _first_failure(run_dirs: list[Path], codes: list[int | None]) -> str:
    """The error line of the rank that failed first, from the exit codes seen before the
    driver stopped anyone. A worker killed by a signal wrote nothing, and its peers fail
    on the broken connection after it: it comes first. Else the earliest error file (a
    worker writes its line as it fails)."""
    for rank, code in enumerate(codes):
        if code is not None and code < 0 and _error_file(run_dirs, rank) is None:
            return f"rank {rank}: worker killed by signal {signal.Signals(-code).name} (exit code {code})"
    written = [(path.stat().st_mtime, rank, path) for rank in range(len(codes)) if (path := _error_file(run_dirs, rank)) is not None]
    if written:
        return min(written)[2].read_text().strip()
    rank = next(r for r, c in enumerate(codes) if c not in (None, 0))
    return f"rank {rank}: worker exited with code {codes[rank]}"


def _error_file(run_dirs: list[Path], rank: int) -> Path | None:
    for run_dir in run_dirs:
        path = run_dir / ERRORS_DIR / f"rank{rank}.txt"
        if path.exists():
            return path
    return None
