"""The local driver: start N worker processes on this machine, watch them, tear down.

Workers rendezvous through the environment (MASTER_ADDR/PORT on localhost), exactly as
under torchrun. CPU (gloo) workers are forked from a forkserver that imported torch and
DeepSpeed once (src/runtime/preload.py): on a few cores, each worker importing them
itself costs seconds of start-up. GPU workers start as fresh processes (`python -m
src.runtime.worker`), since CUDA must not be touched in a process that forks.
Each worker runs in its own session so that stopping it stops whatever it started.

Before the first worker starts, the door builds DeepSpeed's CPU op if this environment
has none yet (runtime.op_build: minutes, once), saying what the build does; then it says
how the workers' start goes (the forkserver's imports, the ranks joining) until every rank
trains.

What ends a run early, and the one line it ends with:
- a worker fails: the others are stopped at once, and the error line of the rank that
  failed first is raised (its peers' failures are consequences; their tracebacks are in
  their log files, errors/rank<r>.log). The line comes through the heartbeat board
  (runtime.lifeline), which needs no disk space;
- a rank stops making progress (runtime.lifeline: its heartbeat stops, e.g. SIGSTOP):
  after a third of backend.timeout_s (at least STALL_BEATS beats), before any peer's collective times out, it is named
  with its last instruction and every worker is stopped;
- Ctrl-C, or SIGTERM to the front door: every worker is stopped, and the door says where
  the run was (Terminated, exit code 130 or 143), in whatever phase: the op build, the
  workers' start, a step, their teardown;
- SIGKILL to the front door: each worker sees its door die (runtime.lifeline), writes
  error.txt and kills itself within a beat, and the forkserver leaves with its parent.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from src.config import TorchBackendSpec
from src.plan_io import read_plan
from src.progress import heartbeat
from src.program import Collective, Compute, Instruction, Recv, Send, Wait
from src.report.files import SUMMARY_FILE
from src.runtime.errors import Terminated, TerminateSignal, WorkerFailure, signal_line
from src.runtime.lifeline import BEAT_S, BOARD_ENV, DOOR_ENV, DONE, TRAINING, Beat, Board
from src.runtime.op_build import build_in_door, lock_wait
from src.runtime.processes import descendants, signals_end_the_run
from src.runtime.worker import ERRORS_DIR

POLL_S = 0.1
KILL_GRACE_S = 2.0  # SIGTERM ends a worker at once (its default action): a grace for what it started
BOARD_FILE = ".lifeline"  # the workers' heartbeats, in the first run directory while they run
STALL_SHARE = 1 / 3  # of backend.timeout_s: a rank silent this long is named before a peer's collective times out
STALL_BEATS = 4  # and at least this many missed beats: a tiny backend.timeout_s must not name a rank between two beats
STALE_S = 5.0  # a live rank silent this long when a peer fails is named first: its peers failed waiting on it


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_SPAN = 16384  # how far below the ephemeral range a rendezvous port is drawn


def free_port() -> int:
    """A port nothing holds now for the workers' rendezvous, which rank 0 binds seconds
    later: drawn below the kernel's ephemeral range, because the ports connections take for
    themselves (every pair of gloo workers', another run's) come from that range, and one of
    them taken there in between fails the start (EADDRINUSE). Where the range is not known,
    or nothing below it is free, the kernel's pick."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    draw = random.SystemRandom()
    for _ in range(64 if low > 1024 else 0):
        port = draw.randrange(max(1024, low - PORT_SPAN), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


def preloaded_forkserver() -> multiprocessing.context.ForkServerContext:
    """The forkserver context whose server imports torch, DeepSpeed and our modules once
    (src/runtime/preload.py) before it forks any worker."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["src.runtime.preload"])
    return context


class ForkedWorker:
    """A worker forked from the preloaded forkserver, with the Popen calls the driver uses."""

    def __init__(self, run_dirs: list[Path], env: dict[str, str]) -> None:
        context = preloaded_forkserver()
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
    turn, as its plan.json and run.json say); raise WorkerFailure if one fails or stalls,
    Terminated on SIGTERM or Ctrl-C."""
    port = free_port()
    procs: list[ForkedWorker | subprocess.Popen] = []
    with signals_end_the_run():
        board = Board(run_dirs[0] / BOARD_FILE, world)
        try:
            if _cpu_workers(backend):
                build_in_door()  # before the forkserver, which loads it: its build is said and stopped here
            lifeline = {BOARD_ENV: str(board.path), DOOR_ENV: str(os.getpid())}
            with heartbeat(f"starting {world} workers", at_once=True, detail=lambda: _starting(board, procs)):
                for rank in range(world):
                    procs.append(start_worker(run_dirs, {**worker_env(rank, world, port, backend), **lifeline}, backend))
                started = time.monotonic_ns()  # a rank not beating yet counts from here: the forkserver's imports are behind it
                _wait_until_training(procs, run_dirs, board, started, backend)
            _watch(procs, run_dirs, board, started, backend)
        except (KeyboardInterrupt, TerminateSignal) as signalled:
            stop(procs)
            # The board knows better than the door's heartbeat: ranks may train before the
            # door has seen them all start.
            how, signum = signal_line(signalled, _doing(board, procs), known=_in_step(board))
            stopped = f"all {world} workers stopped" if procs else "no worker had started"
            # Their teardown: the run's results are whole (rank 0 writes summary.json last).
            written = all((run_dir / SUMMARY_FILE).exists() for run_dir in run_dirs)
            results = "its results written" if written else "no results written"
            raise Terminated(f"{how}: {stopped}, {results}", signum, written) from None
        finally:
            board.close()


def _starting(board: Board, procs: list) -> str:
    """How the workers' start goes, for its progress lines."""
    if len(procs) < board.world:
        waiting = lock_wait(list(descendants()))
        return f"the forkserver {waiting or 'imports torch and DeepSpeed'} ({len(procs)} of {board.world} workers forked)"
    states = [board.read(rank).state for rank in range(board.world)]
    joined = sum(state >= TRAINING for state in states)
    return f"{joined} of {board.world} ranks training; the others join the group and build their units"


def _wait_until_training(procs: list, run_dirs: list[Path], board: Board, started: int, backend: TorchBackendSpec) -> None:
    """Watch the workers until every rank trains (or has finished): the start's progress."""
    while not all(board.read(rank).state >= TRAINING for rank in range(board.world)):
        if _check(procs, run_dirs, board, started, backend):
            return
        time.sleep(POLL_S)


def _watch(procs: list, run_dirs: list[Path], board: Board, started: int, backend: TorchBackendSpec) -> None:
    while not _check(procs, run_dirs, board, started, backend):
        time.sleep(POLL_S)


def _check(procs: list, run_dirs: list[Path], board: Board, started: int, backend: TorchBackendSpec) -> bool:
    """True once every worker finished; WorkerFailure (all stopped) if one failed or stalls."""
    codes = [p.poll() for p in procs]
    if any(c not in (None, 0) for c in codes):
        stalled = _stalled(procs, board, started, int(STALE_S * 1e9))
        stop(procs)
        raise WorkerFailure(_stall_line(run_dirs, *stalled, backend) if stalled else _first_failure(run_dirs, board, codes))
    if all(c == 0 for c in codes):
        return True
    stalled = _stalled(procs, board, started, int(max(backend.timeout_s * STALL_SHARE, STALL_BEATS * BEAT_S) * 1e9))
    if stalled:
        stop(procs)
        raise WorkerFailure(_stall_line(run_dirs, *stalled, backend))
    return False


def _stalled(procs: list, board: Board, started: int, limit_ns: int) -> tuple[int, Beat, float] | None:
    """(rank, its slot, seconds silent) of the live rank whose heartbeat is the oldest,
    if it is older than `limit_ns`; a rank not beating yet counts from the launch."""
    now = time.monotonic_ns()
    silent = []
    for rank, proc in enumerate(procs):
        beat = board.read(rank)
        if proc.poll() is None and beat.state != DONE:
            silent.append((now - (beat.time_ns or started), rank, beat))
    if not silent:
        return None
    age, rank, beat = max(silent, key=lambda entry: entry[0])
    return (rank, beat, age / 1e9) if age > limit_ns else None


def _stall_line(run_dirs: list[Path], rank: int, beat: Beat, silent_s: float, backend: TorchBackendSpec) -> str:
    line = f"rank {rank} stopped making progress: no heartbeat for {silent_s:.1f} s (backend.timeout_s={backend.timeout_s:g})"
    line += f" while {beat.doing()}"
    if beat.state == TRAINING and beat.instruction >= 0:
        instructions = read_plan(run_dirs[beat.run]).plan.program.class_of(rank).instructions
        line += f" of {len(instructions)} ({describe(instructions[beat.instruction])})"
    return line + "; all workers stopped"


def describe(instruction: Instruction) -> str:
    """An instruction in a few words, for a line that names where a rank stopped."""
    if isinstance(instruction, Compute):
        work = instruction.work
        return f"{work.phase} of {work.unit} layers {work.layers[0]}-{work.layers[1] - 1}, micro-batch {instruction.microbatch}"
    if isinstance(instruction, Collective):
        return f"{instruction.op} on group {instruction.group}"
    if isinstance(instruction, Send):
        return f"send {instruction.payload} on route {instruction.route}"
    if isinstance(instruction, Recv):
        return f"receive {instruction.payload} on route {instruction.route}"
    assert isinstance(instruction, Wait), "the five instruction kinds"
    return f"wait for {instruction.handle}"


def _in_step(board: Board) -> str | None:
    """'in step 3' (the furthest training rank's); None where no rank trains."""
    steps = [b.step for b in (board.read(rank) for rank in range(board.world)) if b.state == TRAINING]
    return f"in step {max(steps)}" if steps else None


def _doing(board: Board, procs: list) -> str:
    """'in step 3' (the furthest rank's), or what the workers were doing."""
    in_step = _in_step(board)
    if in_step:
        return in_step
    if not procs:
        return "starting its workers"
    beats = [board.read(rank) for rank in range(board.world)]
    return f"its workers were {max(beats, key=lambda b: b.state).doing()}"


def stop(procs: Sequence[ForkedWorker | subprocess.Popen]) -> None:
    """SIGTERM every live worker's process group, SIGKILL what is left after a grace. A
    stopped worker (SIGSTOP) is continued, so that it takes its SIGTERM now."""
    for proc in procs:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM)
            _signal(proc, signal.SIGCONT)
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


def _first_failure(run_dirs: list[Path], board: Board, codes: list[int | None]) -> str:
    """The error line of the rank that failed first, from the exit codes seen before the
    driver stopped anyone. A worker killed by a signal wrote nothing, and its peers fail
    on the broken connection after it: it comes first. Else the earliest line on the board
    (a worker writes its line as it fails, before it leaves the process group whose closed
    connections its peers then fail on), with where its traceback is, if it is a failure
    of the run and its log could be written."""
    lines = {rank: written for rank in range(len(codes)) if (written := board.error_line(rank)) is not None}
    for rank, code in enumerate(codes):
        if code is not None and code < 0 and rank not in lines:
            return f"rank {rank}: worker killed by signal {signal.Signals(-code).name} (exit code {code})"
    if lines:
        rank = min(lines, key=lambda r: lines[r][0])
        line = lines[rank][1]
        traces = [trace for run_dir in run_dirs if (trace := run_dir / ERRORS_DIR / f"rank{rank}.log").exists()]
        return line if WorkerFailure(line).exit_code == 2 or not traces else f"{line} (traceback: {traces[0]})"
    rank = next(r for r, c in enumerate(codes) if c not in (None, 0))
    return f"rank {rank}: worker exited with code {codes[rank]}"
