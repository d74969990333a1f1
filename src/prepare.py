"""Prepare a real run for an external launcher (torchrun, srun), start nothing:

    python -m src.prepare backend=torch model=clip ... hydra.run.dir=/shared/run

Composes, validates and plans exactly as the front door (or, with plan=DIR, takes the
plan written there), then writes the run directory the workers read: resolved.yaml,
plan.json (the plan), run.json (the backend's settings, the job's names for the sinks)
and launch.env (how many nodes and workers per node torchrun must start: the plan's
ranks fill whole nodes of the cluster, in rank order, as the cost model places them).
Prints the run directory as the last line of stdout. The launcher then runs the worker
entry, `python -m src.runtime.worker RUN_DIR`, on every node; its rank 0 reports.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from src.config import plain_config
from src.errors import ConfigError
from src.program import Plan
from src.report import JobInfo
from src.runtime.backend import ready
from src.setup import job_info, options_named, prepare_run, start_run_dir, write_run_dir

LAUNCH_FILE = "launch.env"  # shell-sourceable: the wrappers in launchers/ read it without Python


def layout(plan: Plan, devices_per_node: int) -> tuple[int, int]:
    """(nodes, workers per node): torchrun starts the same number of workers on each node."""
    if plan.devices <= devices_per_node:
        return 1, plan.devices
    if plan.devices % devices_per_node:
        raise ConfigError(
            f"the {plan.strategy} plan uses {plan.devices} devices, which do not fill whole nodes of "
            f"{devices_per_node}; torchrun starts as many workers on every node"
        )
    return plan.devices // devices_per_node, devices_per_node


def prepare(config: dict[str, Any], run_dir: Path, job: JobInfo, overrides: list[str] | None = None) -> tuple[int, int]:
    """Write the run directory of a torch run; returns (nodes, workers per node)."""
    start_run_dir(config, run_dir)
    planned, settings = prepare_run(config, job, overrides, for_launcher=True)
    write_run_dir(run_dir, planned, settings)
    with options_named(planned.plan.strategy):  # what the front door refuses before starting workers
        ready(planned, settings, run_dir)
    plan = planned.plan
    nodes, per_node = layout(plan, planned.cluster.devices_per_node)
    (run_dir / LAUNCH_FILE).write_text(f"NNODES={nodes}\nNPROC_PER_NODE={per_node}\nWORLD={plan.devices}\n")
    return nodes, per_node


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config = plain_config(cfg)
    run_dir, job, overrides = job_info(config)
    try:
        nodes, per_node = prepare(config, run_dir, job, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(
        f"prepared: {nodes} node(s) x {per_node} worker(s); on each node: launchers/torchrun.sh {run_dir} HOST:PORT", file=sys.stderr
    )
    print(run_dir)


if __name__ == "__main__":
    main()
