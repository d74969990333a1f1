"""The door: a run's config validated once into typed settings, planned (or its written
plan read), and the run directory the backends, the workers and the launchers read
(none of them runs Hydra or plans again but the door)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from src.backends import BACKENDS
from src.cluster import ClusterSpec, cluster_from_config
from src.costmodel.memory import element_bytes
from src.config import (
    TOP_LEVEL,
    TorchBackendSpec,
    checkpoint_from_config,
    TrainSpec,
    backend_from_config,
    check_logger_and_run,
    composed,
    positive_int,
    requested_precision,
    train_from_config,
)
from src.errors import ConfigError, PlanRefused, reject_unknown
from src.models.attention import measured_versions
from src.models.registry import build_model
from src.models.spec import ModelSpec
from src.plan_io import PLANNED_FROM, PlannedRun, RunSettings, read_plan, write_plan
from src.program import Plan
from src.report import JobInfo
from src.report.files import ERROR_FILE, SUMMARY_FILE
from src.strategies import PlanRequest, option_keys, planner_for, software_settings
from src.strategies.base import BackendLimits

RESOLVED_FILE = "resolved.yaml"
TRAIN_NOT_PLANNED = ("steps", "checkpoint_every", "resume")  # the train keys a written plan's re-run may set
# What each backend runs of what planners may emit: planners plan within it (the real
# backend's checks, src/runtime/checks.py, refuse the rest before any worker starts).
LIMITS = {"sim": BackendLimits(), "torch": BackendLimits("torch", split_unets=False)}


@dataclass(frozen=True)
class Setup:
    """A validated run: everything a planner and a backend need, typed (`config`: the
    composed config it was validated from; the strategy's options are its planner's to
    type)."""

    config: dict[str, Any]
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    backend: TorchBackendSpec | None = None


def validate(config: dict[str, Any]) -> Setup:
    reject_unknown(config, TOP_LEVEL, "top-level config key(s)")
    if config["backend"]["name"] == "torch" and "dropout" in config["model"] and config["model"]["dropout"] is None:
        # The real backend's blocks train without dropout (so that every layout's losses agree
        # with one process): model.dropout null reads as false there, and the plan says so.
        config = {**config, "model": {**config["model"], "dropout": False}}
    cluster = cluster_from_config(config["cluster"])
    # The attention kernel, the parameter gradients' reductions, the loss's kernels, how
    # weight gradients are accumulated and which operations run unfused are the software's:
    # the model's option if set, else that of the codebase the strategy models
    # (DeepSpeed-3D's), else the cluster preset's (its testbed's era; every operation fused).
    software: dict[str, Any] = {
        "attention": cluster.attention,
        "param_grad_kernels": cluster.param_grad_kernels,
        "cross_entropy": cluster.cross_entropy,
        "grad_accumulation": cluster.grad_accumulation,
    }
    precision = requested_precision(config["train"], cluster)
    software |= software_settings(config["strategy"], precision, cluster.amp)
    model = build_model(config["model"], config["train"].get("seq_len"), **software, activation_bytes=element_bytes(precision))
    train = train_from_config(config["train"], cluster, model.default_global_batch, model.extras.get("data", ("uniform",)))
    _check_measured_attention(model, cluster, train.precision)
    backend = _backend(config)
    check_logger_and_run(config.get("logger") or {"name": "none"}, config.get("run") or {})
    return Setup(config, model, cluster, train, backend)


def _check_measured_attention(model: ModelSpec, cluster: ClusterSpec, precision: str) -> None:
    """A FlashAttention version priced by its measured rates needs the device's table of it."""
    versions = measured_versions(model)
    if not versions:
        return
    table = cluster.attention_measurements
    missing = sorted(versions - set(table.kernels if table else ()))
    if missing:
        has = "none" if table is None else "only " + ", ".join(table.kernels)
        raise ConfigError(
            f"model.attention={missing[0]} is priced by the device's measured FlashAttention rates; cluster {cluster.name} "
            f"has {has} (conf/cluster/measured/attention/): use model.attention=flash"
        )
    assert table is not None
    if precision not in table.precisions:
        raise ConfigError(
            f"model.attention={sorted(versions)[0]}: FlashAttention's rates on {cluster.name} are measured at "
            f"{', '.join(table.precisions)}, not train.precision={precision}"
        )


@functools.cache  # composed once a preset: a tool pricing many kernels or collectives reads a few presets
def preset_cluster(name: str) -> ClusterSpec:
    """Cluster preset `name` as a run composes and checks it (a tool's way to a preset's
    constants without a run of its own)."""
    return validate(composed([f"cluster={name}", "model=gpt", "strategy=ddp", "logger=none"])).cluster


def _backend(config: dict[str, Any]) -> TorchBackendSpec | None:
    name = config["backend"]["name"]
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is not available; choose one of {list(BACKENDS)}")
    return backend_from_config(config["backend"])


def plan_run(setup: Setup) -> Plan:
    strategy = setup.config["strategy"]
    planner = planner_for(strategy["name"])
    limits = LIMITS[setup.config["backend"]["name"]]
    plan = planner(PlanRequest(setup.model, setup.cluster, setup.train, strategy, _sample_images(setup), limits))
    if plan.devices > setup.cluster.devices:
        raise ConfigError(f"plan uses {plan.devices} devices but cluster {setup.cluster.name} has {setup.cluster.devices}")
    return plan


def _sample_images(setup: Setup) -> tuple[int, ...] | None:
    """The images per sample of the first step's batch of the tar shards a real run reads,
    for its plan to price (planners read no files)."""
    backend = setup.backend
    if backend is None or backend.data == "synthetic":
        return None
    from src.runtime.inputs import shard_images  # torch: imported by runs on shards only

    return shard_images(setup.model, backend.data, backend.data_errors, setup.train.global_batch)


def prepare_run(
    config: dict[str, Any], job: JobInfo, overrides: list[str] | None = None, for_launcher: bool = False
) -> tuple[PlannedRun, RunSettings]:
    """The run typed: planned from `config`, or, with plan=DIR, the plan written there
    (`overrides`: the command line's, none of which may change what was planned).
    `for_launcher`: a run prepared for torchrun or srun, which only the real backend's is."""
    if for_launcher and config["backend"]["name"] != "torch":
        raise ConfigError(f"only backend=torch runs are prepared for a launcher, got backend={config['backend']['name']}")
    if config.get("plan") is None:
        setup = validate(config)
        checkpoint = checkpoint_from_config(config["train"], config["backend"]["name"])  # before planning, which may take minutes
        planned = PlannedRun(setup.model, setup.cluster, setup.train, plan_run(setup), {k: setup.config[k] for k in PLANNED_FROM})
        return planned, RunSettings(config["backend"]["name"], setup.backend, job, config, checkpoint)
    source = Path(str(config["plan"]))
    planning = [o for o in overrides or [] if o.lstrip("+~").split("=")[0].split(".")[0] in PLANNED_FROM]
    planning = [o for o in planning if not o.startswith(tuple(f"train.{key}=" for key in TRAIN_NOT_PLANNED))]
    if planning:
        raise ConfigError(
            f"plan={source} runs the written plan's model, strategy, cluster and train "
            f"(train.steps, checkpoint_every and resume aside): drop {planning}"
        )
    reject_unknown(config, TOP_LEVEL, "top-level config key(s)")
    backend = _backend(config)
    check_logger_and_run(config.get("logger") or {"name": "none"}, config.get("run") or {})
    steps = positive_int(config["train"], "steps", "train")
    checkpoint = checkpoint_from_config(config["train"], config["backend"]["name"])
    planned = read_plan(source)
    planned = replace(planned, train=replace(planned.train, steps=steps))
    ours = {key: config["train"].get(key) for key in TRAIN_NOT_PLANNED} | {"steps": steps}
    record = {**config, **planned.sources, "train": {**planned.sources.get("train", {}), **ours}}
    if config["run"]["name"] == _default_name(config):  # the composed groups' name: the plan's instead
        record["run"] = {**config["run"], "name": _default_name(record)}
        job = replace(job, run_name=record["run"]["name"])
    return planned, RunSettings(config["backend"]["name"], backend, job, record, checkpoint)


def _default_name(config: dict[str, Any]) -> str:
    """conf/config.yaml's run.name."""
    return "-".join(str((config.get(group) or {}).get("name")) for group in ("model", "strategy", "cluster"))


def start_run_dir(config: dict[str, Any], run_dir: Path) -> None:
    """Write the composed config; a reused run directory must not keep an earlier run's
    results if this one fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    (run_dir / RESOLVED_FILE).write_text(yaml.safe_dump(config, sort_keys=False))


def write_run_dir(run_dir: Path, planned: PlannedRun, settings: RunSettings) -> None:
    """The plan the backend runs, and the config it was composed from (a re-run's: its
    plan's groups)."""
    if settings.record.get("plan") is not None:
        (run_dir / RESOLVED_FILE).write_text(yaml.safe_dump(settings.record, sort_keys=False))
    write_plan(run_dir, planned)


@contextmanager
def options_named(strategy: str) -> Iterator[None]:
    """A backend's refusal names plan fields; the door adds the strategy's options that
    set them (each strategy's table, src/strategies)."""
    try:
        yield
    except PlanRefused as refusal:
        keys = option_keys(strategy, refusal.fields, refusal.units)
        raise ConfigError(f"{refusal} [{strategy}: {', '.join(keys)}]" if keys else str(refusal)) from None


def job_info(config: dict[str, Any]) -> tuple[Path, JobInfo, list[str]]:
    """The run directory, names and command-line overrides of the Hydra job running now."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    sweep = Path(hydra_cfg.sweep.dir).name if multirun else None
    job = JobInfo(run_name=config["run"]["name"], sweep_name=sweep, override_dirname=hydra_cfg.job.override_dirname or None)
    return Path(hydra_cfg.runtime.output_dir), job, list(hydra_cfg.overrides.task)
