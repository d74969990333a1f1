"""The front door: compose the config, plan, execute, report.

    python -m src.run model=clip strategy=megatron
    python -m src.run -m model=clip,coca,lit strategy=megatron
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.cluster import ClusterSpec, cluster_from_config
from src.config import TrainSpec, train_from_config
from src.errors import ConfigError
from src.metrics import attach_memory, build_summary
from src.models.registry import build_model
from src.models.spec import ModelSpec
from src.program import Plan
from src.report import JobInfo, open_sinks
from src.report.files import SUMMARY_FILE
from src.runtime.errors import WorkerFailure
from src.sim.engine import SimulationError, simulate
from src.strategies import PlanRequest, planner_for

BACKENDS = ("sim", "torch")


@dataclass(frozen=True)
class Setup:
    """A validated run: everything a planner and a backend need."""

    config: dict[str, Any]
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec


def validate(config: dict[str, Any]) -> Setup:
    cluster = cluster_from_config(config["cluster"])
    model = build_model(config["model"], config["train"].get("seq_len"))
    train = train_from_config(config["train"], cluster, model.default_global_batch)
    backend = config["backend"]["name"]
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r} is not available; choose one of {list(BACKENDS)}")
    return Setup(config, model, cluster, train)


def plan_run(setup: Setup) -> Plan:
    strategy = setup.config["strategy"]
    planner = planner_for(strategy["name"])
    plan = planner(PlanRequest(setup.model, setup.cluster, setup.train, strategy))
    if plan.devices > setup.cluster.devices:
        raise ConfigError(f"plan uses {plan.devices} devices but cluster {setup.cluster.name} has "
                          f"{setup.cluster.devices}")
    return plan


def start_run_dir(config: dict[str, Any], run_dir: Path) -> None:
    """Write the composed config; a reused run directory must not keep an earlier run's
    results if this one fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def execute(config: dict[str, Any], run_dir: Path, job: JobInfo) -> dict[str, Any]:
    start_run_dir(config, run_dir)
    setup = validate(config)
    plan = plan_run(setup)
    if config["backend"]["name"] == "torch":
        from src.runtime.backend import run_torch  # torch.distributed and DeepSpeed load only here

        return run_torch(setup, plan, run_dir, job)
    timeline = simulate(plan.program, setup.model, setup.cluster, setup.train.precision)
    attach_memory(timeline, plan, setup.model, setup.train.precision)
    names = {"model": setup.model.name, "strategy": config["strategy"]["name"], "cluster": setup.cluster.name,
             "backend": config["backend"]["name"]}
    summary = build_summary(names, plan, timeline, setup.model, setup.cluster, setup.train)
    with open_sinks(run_dir, config, job) as sinks:
        sinks.log_step({"step": 0, "iteration_time_s": summary["iteration_time_s"], "mfu": summary["mfu"]})
        sinks.finish(summary, timeline)
    return summary


def job_info(config: dict[str, Any]) -> tuple[Path, JobInfo]:
    """The run directory and names of the Hydra job running now."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    sweep = Path(hydra_cfg.sweep.dir).name if multirun else None
    job = JobInfo(run_name=config["run"]["name"], sweep_name=sweep,
                  override_dirname=hydra_cfg.job.override_dirname or None)
    return Path(hydra_cfg.runtime.output_dir), job


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config = OmegaConf.to_container(cfg, resolve=True)
    run_dir, job = job_info(config)
    try:
        execute(config, run_dir, job)
    except (ConfigError, SimulationError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except WorkerFailure as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        # The driver has already stopped every worker it started.
        print("error: interrupted; all workers stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
