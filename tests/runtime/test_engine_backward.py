"""The executor's backward into a DeepSpeed engine (runtime.engines.backward): where it runs
autograd itself instead of DeepSpeed's `backward` (ZeRO-0), the gradients, the updated
parameters and DeepSpeed's own sample count equal those of DeepSpeed's `backward` on the
surrogate loss; the ZeRO stages whose backward does more keep DeepSpeed's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from src.runtime.driver import free_port
from tests.runtime.support import build_deepspeed_ops, run_forked

MICRO_BATCHES, CALLS = 2, 2  # backward calls per micro-batch: a Program's units, one by one


def _engine(zero_stage: int):
    from src.config import DeepSpeedSpec, OptimizerSpec
    from src.runtime.engines import EngineSettings, ParallelGroups, make_engine

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    groups = ParallelGroups(dist.group.WORLD, (0,), None, ())
    optimizer = OptimizerSpec(lr=0.1, weight_decay=0.01)
    settings = EngineSettings(
        zero_stage, micro_batch=2, accumulation=MICRO_BATCHES * CALLS, deepspeed=DeepSpeedSpec(optimizer=optimizer)
    )
    return make_engine(module, groups, settings)


def _steps(engine, run_backward) -> dict:
    """Two steps of MICRO_BATCHES micro-batches, each backward in CALLS pieces (the first
    layer's input gradient handed back, as the executor hands it between units)."""
    first, rest = engine.module[0], engine.module[1:]
    generator = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(2):
        for j in range(MICRO_BATCHES):
            x = torch.randn(2, 4, generator=generator)
            hidden = first(x)
            leaf = hidden.detach().requires_grad_()
            out = rest(leaf)
            run_backward(engine, [out], [torch.randn(out.shape, generator=generator)], j)
            run_backward(engine, [hidden], [leaf.grad], j)
        grads.append([p.grad.clone() for p in engine.module.parameters()])
        engine.step()
    return {"grads": grads, "params": [p.detach().clone() for p in engine.module.parameters()], "samples": engine.global_samples}


def _deepspeeds(engine, outputs, grads, micro_step) -> None:
    engine.backward(sum((o * g).sum() for o, g in zip(outputs, grads)), scale_wrt_gas=False)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    # DeepSpeed's CPU op under the project's build lock, as every process loads it: left to
    # the engine, DeepSpeed's own load would race a build running elsewhere.
    build_deepspeed_ops()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        from src.runtime.engines import backward, runs_autograd_backward

        results = {"taken": _steps(_engine(0), backward), "deepspeed": _steps(_engine(0), _deepspeeds)}
        results["autograd"] = {stage: runs_autograd_backward(_engine(stage)) for stage in (0, 1, 2)}
        results["reduces_alone"] = _engine(0).enable_backward_allreduce
        torch.save(results, f"{out}/results.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero0_backward_through_autograd_equals_deepspeeds(tmp_path: Path) -> None:
    run_forked(_worker, (free_port(), str(tmp_path)), 1)
    results = torch.load(tmp_path / "results.pt")
    taken, deepspeed = results["taken"], results["deepspeed"]
    for ours, theirs in zip(taken["grads"], deepspeed["grads"]):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    for a, b in zip(taken["params"], deepspeed["params"]):
        assert torch.equal(a, b)
    # Two steps of 4 backward calls each, counted as DeepSpeed counts them.
    assert taken["samples"] == deepspeed["samples"] > 0
    assert results["autograd"] == {0: True, 1: False, 2: False}
    # A data-parallel group of one: no all-reduce (DeepSpeed's would copy every gradient out and back).
    assert results["reduces_alone"] is False
