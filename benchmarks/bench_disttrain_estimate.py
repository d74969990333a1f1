"""Benchmark: how close DistTrain's estimate of its own pick comes to the simulated time,
on every configuration of DistTrain Figs. 15 and 17 (the presets' DistTrain series, run
as the figures run them). Target: within 5 % on each.

The estimate (src/strategies/disttrain/timing.py) times the chosen plan's stages operation
by operation against the batch's loads; the simulator runs the plan's Program. Planning
time is printed as CPU time (time.process_time) beside wall time.

    python benchmarks/bench_disttrain_estimate.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import composed
from src.setup import plan_run, validate
from src.sweep import figure_jobs, load_sweep

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"
FIGURES = ("disttrain_fig15_overall", "disttrain_fig17_orchestration")
TARGET = 0.05


def main() -> None:
    columns = ("estimate (s)", "simulated (s)", "error", "wall (s)", "cpu (s)")
    print(f"{'figure':<32s} {'configuration':<22s} " + " ".join(f"{c:>13s}" for c in columns))
    worst = 0.0
    for figure in FIGURES:
        spec = load_sweep(SWEEPS / f"{figure}.yaml")
        for job in figure_jobs(spec):
            if job.series != "disttrain":
                continue
            wall, cpu = time.perf_counter(), time.process_time()
            details = plan_run(validate(composed(list(job.overrides)))).details
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            estimate, simulated = details["estimate_s"], details["simulated_s"]
            error = estimate / simulated - 1
            worst = max(worst, abs(error))
            numbers = (f"{estimate:.3f}", f"{simulated:.3f}", f"{100 * error:+.1f} %", f"{wall:.1f}", f"{cpu:.1f}")
            print(f"{figure:<32s} {job.group:<22s} " + " ".join(f"{n:>13s}" for n in numbers))
    verdict = "met" if worst <= TARGET else "not met"
    print(f"largest |estimate / simulated - 1|: {100 * worst:.1f} % (target <= {100 * TARGET:.0f} %): {verdict}")


if __name__ == "__main__":
    main()
