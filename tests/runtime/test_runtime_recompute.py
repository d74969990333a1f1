"""Recomputation runs for real on the real backend: under `full` every layer's forward runs
again in backward, under `selective` every attention core does, and the gradients are the
same as without recomputation. One process, the executor on a one-rank Megatron plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from src.runtime.executor import Executor
from src.runtime.inputs import Batches, StepSamples, dataset_for, rank_reads
from src.runtime.modules import blocks
from src.runtime.modules.units import build_units
from src.runtime.timing import StepTimer
from src.setup import plan_run, validate
from tests.runtime.support import GPT, composed

pytestmark = pytest.mark.slow  # starts worker processes

ONE_RANK = [
    "cluster=local",
    "cluster.devices_per_node=1",
    "backend=torch",
    "logger=none",
    "strategy=megatron",
    "strategy.tp=1",
    "strategy.pp=1",
    "strategy.micro_batch_size=8",
    "strategy.zero_stage=0",
]
BLOCKS = 4  # GPT's model.layers


class _Engine:
    """What the executor asks of a DeepSpeed engine, without DeepSpeed: backward only."""

    mpu, dp_world_size, optimizer = None, 1, None

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool) -> None:
        loss.backward()

    def zero_optimization_stage(self) -> int:
        return 0

    def step(self) -> None:
        pass


def _step(recompute: str) -> dict[str, torch.Tensor]:
    setup = validate(composed(GPT + ONE_RANK + [f"strategy.recompute={recompute}"]))
    plan = plan_run(setup)
    assert plan.unit("llm").recompute == recompute
    units = build_units(setup.model, 0, {}, {"llm": set(range(setup.model.unit("llm").num_layers))}, {"llm": recompute})
    batches = Batches(StepSamples(setup.model, dataset_for(setup.model, 0, "synthetic"), 8, rank_reads(plan, 8, {"llm": 0})))
    batches.start_step(0)
    executor = Executor(plan, setup.model, 0, units, {"llm": _Engine()}, None, batches, torch.device("cpu"), "fp32")
    instructions = plan.program.class_of(0).instructions
    executor.run_step(StepTimer(instructions, False))
    return {name: p.grad for name, p in units.named_parameters()}


@pytest.mark.parametrize(
    "recompute, blocks_run, cores_run", [("none", BLOCKS, BLOCKS), ("selective", BLOCKS, 2 * BLOCKS), ("full", 2 * BLOCKS, 2 * BLOCKS)]
)
def test_recomputation_reruns_what_it_says_and_gives_the_same_gradients(monkeypatch, recompute, blocks_run, cores_run):
    calls = {"block": 0, "core": 0}
    block_forward, core = blocks.Block.forward, F.scaled_dot_product_attention

    def counted_block(self, state):
        calls["block"] += 1
        return block_forward(self, state)

    def counted_core(*args, **kwargs):
        calls["core"] += 1
        return core(*args, **kwargs)

    monkeypatch.setattr(blocks.Block, "forward", counted_block)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_core)
    grads = _step(recompute)
    assert (calls["block"], calls["core"]) == (blocks_run, cores_run)
    monkeypatch.undo()
    for name, grad in _step("none").items():
        torch.testing.assert_close(grads[name], grad)
