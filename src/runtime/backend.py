"""The real backend behind the front door: check the plan fits the local workers, write
how the workers run it (run.json, beside the door's plan.json), start the workers (which
report to the run directory's sinks themselves, so the same worker entry also reports
under torchrun), return the summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from src.config import TorchBackendSpec
from src.errors import ConfigError
from src.plan_io import PlannedRun, RunSettings, settings_record, write_settings
from src.program import Plan
from src.report.files import SUMMARY_FILE
from src.runtime.checkpoint import check_resume
from src.runtime.checks import check_runnable
from src.runtime.driver import launch
from src.runtime.clipping import check_clipping


def check_workers(plan: Plan, backend: TorchBackendSpec) -> None:
    if plan.devices > backend.workers:
        raise ConfigError(f"the {plan.strategy} plan needs {plan.devices} workers but backend.workers={backend.workers}")


def ready(planned: PlannedRun, settings: RunSettings, run_dir: Path) -> TorchBackendSpec:
    """Refuse what the real backend cannot run; write run.json for the workers."""
    backend = settings.torch
    if backend is None:
        raise ConfigError(f"backend={settings.backend} runs no workers: workers need backend=torch")
    check_runnable(planned, backend.data, backend.data_errors)
    check_clipping(planned.plan, planned.model, backend.deepspeed)
    check_resume(settings.checkpoint, run_dir, settings_record(settings).get("torch", {}))
    write_settings(run_dir, settings)  # after the checks: a refused run starts no worker and leaves no run.json
    return backend


def run_torch(planned: PlannedRun, settings: RunSettings, run_dir: Path) -> dict[str, Any]:
    """Start the local workers (each builds DeepSpeed's op on its node's first rank) and
    return the summary rank 0 wrote."""
    backend = ready(planned, settings, run_dir)
    check_workers(planned.plan, backend)
    launch([run_dir], planned.plan.devices, backend)
    return json.loads((run_dir / SUMMARY_FILE).read_text())
