"""Megatron-LM and ZeRO priced on the workload's data: under interleaved data each replica's
micro-batches carry the images they hold, as DistTrain's do on the same data."""

from __future__ import annotations

import math

import pytest

from src.batch_layout import BatchLayout
from src.data.balance import Dealt
from src.errors import ConfigError
from src.program import Compute
from src.setup import plan_run, validate
from src.strategies.builders.replicas import dealt_loads
from src.sim.engine import simulate
from tests.test_configs import compose_config

MLLM = ["model=mllm_9b", "model.images_per_sequence=10", "cluster=a800", "cluster.nodes=6", "train.global_batch=32"]
RIGID = ["strategy=megatron", "strategy.tp=8", "strategy.pp=3", "strategy.micro_batch_size=1"]


def _priced(*overrides: str):
    setup = validate(compose_config(*MLLM, *RIGID, *overrides))
    plan = plan_run(setup)
    return plan, simulate(plan.program, setup.model, setup.cluster, setup.train.precision).iteration_time


def test_interleaved_data_gives_each_replica_its_sequences_loads():
    uniform, uniform_s = _priced("train.data=uniform")
    skewed, skewed_s = _priced("train.data=interleaved")
    assert [c.label for c in uniform.program.classes] == ["stage 0", "stage 1", "stage 2"]
    assert len(skewed.program.classes) > 3  # the encoder's and generator's stages split by replica
    loads = {i.work.unit: [] for c in skewed.program.classes for i in c.instructions if isinstance(i, Compute)}
    for rank_class in skewed.program.classes:
        for instruction in rank_class.instructions:
            if isinstance(instruction, Compute) and instruction.work.phase == "fwd":
                loads[instruction.work.unit].append(instruction.work.load)
    assert set(loads["llm"]) == {1.0}  # a sequence's LLM work is its fixed length
    assert max(loads["encoder"]) > 1.5 and min(loads["generator"]) < 0.7
    assert sum(loads["encoder"]) / len(loads["encoder"]) == pytest.approx(1.0)  # the model's mean work
    assert skewed.sample_content == "interleaved" and skewed.sample_images is not None
    assert skewed_s > uniform_s  # stragglers hold the pipeline up


def test_zero_replicas_carry_their_own_sequences_too():
    setup = validate(compose_config(*MLLM, "cluster.nodes=1", "train.global_batch=16", "strategy=ddp", "strategy.zero_stage=3"))
    plan = plan_run(setup)
    assert len(plan.program.classes) == 8  # one per replica: each holds its own two sequences
    assert {c.pipelined for c in plan.program.classes} == {False}  # waiting on peers is imbalance
    uniform = plan_run(
        validate(
            compose_config(
                *MLLM, "cluster.nodes=1", "train.global_batch=16", "strategy=ddp", "strategy.zero_stage=3", "train.data=uniform"
            )
        )
    )
    assert len(uniform.program.classes) == 1


def test_a_replicated_stage_splits_by_replica_over_all_its_ranks():
    plan, _ = _priced("train.data=interleaved", "strategy.replicate=[encoder,generator]")
    encoder = [c for c in plan.program.classes if "encoder" in c.units]
    assert len(encoder) > 1 and sorted(r for c in encoder for r in c.ranks) == list(range(16))  # tp 8 x dp 2


def test_a_replicated_unit_deals_a_micro_batch_s_images_out_whole():
    # Two sequences of a batch whose mean is two images (each image 0.5 of the mean
    # sequence), one a micro-batch, over four ranks: the busiest rank runs one image of the
    # three-image sequence and the lone image of the other, as at the mean (ceil(2 / 4) = 1);
    # loads proportional to the images would price them at 1.5 and 0.5.
    batch = BatchLayout(2, 1, 1)
    assert dealt_loads(((0.5, 0.5, 0.5), (0.5,)), batch, (0, 1), Dealt("generator", 4, 2)) == ((1.0, 1.0),)
    # Over two ranks the three images deal 2 + 1: the busiest runs two of the mean's one.
    assert dealt_loads(((0.5, 0.5, 0.5), (0.5,)), batch, (0, 1), Dealt("generator", 2, 2)) == ((2.0, 1.0),)
    # Whole images of unequal cost: the busiest rank's are what the micro-batch costs.
    assert dealt_loads(((1.0, 0.25, 0.25), ()), batch, (0, 1), Dealt("encoder", 2, 2)) == ((2.5, 0.0),)


def test_a_replicated_generator_is_priced_by_its_busiest_rank_s_images():
    plan, _ = _priced("train.data=interleaved", "strategy.replicate=[encoder,generator]")
    loads = plan.sample_images
    assert loads is not None
    mean = sum(loads) / len(loads)
    priced = sorted(
        {
            round(i.work.load, 9)
            for c in plan.program.classes
            for i in c.instructions
            if isinstance(i, Compute) and i.work.unit == "generator" and i.work.phase == "fwd"
        }
    )
    # Ten images a sequence on eight ranks: two on the busiest at the mean; a micro-batch
    # of k images runs ceil(k / 8) there (every generated image costs the same).
    assert priced == sorted({round(math.ceil(k / 8) * 10 / mean / 2, 9) for k in loads})


def test_every_stage_of_a_replica_s_pipeline_is_split_alike():
    """A stage between the encoder's and the generator's waits on its own replica's: were it
    one class for every replica, the simulator would time all of them by one replica's
    neighbours and hide the stragglers."""
    plan, _ = _priced("train.data=interleaved")
    per_stage: dict[str, list[str]] = {}
    for rank_class in plan.program.classes:
        stage, _, replicas = rank_class.label.partition(" replica")
        per_stage.setdefault(stage, []).append(replicas)
    assert list(per_stage) == ["stage 0", "stage 1", "stage 2"]
    assert per_stage["stage 0"] == per_stage["stage 1"] == per_stage["stage 2"]
    assert len(per_stage["stage 1"]) == 2  # the LLM's stage too, one class per replica


@pytest.mark.parametrize("policy", ["reorder", "cost"])
def test_a_balancing_policy_places_the_sequences_and_shortens_the_iteration(policy):
    plain, plain_s = _priced("train.data=interleaved", "train.balance=none")
    balanced, balanced_s = _priced("train.data=interleaved", f"train.balance={policy}")
    assert plain.sample_order is None and plain.details.get("balance_policy") is None
    assert balanced.sample_order is not None and sorted(balanced.sample_order) == list(range(32))
    assert balanced.sample_order != tuple(range(32)) and balanced.details["balance_policy"] == policy
    assert balanced_s < plain_s


def test_balancing_uniform_data_moves_nothing():
    plan, _ = _priced("train.data=uniform", "train.balance=cost")
    assert plan.sample_order is None and plan.details["balance_policy"] == "cost"


def test_a_plan_chosen_on_the_data_is_the_fastest_there_of_the_leading_shapes_and_runs_as_priced():
    searched = [*MLLM, "strategy=megatron", "train.data=interleaved", "train.balance=cost", "strategy.choose_on=data"]
    setup = validate(compose_config(*searched))
    plan = plan_run(setup)
    trials = plan.details["search"]["on_the_data"]
    assert len(trials) > 1
    (chosen,) = [t for t in trials if t["chosen"]]
    assert chosen["on_the_data_s"] == min(t["on_the_data_s"] for t in trials)
    shapes = [(t["tp"], t["pp"], t["dp"], t["vpp"], t["micro_batch"]) for t in trials]
    assert len(set(shapes)) == len(shapes)  # each a shape of its own
    assert (plan.details["tp"], plan.details["pp"], plan.details["micro_batch"]) == (chosen["tp"], chosen["pp"], chosen["micro_batch"])
    # The plan kept is the one priced: placed on the same batch, it simulates to the same time.
    assert simulate(plan.program, setup.model, setup.cluster, setup.train.precision).iteration_time == pytest.approx(
        chosen["on_the_data_s"]
    )
    # Every choice fixed by hand leaves one candidate, which no ranking holds: it is priced
    # on the data all the same.
    by_hand = [*RIGID[1:], "strategy.vpp=1", "strategy.sequence_parallel=true", "strategy.recompute=none", "strategy.zero_stage=0"]
    only = plan_run(validate(compose_config(*searched, *by_hand)))
    assert only.details["search"]["fitting"] == 1
    (fixed,) = only.details["search"]["on_the_data"]
    assert fixed["chosen"] and (fixed["tp"], fixed["pp"]) == (8, 3)
    # Uniform data leaves nothing to choose on: the mean-load pick, no trials.
    uniform = plan_run(validate(compose_config(*searched, "train.data=uniform")))
    assert "on_the_data" not in uniform.details["search"]


def test_choosing_a_plan_on_something_else_is_one_line():
    with pytest.raises(ConfigError, match=r"strategy.choose_on='median'; choose one of \['mean', 'data'\]"):
        plan_run(validate(compose_config(*MLLM, "strategy=megatron", "strategy.choose_on=median")))
