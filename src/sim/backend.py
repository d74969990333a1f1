"""The simulator as a backend: price one iteration of the plan's Program, report it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from src.metrics import summarize
from src.report import open_sinks
from src.sim.engine import simulate

if TYPE_CHECKING:
    from src.plan_io import PlannedRun, RunSettings


def run_sim(planned: PlannedRun, settings: RunSettings, run_dir: Path) -> dict[str, Any]:
    plan = planned.plan
    timeline = simulate(plan.program, planned.model, planned.cluster, plan.precision)
    summary = summarize(planned, timeline)
    with open_sinks(run_dir, settings.record, settings.job) as sinks:
        sinks.log_step({"step": 0, "iteration_time_s": summary["iteration_time_s"], "mfu": summary["mfu"]})
        sinks.finish(summary, timeline)
    return summary
