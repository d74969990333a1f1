"""DistMM on the real backend: towers on disjoint process groups train like one process.

With the same seed, initial weights and global batch, the first 5 losses of each plan
equal the single-process reference within 1e-4 relative: towers on 3+1 and 2+2 workers,
pipelined towers under DistMM-Pipe and GPipe with batch-sync, a TP tower, CoCa (the image
tokens cross between towers of different replicas) and LiT (frozen image tower). All
plans run back to back in ONE launch of four workers. The batch-sync's gradients are
checked against one contrastive loss over the whole batch (the oracle) on three tiny
processes.

AdamW runs with eps=1 and lr=1 here: its first updates are then proportional to the
gradients (with the usual eps=1e-8 they are nearly their signs, and a tower whose
gradients were off by its dp degree would still match the reference within 1e-4), so
equal losses mean equal gradients, scale included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from src.models.registry import build_model
from src.runtime.reference import reference_losses
from src.timeline import BREAKDOWN_CATEGORIES
from tests.runtime.support import launch_cases, sensitive, sensitive_optimizer

pytestmark = pytest.mark.slow  # starts worker processes

STEPS, BATCH, CONTRASTIVE = 3, 12, 6  # two updates; two batch-sync groups per step
FOUR_WORKERS = [
    "backend=torch",
    "cluster=local",
    "cluster.devices_per_node=4",
    "logger=none",
    "strategy=distmm",
    "model.scale=tiny",
    f"train.global_batch={BATCH}",
    f"train.contrastive_batch={CONTRASTIVE}",
    *sensitive(),
]
PIPELINED = ["strategy.vision.pp=2", "strategy.text.pp=2", "strategy.microbatches=2"]
CASES = {
    "clip_3+1": ["model=clip", "strategy.vision.dp=3", "strategy.text.dp=1"],
    "clip_2+2": ["model=clip", "strategy.vision.dp=2", "strategy.text.dp=2"],
    "clip_2+2_distmm_pipe": ["model=clip", *PIPELINED, "strategy.pipeline=distmm_pipe"],
    "clip_2+2_gpipe_sync": ["model=clip", *PIPELINED, "strategy.pipeline=gpipe_sync"],
    "clip_vision_tp2": ["model=clip", "strategy.vision.tp=2", "strategy.text.dp=2"],
    "coca_3+1": ["model=coca", "strategy.vision.dp=3", "strategy.text.dp=1"],  # fan-in of image tokens
    "coca_vision_pp2": [
        "model=coca",
        "strategy.vision.pp=2",
        "strategy.text.dp=2",  # fan-out, pipelined producer
        "strategy.microbatches=2",
    ],
    "lit_2+2": ["model=lit", "strategy.vision.dp=2", "strategy.text.dp=2"],  # frozen image tower
    "coca_text_pp2": ["model=coca", "strategy.vision.dp=2", "strategy.text.pp=2"],  # feature mid-pipeline
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    cases = {name: FOUR_WORKERS + overrides + [f"train.steps={STEPS}"] for name, overrides in CASES.items()}
    return launch_cases(tmp_path_factory.mktemp("distmm"), cases, 4)


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    return {
        name: reference_losses(
            build_model({"name": name, "scale": "tiny"}), 0, BATCH, STEPS, sensitive_optimizer(), contrastive_batch=CONTRASTIVE
        )
        for name in ("clip", "coca", "lit")
    }


def _model(case: str) -> str:
    return next(o.split("=")[1] for o in CASES[case] if o.startswith("model="))


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["type"] == "step"]


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, references, case):
    assert _losses(runs[case]) == pytest.approx(references[_model(case)], rel=1e-4)


def test_the_reference_moves_with_the_gradients(references):
    # Otherwise equal losses would not say the gradients are equal.
    for losses in references.values():
        assert max(abs(b - a) for a, b in zip(losses, losses[1:])) > 0.05


def test_each_plan_runs_the_towers_it_was_asked_for_and_reports_like_the_simulator(runs):
    plan = json.loads((runs["clip_3+1"] / "summary.json").read_text())["plan"]["units"]
    assert (plan["vision"]["dp"], plan["text"]["dp"]) == (3, 1)
    assert (plan["vision"]["batch_per_replica"], plan["text"]["batch_per_replica"]) == (4, 12)
    for case, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["strategy"] == "distmm" and summary["backend"] == "torch" and 0 < summary["mfu"] < 1
        breakdown = summary["breakdown_s"]
        assert set(breakdown) == set(BREAKDOWN_CATEGORIES)
        assert sum(breakdown.values()) == pytest.approx(summary["iteration_time_s"], rel=1e-6)
        assert breakdown["comm_interaction"] > 0, case
    coca = json.loads((runs["coca_3+1"] / "summary.json").read_text())["breakdown_s"]
    assert coca["comm_broker"] > 0
    pipe = json.loads((runs["clip_2+2_distmm_pipe"] / "summary.json").read_text())["breakdown_s"]
    assert pipe["bubble_warmup"] + pipe["bubble_cooldown"] + pipe["bubble_imbalance"] > 0
