"""Helpers of the runtime tests (no tests here): compose a run's config as the front door would,
and the DeepSpeed op build that must happen once before any workers start."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch.multiprocessing as mp

from src.config import DeepSpeedSpec, OptimizerSpec, TorchBackendSpec  # noqa: F401 (the runtime tests' import)
from src.runtime.driver import preloaded_forkserver
from tests.composing import composed
from tests.conftest import REPO_ROOT, cli_env

# Two tiny CPU workers: what CI's 2 cores can run.
TWO_WORKERS = ["backend=torch", "cluster=local", "cluster.devices_per_node=2", "logger=none"]
CLIP = ["model=clip", "model.scale=tiny", "train.global_batch=8"]
GPT = [
    "model=gpt",
    "model.preset=null",
    "model.layers=4",
    "model.hidden=64",
    "model.heads=4",
    "model.vocab=128",
    "train.seq_len=16",
    "train.global_batch=8",
]
# Par4D's ADM U-Net at its smallest: two levels of one residual block on 8x8 images,
# self-attention at 4x4 (0.76M parameters).
TINY_UNET = {"channels": 32, "image_size": 8, "channel_mult": [1, 2], "res_blocks": 1, "attention_resolutions": [4], "heads": 2}
UNET = ["model=unet", "model.preset=null", "train.global_batch=8"] + [
    f"model.{key}={str(value).replace(' ', '')}" for key, value in TINY_UNET.items()
]


def sensitive(lr: float = 1.0) -> list[str]:
    """Overrides that make each update proportional to its gradients (AdamW with eps=1, the
    loss-equality tests': a gradient off by a rounding error moves the next loss visibly)."""
    return [f"backend.deepspeed.optimizer.params.lr={lr}", "backend.deepspeed.optimizer.params.eps=1.0"]


def sensitive_optimizer(lr: float = 1.0) -> DeepSpeedSpec:
    """The reference's optimizer under sensitive(lr)."""
    return DeepSpeedSpec(optimizer=OptimizerSpec(lr=lr, eps=1.0))


def prepare_run_dir(run_dir: Path, overrides: list[str]) -> TorchBackendSpec:
    """What the front door does before it starts workers: validate, plan, refuse what the
    real backend cannot run, write resolved.yaml, plan.json and run.json."""
    from src.report import JobInfo
    from src.runtime.backend import ready
    from src.setup import options_named, prepare_run, start_run_dir, write_run_dir

    config = composed(overrides)
    start_run_dir(config, run_dir)
    planned, settings = prepare_run(config, JobInfo(run_name=run_dir.name))
    write_run_dir(run_dir, planned, settings)
    with options_named(planned.plan.strategy):
        return ready(planned, settings, run_dir)


def build_deepspeed_ops() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from src.runtime.op_build import prebuild_ops

    prebuild_ops()


def run_forked(worker: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`worker(rank, *args)` on `nprocs` processes until all end, as torch's `mp.spawn` runs
    it (a failure in one raised here, the others stopped), but forked from the local driver's
    forkserver, which has imported torch, DeepSpeed and our modules once (a spawned process
    imports them itself: seconds each on 2 cores). A plain fork would not do: a fork of a
    process whose OpenMP threads have run hangs in torch ops; the forkserver runs none."""
    preloaded_forkserver()  # the driver's: whichever starts the forkserver, it serves both
    mp.start_processes(worker, args=args, nprocs=nprocs, start_method="forkserver")


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def trace_events(run_dir: Path) -> list[dict]:
    """The events of a run's trace.json (a list, or an object holding them)."""
    trace = json.loads((run_dir / "trace.json").read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def with_a_peak(overrides: list[str]) -> list[str]:
    """`overrides`, with the cluster given a peak in the run's precision where it has none:
    the local preset's own figures (a host `src.calibrate` has not profiled) have no fp16
    peak, and a run is refused a precision without one. The stand-in, its fp32 peak, prices
    the plan and the MFU, which the real runs' tests do not read."""
    from src.cluster import cluster_from_config

    config = composed(overrides)
    peaks = cluster_from_config(config["cluster"]).peak_flops
    precision = config["train"]["precision"]
    return overrides if precision in peaks else [*overrides, f"+cluster.peak_flops.{precision}={peaks['fp32']}"]


def launch_cases(root: Path, cases: dict[str, list[str]], workers: int) -> dict[str, Path]:
    """Each case's run directory, checked as the front door checks it, all run in ONE
    launch of `workers` workers (starting workers costs more than a tiny run)."""
    from src.runtime.driver import launch

    build_deepspeed_ops()
    dirs = {name: root / name for name in cases}
    for name, overrides in cases.items():
        backend = prepare_run_dir(dirs[name], with_a_peak(overrides))
    start = time.monotonic()
    launch(list(dirs.values()), workers, backend)
    print(f"{len(dirs)} real runs in {time.monotonic() - start:.1f} s")
    return dirs


def mllm_shard(path: Path, images: list[int]) -> None:
    """A tar shard of an MLLM's samples: sample i is `s<i>.txt` and images[i] PNG images
    `s<i>.<k>.png` (none: text only)."""
    import io
    import tarfile

    from PIL import Image

    def png(i: int, k: int) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (16, 16), (30 * i % 256, 60 * k % 256, 200)).save(buffer, format="PNG")
        return buffer.getvalue()

    with tarfile.open(path, "w") as tar:
        for i, count in enumerate(images):
            members = [(f"s{i:03d}.{k}.png", png(i, k)) for k in range(count)] + [(f"s{i:03d}.txt", f"caption {i}".encode())]
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, name) of every process."""
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,comm="], capture_output=True, text=True).stdout.splitlines()
    return {int(pid): (int(parent), comm.strip()) for pid, parent, comm in (row.split(None, 2) for row in rows)}


def descendants(pid: int, processes: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """pid -> name of every process below `pid` (a front door's forkserver, its workers
    forked from it, or its children)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for child, (parent, comm) in (processes or _processes()).items():
        children.setdefault(parent, []).append((child, comm))
    found, todo = {}, [pid]
    while todo:
        for child, comm in children.get(todo.pop(), []):
            found[child] = comm
            todo.append(child)
    return found


def workers_of(door_pid: int) -> dict[int, int]:
    """rank -> pid of the workers a front door started (named mmdist-rank<r>), not of a
    process a worker forks, which carries the worker's name until it execs (a resource
    tracker caught before its exec would be taken for the worker, and outlives it briefly)."""
    processes = _processes()
    found = descendants(door_pid, processes)
    return {
        int(comm.removeprefix("mmdist-rank")): pid
        for pid, comm in found.items()
        if comm.startswith("mmdist-rank") and not found.get(processes[pid][0], "").startswith("mmdist-rank")
    }


def alive(pid: int) -> bool:
    return bool(still_alive([pid]))


def still_alive(pids: Iterable[int]) -> dict[int, str]:
    """pid -> its name, state and parent, of each of `pids` not yet exited (a zombie has):
    what an assertion that they were stopped shows when one was not."""
    found = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # gone before or while it was read
            continue
        head, rest = stat.rsplit(") ", 1)  # the name, in parentheses, may hold ") " itself
        state, parent = rest.split()[:2]
        if state != "Z":
            found[pid] = f"{head.split(' (', 1)[1]} state {state} parent {parent}"
    return found


def start_door(run_dir: Path, overrides: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """The front door in a session of its own, as Ctrl-C in a terminal reaches it: SIGINT
    to its whole process group (`env`: variables of its own). The child restores Python's
    SIGINT handler in case this test runs where SIGINT is ignored."""
    build_deepspeed_ops()
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['src.run'] + sys.argv[1:]; runpy.run_module('src.run', run_name='__main__')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", start, *overrides, "logger=none", f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT,
        env={**cli_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(door: subprocess.Popen, ready: Callable[[], bool], what: str, timeout_s: float = 600) -> None:
    """Until `ready()`; the door and all it started killed if it ends or takes too long."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if door.poll() is not None or time.monotonic() > deadline:
            kill_all(door)
            raise AssertionError(f"the run never got to {what}: {door.stderr.read() if door.stderr else ''}"[-2000:])
        time.sleep(0.1)


def door_at_its_first_step(run_dir: Path, overrides: list[str]) -> tuple[subprocess.Popen, dict[int, int]]:
    """The front door on a run of many steps, once its workers train, and their pids by rank."""
    door = start_door(run_dir, [*overrides, "train.steps=100000"])
    metrics = run_dir / "metrics.jsonl"
    wait_for(door, lambda: metrics.exists() and '"step"' in metrics.read_text(), "its first step")
    workers = workers_of(door.pid)
    assert len(workers) > 1, workers
    return door, workers


def kill_all(door: subprocess.Popen, also: Iterable[int] = ()) -> None:
    """SIGKILL the door and every process below it, and `also` (a worker leads its own
    session, and a killed door's processes are no longer below it: a test lists them first)."""
    for pid in [door.pid, *descendants(door.pid), *also]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    door.wait()
    for pipe in (door.stdout, door.stderr):
        if pipe is not None:
            pipe.close()


def finish(door: subprocess.Popen, timeout_s: float = 60) -> str:
    """The door's stderr once it exits; everything it started killed if it does not."""
    try:
        _, stderr = door.communicate(timeout=timeout_s)
    finally:
        if door.poll() is None:
            kill_all(door)
    return stderr
