"""The real backend on a GPU (NCCL, one worker): every strategy that fits one GPU trains
like the single-process reference, in fp32 and in bf16. Skipped without a CUDA device;
run with `python -m pytest -m gpu` where there is one (the measurements beside it are
benchmarks/bench_runtime_gpu.py's, recorded in benchmarks/results/h100_runtime.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from src.models.registry import build_model
from src.runtime.driver import launch
from src.runtime.reference import reference_losses
from tests.runtime.support import CLIP, prepare_run_dir, sensitive, sensitive_optimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,  # starts a worker
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL, one GPU)"),
]

STEPS = 5
ONE_GPU = [
    "backend=torch",
    "cluster=hopper",
    "cluster.nodes=1",
    "cluster.devices_per_node=1",
    "cluster.amp=true",  # the real backend trains under PyTorch AMP
    "logger=none",
    *sensitive(),
    f"train.steps={STEPS}",
]
STRATEGIES = {
    **{f"ddp_zero{z}": ["strategy=ddp", f"strategy.zero_stage={z}"] for z in range(4)},
    "megatron_tp1_pp1": [
        "strategy=megatron",
        "strategy.tp=1",
        "strategy.pp=1",
        "strategy.recompute=none",
        "strategy.zero_stage=0",
        "strategy.micro_batch_size=8",
    ],
}
# GPU GEMMs and reductions differ from the CPU's in rounding; bf16 adds its own.
TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2}
HOPPER_PEAK = {"fp32": 67.0e12, "bf16": 989.0e12}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("gpu")
    dirs = {}
    for name, overrides in STRATEGIES.items():
        for precision in TOLERANCE:
            dirs[(name, precision)] = root / f"{name}_{precision}"
            backend = prepare_run_dir(dirs[(name, precision)], ONE_GPU + CLIP + overrides + [f"train.precision={precision}"])
    launch(list(dirs.values()), 1, backend)
    return dirs


@pytest.mark.parametrize("precision", list(TOLERANCE))
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_trains_on_the_gpu_like_the_reference(runs, name, precision):
    summary = json.loads((runs[(name, precision)] / "summary.json").read_text())
    assert summary["dist_backend"] == "nccl" and summary["precision"] == precision
    assert summary["peak_flops_per_device"] == pytest.approx(HOPPER_PEAK[precision])  # the preset's datasheet
    assert summary["measured_gemm_flops_per_device"] > 0 and 0 < summary["mfu"] < 1
    expected = reference_losses(
        build_model({"name": "clip", "scale": "tiny"}), 0, 8, STEPS, sensitive_optimizer(), precision=precision
    )
    assert summary["measured"]["loss"] == pytest.approx(expected, rel=TOLERANCE[precision])
