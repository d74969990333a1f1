"""Megatron-LM with the encoder and generator replicated over their stages' TP group
(DistTrain §2.1's rigid baseline) on six real workers, tp=2 x pp=3: each of a stage's two
ranks runs the whole ViT (or U-Net) on its half of every micro-batch, hands its rows to the
LLM's TP ranks (which all-gather them) and reduces its gradients over both; the first
losses equal one process's. One launch of six workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from src.models.registry import build_model
from src.runtime.reference import reference_losses
from tests.runtime.support import launch_cases, sensitive, sensitive_optimizer, summary_of

pytestmark = pytest.mark.slow  # starts worker processes

STEPS = 3
BATCH = 8
WORKERS = 6
BASE = [
    "backend=torch",
    "cluster=local",
    f"cluster.devices_per_node={WORKERS}",
    "logger=none",
    "model=mllm_9b",
    "model.scale=tiny",
    "train.data=uniform",
    f"train.global_batch={BATCH}",
    f"train.steps={STEPS}",
    "strategy=megatron",
    "strategy.tp=2",
    "strategy.pp=3",
    "strategy.micro_batch_size=2",
    "strategy.sequence_parallel=false",
    "strategy.recompute=none",
    "strategy.replicate=[encoder,generator]",
    *sensitive(0.3),
]
CASES = {
    "replicated": ["strategy.zero_stage=0"],
    # The distributed optimizer's partitions span a replicated stage's TP and DP ranks.
    "replicated_zero1": ["strategy.zero_stage=1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return launch_cases(tmp_path_factory.mktemp("replicate"), {name: BASE + extra for name, extra in CASES.items()}, WORKERS)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses(build_model({"name": "mllm_9b", "scale": "tiny"}), 0, BATCH, STEPS, sensitive_optimizer(0.3))


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, reference, case):
    assert summary_of(runs[case])["measured"]["loss"] == pytest.approx(reference, rel=1e-4)
    assert reference[-1] != pytest.approx(reference[0], rel=1e-3)  # it trains, so equality says something


def test_replicated_stages_split_rows_and_run_no_tp_collective(runs):
    summary = summary_of(runs["replicated"])
    units = summary["plan"]["units"]
    for name in ("encoder", "generator"):
        assert units[name]["mesh"] == {"rows": 2, "dp": 1, "pp": 1} and units[name]["tp"] == 1
    assert units["llm"]["mesh"] == {"tp": 2, "dp": 1, "pp": 1}
    trace = json.loads((runs["replicated"] / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # The LLM's stage all-gathers the encoder's rows (forward) and the generator's gradients
    # (backward); the replicated stages gather nothing and hold no TP group.
    gathers = {e["name"] for e in events if e.get("name", "").startswith("all_gather")}
    assert gathers == {"all_gather tp.s1"}, sorted(gathers)
