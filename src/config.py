"""Typed run configuration, built and validated once at the door."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from src.cluster import ClusterSpec
from src.errors import ConfigError

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class TrainSpec:
    global_batch: int
    contrastive_batch: int
    seq_len: int | None
    precision: str
    steps: int
    seed: int


def _positive_int(cfg: Mapping[str, Any], key: str, prefix: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{prefix}.{key} must be a positive integer, got {value!r}")
    return value


def train_from_config(cfg: Mapping[str, Any], cluster: ClusterSpec, default_batch: int | None = None) -> TrainSpec:
    """`default_batch` (the model's) stands in for a null train.global_batch."""
    if cfg.get("global_batch") is None and default_batch is not None:
        cfg = {**cfg, "global_batch": default_batch}
    global_batch = _positive_int(cfg, "global_batch", "train")
    contrastive = cfg.get("contrastive_batch")
    if contrastive is None:
        contrastive = global_batch
    elif isinstance(contrastive, bool) or not isinstance(contrastive, int) or contrastive <= 0:
        raise ConfigError(f"train.contrastive_batch must be a positive integer, got {contrastive!r}")
    if contrastive > global_batch:
        raise ConfigError(f"train.contrastive_batch={contrastive} exceeds train.global_batch={global_batch}")
    seq_len = cfg.get("seq_len")
    if seq_len is not None:
        seq_len = _positive_int(cfg, "seq_len", "train")
    precision = cfg.get("precision", "auto")
    if precision == "auto":
        precision = cluster.default_precision
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r}; choose one of {list(PRECISIONS)} or auto")
    cluster.peak(precision)
    return TrainSpec(global_batch=global_batch, contrastive_batch=contrastive, seq_len=seq_len,
                     precision=precision, steps=_positive_int(cfg, "steps", "train"),
                     seed=int(cfg.get("seed", 0)))


Options = TypeVar("Options")


def options_from(cls: type[Options], cfg: Mapping[str, Any], prefix: str = "strategy") -> Options:
    """Fill a strategy's options dataclass from its config group; unknown keys are errors
    (a typo must not silently fall back to a default)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(cfg) - set(fields) - {"name"})
    if unknown:
        raise ConfigError(f"unknown {prefix} option(s) {unknown}; valid: {sorted(fields)}")
    return cls(**{k: v for k, v in cfg.items() if k in fields})
