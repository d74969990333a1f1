"""The front door: compose the config, plan, execute, report.

    python -m src.run model=clip strategy=megatron
    python -m src.run -m model=clip,coca,lit strategy=megatron
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from src.backends import backend_for
from src.errors import ConfigError
from src.report import JobInfo
from src.runtime.errors import WorkerFailure
from src.setup import job_info, plan_run, start_run_dir, validate
from src.sim.engine import SimulationError

log = logging.getLogger("src.run")


def execute(config: dict[str, Any], run_dir: Path, job: JobInfo) -> dict[str, Any]:
    start_run_dir(config, run_dir)
    setup = validate(config)
    plan = plan_run(setup)
    return backend_for(config["backend"]["name"])(setup, plan, run_dir, job)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config = OmegaConf.to_container(cfg, resolve=True)
    run_dir, job = job_info(config)
    try:
        execute(config, run_dir, job)
    except (ConfigError, SimulationError) as err:
        log.error(f"error: {err}")
        sys.exit(2)
    except WorkerFailure as err:
        log.error(f"error: {err}")
        sys.exit(1)
    except KeyboardInterrupt:
        # The driver has already stopped every worker it started.
        log.error("error: interrupted; all workers stopped")
        sys.exit(130)


if __name__ == "__main__":
    main()
