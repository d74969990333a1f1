"""The worker entry: `python -m src.runtime.worker RUN_DIR [RUN_DIR ...]`.

It reads the plan the door wrote, RUN_DIR/plan.json, and how to run it, RUN_DIR/run.json
(src/plan_io; it never plans, never runs Hydra), and its rank from the environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), as both the local driver and
torchrun set them, so it runs unchanged under torchrun or srun on several nodes (see
launchers/; src/prepare.py writes the run directory there). A plan file that is
missing, truncated, of another version or for another world size is one line and exit
code 2 before any process group forms. A failure after that is one line for the driver to
report, on the heartbeat board (runtime.lifeline: no disk space needed), in
RUN_DIR/errors/rank<r>.txt and on stderr under a launcher (which reports none), and its
traceback in RUN_DIR/errors/rank<r>.log, as far as the disk lets them be written; a write
the disk refused (full, read-only, failing, past `ulimit -f`) is a WriteError naming the
file. The process group is destroyed on every exit (gloo aborts a process that exits with
one alive). Under the local driver a worker beats, says where it is and dies with the
front door (runtime.lifeline).
Several run directories (same world size) run back to back in one process group, paying
the start-up (imports, rendezvous) once: small sweeps and the tests use this. A worker is
named `mmdist-rank<r>` in ps and pgrep.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

from src.errors import ConfigError
from src.plan_io import PlannedRun, RunSettings, read_plan, read_settings
from src.report.files import WriteError
from src.runtime.lifeline import DONE, LIFELINE, attach_from_env
from src.write_failures import describe, is_write_failure

ERRORS_DIR = "errors"


def dist_backend(requested: str) -> str:
    import torch

    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def name_process(rank: int) -> None:
    """`mmdist-rank<r>` in ps/top/pgrep (Linux), however the worker was started (forked
    workers share their forkserver's command line)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_NAME = 15
        ctypes.CDLL(None).prctl(PR_SET_NAME, f"mmdist-rank{rank}".encode()[:15], 0, 0, 0)


def load(run_dirs: list[Path], world: int) -> list[tuple[PlannedRun, RunSettings]]:
    """Each run directory's plan and settings, for `world` workers (ConfigError if not)."""
    runs = []
    for run_dir in run_dirs:
        settings = read_settings(run_dir)
        if settings.torch is None:
            raise ConfigError(f"{run_dir}: run.json is a backend={settings.backend} run's; workers run backend=torch")
        runs.append((read_plan(run_dir, world), settings))
    return runs


def main(run_dirs: list[Path]) -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    name_process(rank)
    attach_from_env(rank)
    try:
        runs = load(run_dirs, world)
    except ConfigError as err:  # before any process group: the launcher's peers fail the same way
        LIFELINE.failed(f"rank {rank}: {type(err).__name__}: {err}")
        if not LIFELINE.attached:
            print(f"error: rank {rank}: {err}", file=sys.stderr, flush=True)
        return 2
    run_dir = run_dirs[0]
    LIFELINE.start_run(0, run_dir)
    try:
        backend = runs[0][1].torch
        assert backend is not None
        import torch
        import torch.distributed as dist

        name = dist_backend(backend.dist_backend)
        if name != "nccl":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed's first import: no accelerator probe
        torch.set_num_threads(backend.threads_per_worker)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        from src.runtime.engines import prebuild_ops
        from src.runtime.session import run_session

        if name != "nccl":
            # DeepSpeed's CPU communication op, before joining the group: a first build
            # outlasts any collective's timeout.
            prebuild_ops()
        dist.init_process_group(name, timeout=timedelta(seconds=backend.timeout_s))
        for index, (run_dir, (planned, settings)) in enumerate(zip(run_dirs, runs)):
            LIFELINE.start_run(index, run_dir)
            run_session(planned, settings, run_dir, rank, world)
        # gloo aborts a process whose peers tear down while its last sends are still
        # in flight ("terminate called without an active exception"): leave together.
        dist.barrier()
    except KeyboardInterrupt:
        return 130
    except BaseException as err:  # one line for the driver; the traceback for whoever reads the log
        _report(run_dir, rank, err)
        return 1
    finally:
        # Left only now, after any error is written: leaving closes the connections the
        # peers then fail on, and the driver names the earliest error written.
        _leave_group()
        LIFELINE.state(DONE)
    return 0


def error_line(rank: int, err: BaseException) -> str:
    """'rank 1: DataError: ...'; a write the disk refused, wherever it was made (ours, torch's,
    DeepSpeed's), as the WriteError naming its file: the first one, where closing the
    run's files on the way out failed again."""
    failures = [e for e in _chain(err) if isinstance(e, WriteError) or is_write_failure(e)]
    if failures:
        first = failures[-1]
        assert isinstance(first, OSError)
        return f"rank {rank}: {WriteError.__name__}: {first if isinstance(first, WriteError) else describe(first)}"
    text = str(err)
    return f"rank {rank}: {type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from or while handling."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _report(run_dir: Path, rank: int, err: BaseException) -> None:
    """The error line on the board first (it needs no disk space), then in files as far as
    the disk allows; never an exception of its own (it would print a traceback)."""
    line = error_line(rank, err)
    LIFELINE.failed(line)
    errors = run_dir / ERRORS_DIR
    for name, text in ((f"rank{rank}.log", traceback.format_exc()), (f"rank{rank}.txt", line + "\n")):
        try:
            errors.mkdir(exist_ok=True)
            (errors / name).write_text(text)
        except OSError:
            with contextlib.suppress(OSError):
                (errors / name).unlink(missing_ok=True)  # an empty or cut one would mislead
    if not LIFELINE.attached:  # the local driver reports the first failure; its peers' are consequences
        print(line, file=sys.stderr, flush=True)


def _leave_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer gone already: nothing left to leave cleanly
            dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m src.runtime.worker RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main([Path(arg) for arg in sys.argv[1:]]))
