"""The backends behind the front door: the same call for each, (setup, plan, run
directory, job) -> the run's summary. Each writes the run directory and its sinks through
metrics.summarize and report.open_sinks. A backend's module is imported only when it runs
(torch.distributed and DeepSpeed load only for `torch`)."""
from __future__ import annotations

import importlib
from typing import Callable

BACKENDS: dict[str, str] = {
    "sim": "src.sim.backend:run_sim",
    "torch": "src.runtime.backend:run_torch",
}


def backend_for(name: str) -> Callable:
    module, function = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), function)
