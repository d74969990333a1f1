"""Loss equality of tensor x pipeline parallel plans on four workers (tp=2, pp=2): the
pipeline transfers scattered over TP and gathered back (Megatron-LM's scatter/gather,
Megatron-LM's and DeepSpeed-3D's default; in rows, or in equal chunks of the flattened
activation where a micro-batch of one sample has fewer rows than TP ranks), and sequence
parallelism with selective
recomputation, each train like one process (first 5 losses within 1e-4 relative).
All plans run in ONE launch of four workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from src.models.registry import build_model
from src.runtime.reference import reference_losses
from tests.runtime.support import GPT, launch_cases, sensitive, sensitive_optimizer, trace_events

pytestmark = pytest.mark.slow  # starts worker processes

STEPS = 3  # two updates: each step's loss follows from the update before it
FOUR_WORKERS = ["backend=torch", "cluster=local", "cluster.devices_per_node=4", "logger=none"]
SENSITIVE = sensitive()
TP_PP = ["strategy.tp=2", "strategy.pp=2", "strategy.micro_batch_size=2"]
CASES = {
    "megatron_scatter_gather": ["strategy=megatron", *TP_PP, "strategy.sequence_parallel=false", "strategy.scatter_gather=true"],
    "megatron_sequence_parallel_selective": [
        "strategy=megatron",
        *TP_PP,
        "strategy.sequence_parallel=true",
        "strategy.recompute=selective",
    ],
    "deepspeed3d_scatter_gather": ["strategy=deepspeed3d", *TP_PP, "strategy.scatter_gather=true"],
    # Micro-batches of one sample, fewer rows than TP ranks: each sends its equal chunk of the
    # flattened activation, as Megatron-LM's split_tensor_into_1d_equal_chunks does.
    "megatron_scatter_gather_micro_batch_1": [
        "strategy=megatron",
        "strategy.tp=2",
        "strategy.pp=2",
        "strategy.micro_batch_size=1",
        "strategy.sequence_parallel=false",
        "strategy.scatter_gather=true",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    cases = {name: FOUR_WORKERS + GPT + overrides + [f"train.steps={STEPS}"] + SENSITIVE for name, overrides in CASES.items()}
    return launch_cases(tmp_path_factory.mktemp("tp_pp"), cases, 4)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    gpt = build_model({"name": "gpt", "preset": None, "layers": 4, "hidden": 64, "heads": 4, "vocab": 128}, 16)
    return reference_losses(gpt, 0, 8, STEPS, sensitive_optimizer())


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, reference, case):
    lines = [json.loads(line) for line in (runs[case] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if r["type"] == "step"]
    assert losses == pytest.approx(reference, rel=1e-4)


def test_scattered_transfers_are_gathered_over_tp_on_both_stages(runs):
    for case in ("megatron_scatter_gather", "deepspeed3d_scatter_gather", "megatron_scatter_gather_micro_batch_1"):
        events = trace_events(runs[case])
        gathers = {e["name"] for e in events if e.get("name", "").startswith("all_gather tp.")}
        assert len(gathers) == 2, f"{case}: {sorted(gathers)}"  # activations into stage 1, gradients into stage 0
