"""The real backend places every step's batch by the plan's balancing policy, on that step's
loads: the same order the planner gives that batch (no process is started here)."""

from __future__ import annotations

import pytest

from src.runtime.inputs import StepSamples, dataset_for, rank_reads
from src.setup import LIMITS, plan_run, validate
from src.strategies.base import PlanRequest
from src.strategies.disttrain.planner import plan_disttrain_batches
from src.strategies.megatron.planner import plan_megatron_batches
from tests.runtime.support import mllm_shard
from tests.test_configs import compose_config

BASE = [
    "logger=none",
    "model=mllm_9b",
    "model.scale=tiny",
    "model.images_per_sequence=2",
    "model.image_size_spread=0",
    "cluster=local",
    "cluster.devices_per_node=4",
    "train.global_batch=8",
    "strategy=megatron",
    "strategy.modality_stages=merged",
    "strategy.tp=1",
    "strategy.pp=2",
    "strategy.micro_batch_size=1",
    "train.data=interleaved",
    "train.balance=cost",
]


def _samples(plan, setup, dataset) -> StepSamples:
    reads = rank_reads(plan, setup.train.global_batch, {u.unit: 0 for u in plan.units})
    return StepSamples(setup.model, dataset, setup.train.global_batch, reads, plan.sample_order, plan.balancing)


def test_each_step_is_placed_as_the_planner_places_that_batch():
    setup = validate(compose_config(*BASE))
    plan = plan_run(setup)
    assert plan.balancing is not None and plan.balancing.policy == "cost"
    samples = _samples(plan, setup, dataset_for(setup.model, setup.train.seed, "synthetic", content="interleaved"))
    request = PlanRequest(setup.model, setup.cluster, setup.train, setup.config["strategy"], None, LIMITS["sim"])
    later = plan_megatron_batches(request, (1, 2))
    assert samples.order_of(0) == plan.sample_order
    assert [samples.order_of(1), samples.order_of(2)] == [p.sample_order for p in later]
    assert samples.order_of(1) != samples.order_of(0)  # a batch of other sequences, placed anew


@pytest.mark.parametrize("reorder", ["both", "cost"])
def test_disttrain_places_each_step_as_its_planner_reorders_that_batch(reorder):
    """DistTrain reorders every global batch (its §6): the plan carries its reordering, and
    each step is placed as the planner places that batch with the plan's degrees."""
    base = [o for o in BASE if not o.startswith(("strategy", "train.balance"))]
    setup = validate(compose_config(*base, "strategy=disttrain", "strategy.generator.pp=1", f"strategy.reorder={reorder}"))
    plan = plan_run(setup)
    assert plan.balancing is not None and plan.balancing.policy == reorder
    samples = _samples(plan, setup, dataset_for(setup.model, setup.train.seed, "synthetic", content="interleaved"))
    request = PlanRequest(setup.model, setup.cluster, setup.train, setup.config["strategy"], None, LIMITS["sim"])
    first, *later = plan_disttrain_batches(request, (0, 1, 2))
    assert samples.order_of(0) == plan.sample_order == first.sample_order
    assert [samples.order_of(1), samples.order_of(2)] == [p.sample_order for p in later]
    assert len({samples.order_of(s) for s in range(3)}) == 3  # each batch placed anew


def test_on_shards_a_step_is_placed_by_the_images_its_samples_hold(tmp_path):
    mllm_shard(tmp_path / "shard-0.tar", [2, 1, 3, 0, 1, 2, 0, 0] + [0, 4, 1, 1, 0, 2, 1, 1])
    shards = f"{tmp_path}/shard-*.tar"
    setup = validate(compose_config(*BASE, "backend=torch", f"backend.data={shards}"))
    plan = plan_run(setup)
    samples = _samples(plan, setup, dataset_for(setup.model, setup.train.seed, shards))
    assert samples.order_of(0) == plan.sample_order
    second = samples.order_of(1)
    assert second is not None and sorted(second) == list(range(8)) and second != plan.sample_order


@pytest.mark.parametrize("balance", ["none", None])
def test_a_plan_without_a_policy_keeps_its_order(balance):
    overrides = [o for o in BASE if not o.startswith("train.balance")] + ([f"train.balance={balance}"] if balance else [])
    setup = validate(compose_config(*overrides))
    plan = plan_run(setup)
    samples = _samples(plan, setup, dataset_for(setup.model, setup.train.seed, "synthetic", content="interleaved"))
    assert plan.balancing is None and samples.order_of(0) is None and samples.order_of(3) is None


def test_disttrain_in_data_order_carries_no_reordering():
    base = [o for o in BASE if not o.startswith(("strategy", "train.balance"))]
    setup = validate(compose_config(*base, "strategy=disttrain", "strategy.generator.pp=1", "strategy.reorder=none"))
    plan = plan_run(setup)
    assert plan.balancing is None and plan.sample_order == tuple(range(8))
