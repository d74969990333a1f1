"""The real backend behind the front door: check the plan fits the local workers, start
the workers (which report to the run directory's sinks themselves, so the same worker
entry also reports under torchrun), return the summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from src.errors import ConfigError
from src.program import Plan
from src.report import JobInfo
from src.report.files import SUMMARY_FILE
from src.runtime.checks import check_runnable
from src.runtime.driver import launch

if TYPE_CHECKING:
    from src.setup import Setup


def check_workers(plan: Plan, backend: dict[str, Any]) -> None:
    workers = backend.get("workers")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
        raise ConfigError(f"backend.workers must be a positive integer, got {workers!r}")
    if plan.devices > workers:
        raise ConfigError(f"the {plan.strategy} plan needs {plan.devices} workers but backend.workers={workers}")


def run_torch(setup: Setup, plan: Plan, run_dir: Path, job: JobInfo) -> dict[str, Any]:
    """Start the local workers (each builds DeepSpeed's op on its node's first rank) and
    return the summary rank 0 wrote."""
    backend = setup.config["backend"]
    check_runnable(setup, plan)
    check_workers(plan, backend)
    launch(
        [run_dir],
        plan.devices,
        backend,
        [{"run_name": job.run_name, "sweep_name": job.sweep_name, "override_dirname": job.override_dirname}],
    )
    return json.loads((run_dir / SUMMARY_FILE).read_text())
