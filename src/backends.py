"""The backends behind the front door: the same call for each, (planned run, run
settings, run directory) -> the run's summary (src/plan_io: both typed). Each writes the run directory and its sinks through
metrics.summarize and report.open_sinks. A backend's module is imported only when it runs
(torch.distributed and DeepSpeed load only for `torch`)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

from src.errors import ConfigError

BACKENDS: dict[str, str] = {
    "sim": "src.sim.backend:run_sim",
    "torch": "src.runtime.backend:run_torch",
}
# What a backend needs beyond the simulator's install (pip extras of pyproject.toml).
NEEDS: dict[str, tuple[str, ...]] = {"torch": ("torch", "deepspeed")}


def backend_for(name: str) -> Callable:
    missing = [package for package in NEEDS.get(name, ()) if importlib.util.find_spec(package) is None]
    if missing:
        raise ConfigError(f"backend={name} needs {missing}, not installed: pip install -e '.[runtime]'")
    module, function = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), function)
