"""Typed run configuration, built and validated once at the door."""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import os
import types
from pathlib import Path
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, TypeVar, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from omegaconf import DictConfig

from src.cluster import ClusterSpec
from src.errors import ConfigError, reject_unknown

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class TrainSpec:
    global_batch: int
    contrastive_batch: int
    seq_len: int | None
    precision: str
    steps: int
    seed: int
    # What the samples hold, the workload's for every strategy of a comparison: "uniform"
    # (every sample alike) or "interleaved" (an MLLM's LAION-like sequences whose image count
    # and sizes vary, src/data/interleaved.py).
    data: str = "uniform"


TOP_LEVEL = ("model", "strategy", "cluster", "backend", "logger", "train", "run", "plan")
TRAIN_KEYS = ("global_batch", "contrastive_batch", "seq_len", "precision", "steps", "seed", "data", "checkpoint_every", "resume")
RUN_KEYS = ("name", "out_root")
LOGGER_KEYS = {"none": ("name",), "wandb": ("name", "mode", "project", "entity", "group", "tags")}
WANDB_MODES = ("offline", "online", "disabled")
WANDB_ENV_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}
DIST_BACKENDS = ("gloo", "nccl", "auto")
DATA_ERRORS = ("fail", "skip")  # a bad shard or member fails the run, or is left out (webdataset's habit)
PREPROCESS = ("inline", "disaggregated")  # DistTrain: batches made by the trainer, or by a producer process beside it


def positive_int(cfg: Mapping[str, Any], key: str, prefix: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{prefix}.{key} must be a positive integer, got {value!r}")
    return value


def train_from_config(
    cfg: Mapping[str, Any], cluster: ClusterSpec, default_batch: int | None = None, data: tuple[str, ...] = ("uniform",)
) -> TrainSpec:
    """`default_batch` (the model's) stands in for a null train.global_batch; `data`: the
    contents the model's samples can hold, its default first (a null train.data)."""
    reject_unknown(cfg, TRAIN_KEYS, "train key(s)")
    if cfg.get("global_batch") is None and default_batch is not None:
        cfg = {**cfg, "global_batch": default_batch}
    global_batch = positive_int(cfg, "global_batch", "train")
    contrastive = cfg.get("contrastive_batch")
    if contrastive is None:
        contrastive = global_batch
    elif isinstance(contrastive, bool) or not isinstance(contrastive, int) or contrastive <= 0:
        raise ConfigError(f"train.contrastive_batch must be a positive integer, got {contrastive!r}")
    if contrastive > global_batch:
        raise ConfigError(f"train.contrastive_batch={contrastive} exceeds train.global_batch={global_batch}")
    seq_len = cfg.get("seq_len")
    if seq_len is not None:
        seq_len = positive_int(cfg, "seq_len", "train")
    precision = cfg.get("precision", "auto")
    if precision == "auto":
        precision = cluster.default_precision
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r}; choose one of {list(PRECISIONS)} or auto")
    cluster.peak(precision)
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"train.seed must be a non-negative integer, got {seed!r}")
    content = cfg.get("data") or data[0]
    if content not in data:
        raise ConfigError(f"train.data={content!r}: this model's samples hold {' or '.join(data)} data")
    return TrainSpec(
        global_batch=global_batch,
        contrastive_batch=contrastive,
        seq_len=seq_len,
        precision=precision,
        steps=positive_int(cfg, "steps", "train"),
        seed=seed,
        data=content,
    )


@dataclass(frozen=True)
class CheckpointSpec:
    """train.checkpoint_every and train.resume: how a real run saves its state and where it
    starts from. Not part of the plan (a resumed run runs the plan it resumes)."""

    every: int | None = None  # save after every N-th step (RUN_DIR/checkpoint); None: never
    resume: str | None = None  # a run directory (absolute) whose latest checkpoint this run starts from


def checkpoint_from_config(cfg: Mapping[str, Any], backend: str) -> CheckpointSpec:
    every, resume = cfg.get("checkpoint_every"), cfg.get("resume")
    if every is None and resume is None:
        return CheckpointSpec()
    if backend != "torch":
        raise ConfigError(f"train.checkpoint_every and train.resume are the real backend's (backend=torch), not backend={backend}'s")
    if every is not None:
        every = positive_int(cfg, "checkpoint_every", "train")
    if resume is not None:
        if not isinstance(resume, str) or not resume:
            raise ConfigError(f"train.resume must be a run directory, got {resume!r}")
        resume = os.path.abspath(resume)  # workers may start elsewhere (a launcher's nodes)
    return CheckpointSpec(every, resume)


@dataclass(frozen=True)
class TorchBackendSpec:
    """The real backend's settings, checked at the door before any worker starts."""

    workers: int
    dist_backend: str
    timeout_s: float
    threads_per_worker: int
    data: str
    data_errors: str
    lr: float
    weight_decay: float
    adam_eps: float
    initial_loss_scale: float
    preprocess: str
    prefetch_steps: int


def _number(cfg: Mapping[str, Any], key: str, prefix: str, minimum: float, strict: bool) -> float:
    value = cfg.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < minimum
        or (strict and value == minimum)
    ):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        raise ConfigError(f"{prefix}.{key} must be a number {bound}, got {value!r}")
    return float(value)


def backend_from_config(cfg: Mapping[str, Any]) -> TorchBackendSpec | None:
    """The torch backend's settings (None for the simulator, which has none)."""
    if cfg.get("name") != "torch":
        reject_unknown(cfg, ("name",), f"backend={cfg.get('name')} key(s)")
        return None
    fields = [f.name for f in dataclasses.fields(TorchBackendSpec)]
    reject_unknown(cfg, ["name", *fields], "backend key(s)")
    if cfg.get("dist_backend") not in DIST_BACKENDS:
        raise ConfigError(f"backend.dist_backend={cfg.get('dist_backend')!r}; choose one of {list(DIST_BACKENDS)}")
    if not isinstance(cfg.get("data"), str) or not cfg["data"]:
        raise ConfigError(f"backend.data must be 'synthetic' or a glob of tar shards, got {cfg.get('data')!r}")
    if cfg.get("data_errors") not in DATA_ERRORS:
        raise ConfigError(f"backend.data_errors={cfg.get('data_errors')!r}; choose one of {list(DATA_ERRORS)}")
    if cfg.get("preprocess") not in PREPROCESS:
        raise ConfigError(f"backend.preprocess={cfg.get('preprocess')!r}; choose one of {list(PREPROCESS)}")
    return TorchBackendSpec(
        workers=positive_int(cfg, "workers", "backend"),
        dist_backend=cfg["dist_backend"],
        timeout_s=_number(cfg, "timeout_s", "backend", 0, strict=True),
        threads_per_worker=positive_int(cfg, "threads_per_worker", "backend"),
        data=cfg["data"],
        data_errors=cfg["data_errors"],
        lr=_number(cfg, "lr", "backend", 0, strict=True),
        weight_decay=_number(cfg, "weight_decay", "backend", 0, strict=False),
        adam_eps=_number(cfg, "adam_eps", "backend", 0, strict=True),
        initial_loss_scale=_number(cfg, "initial_loss_scale", "backend", 1, strict=False),
        preprocess=cfg["preprocess"],
        prefetch_steps=positive_int(cfg, "prefetch_steps", "backend"),
    )


def wandb_mode(logger: Mapping[str, Any]) -> str:
    """logger.mode where the command line sets it; else WANDB_MODE from the environment, as
    W&B documents it (its `run` is online, `dryrun` offline); else offline."""
    mode = logger.get("mode")
    if mode is not None:
        if mode not in WANDB_MODES:
            raise ConfigError(f"logger.mode={mode!r}; choose one of {list(WANDB_MODES)}")
        return mode
    env = os.environ.get("WANDB_MODE") or "offline"
    if env not in WANDB_ENV_MODES:
        raise ConfigError(f"WANDB_MODE={env!r} in the environment; choose one of {list(WANDB_ENV_MODES)} (or set logger.mode)")
    return WANDB_ENV_MODES[env]


def check_logger_and_run(logger: Mapping[str, Any], run: Mapping[str, Any]) -> None:
    name = logger.get("name")
    if name not in LOGGER_KEYS:
        raise ConfigError(f"logger={name!r}; choose one of {sorted(LOGGER_KEYS)}")
    reject_unknown(logger, LOGGER_KEYS[name], f"logger={name} key(s)")
    if name == "wandb":
        wandb_mode(logger)
        tags = logger.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise ConfigError(f"logger.tags must be a list of strings, got {tags!r}")
    reject_unknown(run, RUN_KEYS, "run key(s)")


Options = TypeVar("Options", bound="DataclassInstance")


def options_from(cls: type[Options], cfg: Mapping[str, Any], prefix: str = "strategy") -> Options:
    """Fill a strategy's options dataclass from its config group; unknown keys are errors
    (a typo must not silently fall back to a default)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    reject_unknown({k: v for k, v in cfg.items() if k != "name"}, fields, f"{prefix} option(s)")
    hints = typing.get_type_hints(cls)
    for key, value in cfg.items():
        if key in fields and value is not None:
            _check_shape(f"{prefix}.{key}", value, hints[key])
    return cls(**{k: v for k, v in cfg.items() if k in fields})


def _check_shape(key: str, value: Any, hint: Any) -> None:
    """A list where the option takes one value, or one value where it takes a list or a
    mapping, is refused here; the planners check the values themselves."""
    args = (
        [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else [hint]
    )
    origins = {typing.get_origin(a) or a for a in args}
    if origins & {list, tuple}:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} takes a list, got {value!r} (e.g. {key}=[...])")
    elif origins & {Mapping, dict, collections.abc.Mapping}:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} takes a mapping of settings, got {value!r} (e.g. {key}.tp=2)")
    elif origins <= {int, float, str, bool} and isinstance(value, (list, tuple, Mapping)):
        raise ConfigError(f"{key} takes one value, got {value!r}")


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """A composed config as plain dicts and lists with interpolations resolved: what the
    validators take and resolved.yaml records."""
    from omegaconf import OmegaConf

    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))


def composed(overrides: list[str]) -> dict[str, Any]:
    """The project's config composed with `overrides`, as plain_config gives it: what a
    tool or benchmark hands `src.setup.validate` without going through the front door."""
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return plain_config(compose(config_name="config", overrides=overrides))
