"""Benchmark: time from the command to the first training step of a tiny real run.

    python benchmarks/bench_startup.py [--runs 5] [hydra overrides]

Each run is the front door as a user types it (`python -m src.run backend=torch
cluster=local model=clip model.scale=tiny strategy=ddp ...`, 4 CPU workers): the clock
starts before the process does and stops when its first `step 0` line arrives (driver,
config, plan, worker start, process groups, model and engine build, the first step
itself). Prints every run, the median and the 1-minute load average. Target on the
2-core development machine: <= 8 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ["backend=torch", "cluster=local", "model=clip", "model.scale=tiny", "strategy=ddp", "train.steps=2", "logger=none"]


def time_to_first_step(overrides: list[str], run_dir: Path) -> float:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "src.run", *RUN, *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None, "stdout is piped"
    first = None
    tail: list[str] = []
    for line in process.stdout:
        tail = (tail + [line.rstrip()])[-5:]
        if first is None and line.startswith("step 0"):
            first = time.perf_counter() - start
    if process.wait() != 0 or first is None:
        raise SystemExit("the run failed or printed no step line:\n" + "\n".join(tail))
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args, overrides = parser.parse_known_args()
    if args.runs < 1:
        raise SystemExit(f"--runs={args.runs}: at least 1")
    times = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.runs):
            times.append(time_to_first_step(overrides, Path(scratch) / f"run{i}"))
            print(f"run {i}: first step at {times[-1]:.2f} s", flush=True)
    print(f"median {statistics.median(times):.2f} s over {args.runs} runs (target <= 8 s); load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
