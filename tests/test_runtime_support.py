"""Helpers of the runtime tests (no tests here): compose a run's config as the front door would,
and the DeepSpeed op build that must happen once before any workers start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# Two tiny CPU workers: what CI's 2 cores can run.
TWO_WORKERS = ["backend=torch", "cluster=local", "cluster.devices_per_node=2", "logger=none"]
CLIP = ["model=clip", "model.scale=tiny", "train.global_batch=8"]
GPT = [
    "model=gpt",
    "model.preset=null",
    "model.layers=4",
    "model.hidden=64",
    "model.heads=4",
    "model.vocab=128",
    "train.seq_len=16",
    "train.global_batch=8",
]


def composed(overrides: list[str]) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def prepare_run_dir(run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """What the driver writes before it starts workers."""
    config = composed(overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def build_deepspeed_ops() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from src.runtime.engines import prebuild_ops

    prebuild_ops()
