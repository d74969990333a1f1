"""The simulator as a backend: price one iteration of the plan's Program, report it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from src.metrics import summarize
from src.program import Plan
from src.report import JobInfo, open_sinks
from src.sim.engine import simulate

if TYPE_CHECKING:
    from src.setup import Setup


def run_sim(setup: Setup, plan: Plan, run_dir: Path, job: JobInfo) -> dict[str, Any]:
    timeline = simulate(plan.program, setup.model, setup.cluster, setup.train.precision)
    summary = summarize(setup, plan, timeline)
    with open_sinks(run_dir, setup.config, job) as sinks:
        sinks.log_step({"step": 0, "iteration_time_s": summary["iteration_time_s"], "mfu": summary["mfu"]})
        sinks.finish(summary, timeline)
    return summary
