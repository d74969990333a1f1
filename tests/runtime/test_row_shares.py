"""A unit replicated over its TP group (runtime.row_shares): each rank reads its TP group's
whole micro-batch and runs its share, the blocks the plan prices (data.balance.dealt_images):
the images dealt to it on interleaved data, its block of rows on sequences alike. What the
ranks read, without starting any (they run: test_runtime_replicate, interleaved and
replicated_one_sequence_zero1)."""

from __future__ import annotations

import pytest
import torch

from src.data.balance import dealt_images
from src.data.interleaved_mllm import dealt_slots
from src.runtime.inputs import StepSamples, dataset_for, rank_reads
from src.runtime.placement import placements
from src.runtime.row_shares import dealing_units, rank_shares
from src.setup import plan_run, validate
from tests.runtime.support import composed

REPLICATED = [
    "backend=torch",
    "cluster=local",
    "cluster.devices_per_node=6",
    "logger=none",
    "model=mllm_9b",
    "model.scale=tiny",
    "model.images_per_sequence=2",
    "train.data=interleaved",
    "train.global_batch=8",
    "strategy=megatron",
    "strategy.tp=2",
    "strategy.pp=3",
    "strategy.micro_batch_size=2",
    "strategy.sequence_parallel=false",
    "strategy.replicate=[encoder,generator]",
]


def test_a_share_s_slots_are_its_dealt_block_of_the_micro_batch_s_images_in_sequence_order():
    slots = torch.tensor([[True, False, False], [True, True, True], [False, False, False], [True, True, False]])
    dealt = [dealt_slots(slots, i, 4) for i in range(4)]
    # Six images in order (row 0's, row 1's three, row 3's two) over four shares: 2, 2, 1, 1.
    assert [d.nonzero().tolist() for d in dealt] == [[[0, 0], [1, 0]], [[1, 1], [1, 2]], [[3, 0]], [[3, 1]]]
    assert not dealt_slots(slots[:1], 1, 2).any()  # one image over two shares: the second runs none


def test_each_rank_of_a_replicated_unit_reads_the_whole_micro_batch_and_runs_its_dealt_images():
    setup = validate(composed(REPLICATED))
    plan, model = plan_run(setup), setup.model
    dataset = dataset_for(model, setup.train.seed, "synthetic", content="interleaved")
    dealing = dealing_units(plan, model)
    assert dealing == {"encoder": 2, "generator": 2}

    def made(rank: int) -> dict:
        return _made(plan, model, dataset, setup.train.global_batch, rank)

    llm = made(2)
    encoders, generators = (made(0), made(1)), (made(4), made(5))
    mean = dataset.images_mean(list(range(setup.train.global_batch)))
    split = False
    for j in range(plan.unit("llm").num_microbatches):
        whole = llm[("llm", j)]
        sides = whole["image_sides"][whole["image_slots"]].tolist()  # the micro-batch's images in sequence order
        blocks = dealt_images(len(sides), 2)
        for block, encoder, generator in zip(blocks, (e[("encoder", j)] for e in encoders), (g[("generator", j)] for g in generators)):
            assert torch.equal(encoder["image_sides"], whole["image_sides"])  # the whole micro-batch's sequences
            assert encoder["patch_sides"].tolist() == sides[block.start : block.stop]
            assert len(encoder["patches"]) == sum(side * side for side in sides[block.start : block.stop])
            assert torch.equal(generator["image_slots"], encoder["image_slots"])  # the same images, generated
            assert len(generator["noise"]) == len(block)
            # A share's loss is its part of the micro-batch's (two rows at the step's mean images, halved).
            assert float(generator["loss_norm"].sum()) == pytest.approx(mean)
        split |= int(whole["image_slots"][0].sum()) != len(blocks[0])  # rows shares would run other images
    assert split


def test_on_sequences_alike_each_rank_runs_its_block_of_rows_and_its_part_of_the_loss():
    """Micro-batches of one sequence over two ranks: the first runs the row, the second none;
    each generator loss is normalised to the micro-batch's rows per share."""
    overrides = [o for o in REPLICATED if not o.startswith(("model.images_per_sequence", "train.data", "strategy.micro_batch"))]
    setup = validate(composed([*overrides, "train.data=uniform", "strategy.micro_batch_size=1"]))
    plan, model = plan_run(setup), setup.model
    dataset = dataset_for(model, setup.train.seed, "synthetic")
    assert [placements(plan, rank)["encoder"].rows for rank in (0, 1)] == [range(0, 1), range(1, 1)]
    batch = setup.train.global_batch
    llm, (first, second) = _made(plan, model, dataset, batch, 2), (_made(plan, model, dataset, batch, r) for r in (4, 5))
    for j in range(plan.unit("llm").num_microbatches):
        assert len(llm[("llm", j)]["ids"]) == 1
        assert len(first[("generator", j)]["noise"]) == 1 and len(second[("generator", j)]["noise"]) == 0
        for share in (first, second):
            assert float(share[("generator", j)]["loss_norm"].sum()) == pytest.approx(0.5)


def _made(plan, model, dataset, global_batch: int, rank: int) -> dict:
    """The micro-batches `rank` reads in the first step."""
    shares = rank_shares(plan, rank)
    reads = rank_reads(plan, global_batch, {name: place.dp_ranks.index(rank) for name, place in placements(plan, rank).items()})
    return StepSamples(model, dataset, global_batch, reads, plan.sample_order, plan.balancing, shares).make(0)
