"""Megatron-Core's --overlap-param-gather (strategy.overlap_param_gather): the distributed
optimizer's parameter all-gather chained into the next forward, one layer's at a time."""

from __future__ import annotations

import pytest

from src.costmodel.memory import rank_memory
from src.errors import ConfigError
from src.program import Collective, Compute, Plan, Wait
from src.sim.engine import simulate
from src.strategies import planner_for
from src.strategies.megatron.options import MegatronOptions
from tests.strategies.megatron.test_megatron import GPT_SMALL, request

# 16 GPUs as tp 2 x pp 2 x dp 4: each stage's distributed optimizer over 4 replicas.
FIXED = {"tp": 2, "pp": 2, "vpp": 1, "micro_batch_size": 2, "recompute": "none", "zero_stage": 1, "sequence_parallel": False}


def _request(**options):
    return request(GPT_SMALL, "perlmutter", 4, 64, **FIXED, **options)


def _plan(**options) -> Plan:
    return planner_for("megatron")(_request(**options))


def _gathers(instructions: list) -> list[Collective]:
    return [i for i in instructions if isinstance(i, Collective) and i.op == "all_gather" and i.kind == "dp"]


def test_each_layer_s_first_forward_waits_for_its_gather_and_issues_the_next() -> None:
    blocking, chained = _plan(), _plan(overlap_param_gather=True)
    assert (chained.unit("llm").param_gather, blocking.unit("llm").param_gather) == ("overlapped", "step_end")
    for whole, stage in zip(blocking.program.classes, chained.program.classes):
        [at_the_end] = _gathers(whole.instructions)
        assert at_the_end.blocking
        gathers = _gathers(stage.instructions)
        assert stage.instructions[0] is gathers[0]  # issued before the first forward (the step's zero_grad)
        assert not any(g.blocking for g in gathers) and len({g.handle for g in gathers}) == len(gathers)
        assert sum(g.bytes for g in gathers) == pytest.approx(at_the_end.bytes, rel=1e-12)  # the same parameters
        # Every gather is waited for, in issue order, right before the one-layer forward that
        # first uses its layer; each wait is followed by the next layer's gather.
        waits = [k for k, i in enumerate(stage.instructions) if isinstance(i, Wait)]
        assert [stage.instructions[k].handle for k in waits] == [g.handle for g in gathers]
        for n, k in enumerate(waits):
            following = stage.instructions[k + 1 : k + 3] if n + 1 < len(gathers) else stage.instructions[k + 1 : k + 2]
            if n + 1 < len(gathers):
                assert following[0] is gathers[n + 1]
            compute = following[-1]
            assert isinstance(compute, Compute) and compute.work.phase == "fwd" and compute.microbatch == 0
            assert compute.work.layers[1] - compute.work.layers[0] == 1


def test_chained_gathers_hide_under_the_forward_and_hold_the_same_memory() -> None:
    req = _request()
    blocking, chained = _plan(), _plan(overlap_param_gather=True)
    times = [simulate(p.program, req.model, req.cluster, req.train.precision).iteration_time for p in (blocking, chained)]
    assert times[1] < times[0]
    for whole, stage in zip(blocking.program.classes, chained.program.classes):
        units = {u.unit: u for u in blocking.units}
        assert rank_memory(stage, units, req.model, "bf16") == pytest.approx(rank_memory(whole, units, req.model, "bf16"), rel=1e-12)


def test_chained_gathers_need_the_distributed_optimizer_and_a_pipeline() -> None:
    with pytest.raises(ConfigError, match=r"overlap_param_gather=true .* needs strategy.zero_stage=1, got 0"):
        MegatronOptions(overlap_param_gather=True, zero_stage=0)
    clip = request({"name": "clip", "scale": "single_device"}, "perlmutter", 1, 64, zero_stage=1, overlap_param_gather=True)
    with pytest.raises(ConfigError, match="runs its towers colocated, without a pipeline"):
        planner_for("megatron")(clip)
