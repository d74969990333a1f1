"""A run's validated inputs and its plan: what the front door, the workers and the
launchers share (none of them runs Hydra to get here but the front door)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from src.backends import BACKENDS
from src.cluster import ClusterSpec, cluster_from_config
from src.config import TOP_LEVEL, TrainSpec, backend_from_config, check_logger_and_run, train_from_config
from src.errors import ConfigError, reject_unknown
from src.models.registry import build_model
from src.models.spec import ModelSpec
from src.program import Plan
from src.report import JobInfo
from src.report.files import SUMMARY_FILE
from src.strategies import PlanRequest, planner_for

ERROR_FILE = "error.txt"  # a failed run's one-line reason (a multirun's other jobs go on)


@dataclass(frozen=True)
class Setup:
    """A validated run: everything a planner and a backend need."""

    config: dict[str, Any]
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec


def validate(config: dict[str, Any]) -> Setup:
    reject_unknown(config, TOP_LEVEL, "top-level config key(s)")
    cluster = cluster_from_config(config["cluster"])
    model = build_model(config["model"], config["train"].get("seq_len"), cluster.attention)
    train = train_from_config(config["train"], cluster, model.default_global_batch)
    backend = config["backend"]["name"]
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r} is not available; choose one of {list(BACKENDS)}")
    backend_from_config(config["backend"])
    check_logger_and_run(config.get("logger") or {"name": "none"}, config.get("run") or {})
    return Setup(config, model, cluster, train)


def plan_run(setup: Setup) -> Plan:
    strategy = setup.config["strategy"]
    planner = planner_for(strategy["name"])
    plan = planner(PlanRequest(setup.model, setup.cluster, setup.train, strategy))
    if plan.devices > setup.cluster.devices:
        raise ConfigError(f"plan uses {plan.devices} devices but cluster {setup.cluster.name} has {setup.cluster.devices}")
    return plan


def start_run_dir(config: dict[str, Any], run_dir: Path) -> None:
    """Write the composed config; a reused run directory must not keep an earlier run's
    results if this one fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def job_info(config: dict[str, Any]) -> tuple[Path, JobInfo]:
    """The run directory and names of the Hydra job running now."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    sweep = Path(hydra_cfg.sweep.dir).name if multirun else None
    job = JobInfo(run_name=config["run"]["name"], sweep_name=sweep, override_dirname=hydra_cfg.job.override_dirname or None)
    return Path(hydra_cfg.runtime.output_dir), job
