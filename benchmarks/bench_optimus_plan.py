"""Benchmark: Optimus's whole plan (LLM search over the memory ladder, every encoder plan's
bubble schedule, the emitted Program) and its simulation, on the clusters of the Optimus
performance targets, and `src.compare` on 128 DGX-A100 nodes (every contender, in parallel).

Targets (wall on a quiet machine): frontier <= 10 s, hopper with 192 nodes <= 8 s,
perlmutter <= 10 s, compare on 128 dgx_a100 nodes <= 15 s; and the whole command
(`python -m src.run model=optimus strategy=optimus cluster=C logger=none`: start-up, plan,
plan file, simulation, trace and reports) on frontier and perlmutter <= 10 s of CPU. CPU
time is printed beside wall time: on a loaded machine the wall figure alone would say "not
met" for a planner that meets its target. The load average is printed before and after;
"sim wall" is the simulation's share of a run's wall time (the rest is planning).

    python benchmarks/bench_optimus_plan.py [--no-compare] [--commands N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: this repository's src

from src.config import composed
from src.costmodel.compute import ComputeModel
from src.setup import plan_run, validate
from src.sim.engine import simulate

BASE = ["model=optimus", "strategy=optimus", "logger=none"]
# (label, overrides, target wall seconds)
RUNS = (
    ("frontier", ["cluster=frontier"], 10.0),
    ("hopper, 192 nodes", ["cluster=hopper", "cluster.nodes=192"], 8.0),
    ("perlmutter", ["cluster=perlmutter"], 10.0),
)
COMPARE = ["model=optimus", "cluster=dgx_a100", "cluster.nodes=128", "logger=none"]
COMPARE_TARGET_S = 15.0
# The whole command on the presets as they are: its CPU, plan file included.
COMMANDS = (("frontier", ["cluster=frontier"]), ("perlmutter", ["cluster=perlmutter"]))
COMMAND_TARGET_S = 10.0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def plan_and_simulate(overrides: list[str]) -> tuple[float, float, float, float, str]:
    """Wall time from the composed config to the simulated iteration, this process's CPU
    time and its workers' (the encoder plans scheduled in parallel), the simulation's
    share of the wall time, and the plan."""
    config = composed(BASE + overrides)
    wall, cpu, workers = time.perf_counter(), time.process_time(), children_cpu()
    setup = validate(config)
    plan = plan_run(setup)
    simulated = time.perf_counter()
    result = simulate(
        plan.program, setup.model, setup.cluster, setup.train.precision, ComputeModel(setup.cluster, setup.train.precision)
    )
    simulated = time.perf_counter() - simulated
    wall, cpu, workers = time.perf_counter() - wall, time.process_time() - cpu, children_cpu() - workers
    llm, enc = plan.details["llm"], plan.details["encoder"]
    what = (
        f"LLM tp{llm['tp']} pp{llm['pp']} dp{llm['dp']} vpp{llm['vpp']} mb{llm['micro_batch']} recompute={llm['recompute']} "
        f"zero={llm['zero_stage']}; encoder pp{enc['pp']} tp{enc['tp']}; {result.iteration_time:.3f} s/iteration"
    )
    return wall, cpu, workers, simulated, what


def timed_module(module: str, args: list[str]) -> tuple[float, float]:
    """`python -m MODULE ARGS` as a user types it (its files in a scratch run directory): its
    wall time and the CPU time of its process and the processes it starts."""
    before = children_cpu()
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={out}"], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - wall, children_cpu() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compare", action="store_true", help="skip the src.compare run")
    parser.add_argument("--commands", type=int, default=1, help="runs of each whole command (the least CPU is shown)")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # one run, in this process (as JSON)
    args = parser.parse_args()
    if args.run is not None:
        print(json.dumps(plan_and_simulate(RUNS[args.run][1])))
        return
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"{'run':<20s} {'wall (s)':>8s} {'cpu (s)':>8s} {'workers':>8s} {'sim wall':>8s} {'target':>7s}  plan")
    for index, (label, _, target) in enumerate(RUNS):
        # Each run in a fresh process, as `python -m src.run` plans it: none inherits the
        # heap (and the collector's work) the runs before it left.
        child = subprocess.run([sys.executable, __file__, "--run", str(index)], cwd=ROOT, check=True, capture_output=True, text=True)
        wall, cpu, workers, simulated, what = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"{label:<20s} {wall:8.2f} {cpu:8.2f} {workers:8.2f} {simulated:8.2f} {target:7.0f}  {what}")
    print(f"{'whole command':<20s} {'wall (s)':>8s} {'cpu (s)':>8s}  target: CPU (process and workers), least of {args.commands}")
    for label, overrides in COMMANDS:
        wall, cpu = min((timed_module("src.run", BASE + overrides) for _ in range(args.commands)), key=lambda run: run[1])
        print(f"{label:<20s} {wall:8.2f} {cpu:8.2f} {COMMAND_TARGET_S:7.0f}  python -m src.run {' '.join(BASE + overrides)}")
    if not args.no_compare:
        wall, cpu = timed_module("src.compare", COMPARE)
        print(
            f"{'compare dgx_a100 128':<20s} {wall:8.2f} {0.0:8.2f} {cpu:8.2f} {'':>8s} {COMPARE_TARGET_S:7.0f}  "
            "every contender, in parallel"
        )
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
