"""Helpers of the runtime tests (no tests here): compose a run's config as the front door would,
and the DeepSpeed op build that must happen once before any workers start."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.config import TorchBackendSpec

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
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
# Par4D's ADM U-Net at its smallest: two levels of one residual block on 8x8 images,
# self-attention at 4x4 (0.76M parameters).
TINY_UNET = {"channels": 32, "image_size": 8, "channel_mult": [1, 2], "res_blocks": 1, "attention_resolutions": [4], "heads": 2}
UNET = ["model=unet", "model.preset=null", "train.global_batch=8"] + [
    f"model.{key}={str(value).replace(' ', '')}" for key, value in TINY_UNET.items()
]


def composed(overrides: list[str]) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def prepare_run_dir(run_dir: Path, overrides: list[str]) -> TorchBackendSpec:
    """What the front door does before it starts workers: validate, plan, refuse what the
    real backend cannot run, write resolved.yaml, plan.json and run.json."""
    from src.report import JobInfo
    from src.runtime.backend import ready
    from src.setup import options_named, prepare_run, start_run_dir, write_run_dir

    config = composed(overrides)
    start_run_dir(config, run_dir)
    planned, settings = prepare_run(config, JobInfo(run_name=run_dir.name))
    write_run_dir(run_dir, planned, settings)
    with options_named(planned.plan.strategy):
        return ready(planned, settings, run_dir)


def build_deepspeed_ops() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from src.runtime.op_build import prebuild_ops

    prebuild_ops()


def single_threaded(losses_of, *args, **kwargs) -> list[float]:
    """A reference's losses computed on one thread: tiny GEMMs and convolutions on a busy
    machine only contend for more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return losses_of(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def launch_cases(root: Path, cases: dict[str, list[str]], workers: int) -> dict[str, Path]:
    """Each case's run directory, checked as the front door checks it, all run in ONE
    launch of `workers` workers (starting workers costs more than a tiny run)."""
    from src.runtime.driver import launch

    build_deepspeed_ops()
    dirs = {name: root / name for name in cases}
    for name, overrides in cases.items():
        backend = prepare_run_dir(dirs[name], overrides)
    start = time.monotonic()
    launch(list(dirs.values()), workers, backend)
    print(f"{len(dirs)} real runs in {time.monotonic() - start:.1f} s")
    return dirs


def mllm_shard(path: Path, images: list[int]) -> None:
    """A tar shard of an MLLM's samples: sample i is `s<i>.txt` and images[i] PNG images
    `s<i>.<k>.png` (none: text only)."""
    import io
    import tarfile

    from PIL import Image

    def png(i: int, k: int) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (16, 16), (30 * i % 256, 60 * k % 256, 200)).save(buffer, format="PNG")
        return buffer.getvalue()

    with tarfile.open(path, "w") as tar:
        for i, count in enumerate(images):
            members = [(f"s{i:03d}.{k}.png", png(i, k)) for k in range(count)] + [(f"s{i:03d}.txt", f"caption {i}".encode())]
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
