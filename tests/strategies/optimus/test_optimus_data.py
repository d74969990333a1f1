"""Optimus on the workload's data: its schedule, made at the mean load, run by each LLM
replica with its own micro-batches' images (strategies.optimus.data)."""

from __future__ import annotations

import pytest

from src.batch_layout import BatchLayout
from src.data.interleaved import InterleavedData, sampler
from src.data.loads import batch_loads
from src.errors import ConfigError
from src.program import Collective, Compute
from src.setup import LIMITS, plan_run, validate
from src.sim.engine import simulate
from src.strategies.base import PlanRequest
from src.strategies.builders.replicas import replica_loads
from src.strategies.optimus.planner import plan_optimus_batches
from tests.test_configs import compose_config

OPTIMUS = [
    "model=optimus",
    "model.encoders=[vit_3b]",
    "model.llm=gpt_11b",
    "model.images_per_sample=4",
    "cluster=dgx_a100",
    "cluster.nodes=2",
    "train.global_batch=32",
    "strategy=optimus",
    "strategy.encoder.tp=2",
    "strategy.encoder.pp=1",
    "strategy.llm.tp=2",
    "strategy.llm.pp=4",
]


def _planned(*overrides: str):
    setup = validate(compose_config(*OPTIMUS, *overrides))
    plan = plan_run(setup)
    return setup, plan, simulate(plan.program, setup.model, setup.cluster, setup.train.precision).iteration_time


def _encoder_loads(plan) -> dict[tuple[int, ...], dict[int, set[float]]]:
    """Per rank class (its ranks), the loads its encoder forwards carry, by micro-batch."""
    out: dict[tuple[int, ...], dict[int, set[float]]] = {}
    for rank_class in plan.program.classes:
        by_microbatch = out.setdefault(rank_class.ranks, {})
        for i in rank_class.instructions:
            if isinstance(i, Compute) and i.work.unit == "encoder" and i.work.phase == "fwd":
                by_microbatch.setdefault(i.microbatch, set()).add(i.work.load)
    return out


def test_uniform_data_keeps_one_class_per_stage_and_column():
    _, plan, _ = _planned("train.data=uniform")
    assert len(plan.program.classes) == 4 * 1  # LLM stages x columns (encoder TP 2 of the LLM's 2)
    assert {load for c in _encoder_loads(plan).values() for loads in c.values() for load in loads} == {1.0}
    assert "data" not in plan.details


def test_each_llm_replica_runs_its_own_sequences_images():
    setup, uniform, uniform_s = _planned("train.data=uniform")
    _, plan, skewed_s = _planned("train.data=interleaved")
    assert len(plan.program.classes) == 4 * 2  # the stages split by the two LLM replicas
    assert sorted(r for c in plan.program.classes for r in c.ranks) == list(range(16))
    # The encoder's loads are the batch's sequences', replica by replica, in data order.
    train = setup.train
    loads = batch_loads(setup.model, train.seed, train.global_batch, "interleaved", None)
    expected = replica_loads(loads.by_unit["encoder"], BatchLayout(train.global_batch, 2, 2), tuple(range(train.global_batch)))
    assert len(set(expected)) == 2  # the two replicas carry different loads
    for ranks, by_microbatch in _encoder_loads(plan).items():
        replica = 0 if ranks in {c.ranks for c in plan.program.classes if "replica 0" in c.label} else 1
        assert {mb: loads for mb, loads in by_microbatch.items()} == {mb: {expected[replica][mb]} for mb in by_microbatch}
    llm_loads = {i.work.load for c in plan.program.classes for i in c.instructions if isinstance(i, Compute) and i.work.unit == "llm"}
    assert llm_loads == {1.0}  # every sequence is 2048 tokens
    assert plan.sample_content == "interleaved" and plan.details["data"] == "interleaved"
    assert skewed_s != uniform_s


def test_a_replica_class_reduces_its_encoder_rows_on_its_own_tp_group():
    _, plan, _ = _planned("train.data=interleaved")
    groups = plan.program.groups
    for rank_class in plan.program.classes:
        for i in rank_class.instructions:
            if isinstance(i, Collective) and i.kind == "tp":
                # Each class's TP collectives run on the group through its own first rank: the
                # encoder's (TP 2, the class's two ranks) and the LLM stage's (TP 2, the same).
                assert rank_class.ranks[0] in groups[i.group].ranks
    encoder_groups = {
        i.group for c in plan.program.classes for i in c.instructions if isinstance(i, Collective) and i.group.startswith("encoder.tp")
    }
    assert len(encoder_groups) == 8  # four encoder pipelines (one per LLM stage) x two replicas


@pytest.mark.parametrize("policy", ["cost", "reorder"])
def test_a_balancing_policy_places_the_sequences(policy):
    _, plan, _ = _planned("train.data=interleaved", f"train.balance={policy}")
    order = plan.details["sample_order"]
    assert sorted(order) == list(range(32)) and order != list(range(32))
    assert plan.details["balance_policy"] == policy and plan.sample_order == tuple(order)


def test_each_encoder_carries_its_own_loads_of_the_same_images():
    setup, plan, _ = _planned("train.data=interleaved", "model.encoders=[vit_3b,vit_5b]")
    loads = batch_loads(setup.model, 0, 32, "interleaved", None)
    first, second = loads.by_unit["encoder0"], loads.by_unit["encoder1"]
    assert sum(first) == pytest.approx(32) and sum(second) == pytest.approx(32)  # each against its own mean
    # The same images: the same heaviest sequence, weighed by each ViT's own FLOPs per token
    # and per token squared (their widths differ, so their attention's share does).
    assert max(range(32), key=first.__getitem__) == max(range(32), key=second.__getitem__) and first != second
    carried = {
        unit: {i.work.load for c in plan.program.classes for i in c.instructions if isinstance(i, Compute) and i.work.unit == unit}
        for unit in ("encoder0", "encoder1")
    }
    assert len(carried["encoder0"]) > 1 and len(carried["encoder1"]) > 1 and carried["encoder0"] != carried["encoder1"]


def test_one_schedule_is_priced_on_each_batch():
    setup = validate(compose_config(*OPTIMUS, "train.data=interleaved"))
    request = PlanRequest(setup.model, setup.cluster, setup.train, setup.config["strategy"], None, LIMITS["sim"])
    first, second = plan_optimus_batches(request, (0, 1))
    assert first.details["partition"] == second.details["partition"]  # chosen once, at the mean load
    assert _encoder_loads(first) != _encoder_loads(second)  # each batch's sequences
    assert first.program is not second.program and len(first.program.classes) == len(second.program.classes) == 8


def test_a_dual_encoder_sequence_holds_both_encoders_tokens_of_each_image():
    setup = validate(compose_config(*OPTIMUS, "model.encoders=[vit_3b,vit_5b]", "train.data=interleaved"))
    data = sampler(setup.model, 0)
    assert data.copies == 2 and sampler(validate(compose_config(*OPTIMUS, "train.data=interleaved")).model, 0).copies == 1
    layouts = data.batch(256)
    assert all(layout.image_tokens == 2 * sum(s * s for s in layout.image_sides) for layout in layouts)
    assert all(layout.padding >= 0 for layout in layouts)  # both encoders' tokens fit the 2048-token sequence
    # The tail that would overflow drops images: one encoder's sequences keep more of them.
    single = InterleavedData(0, 2048, 4, 16, 0.3)
    assert sum(layout.images for layout in layouts) < sum(layout.images for layout in single.batch(256))


def test_images_too_large_for_interleaved_sequences_are_one_line():
    # Two encoders' 1024 tokens of one 448-px image fill the 2048-token sequence: no room for text.
    too_large = [
        *OPTIMUS,
        "model.encoders=[vit_3b,vit_5b]",
        "model.images_per_sample=1",
        "model.image_size=448",
        "train.data=interleaved",
    ]
    with pytest.raises(ConfigError, match=r"one image at the nominal side takes 2 x 1024 tokens.*2048-token sequence"):
        plan_run(validate(compose_config(*too_large)))
