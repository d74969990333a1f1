"""DistTrain's data side: the interleaved-sequence distribution and the reordering
algorithms (docs/strategies.md, DistTrain), against hand-derived test vectors."""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import replace

import numpy as np
import pytest

from src.data.balance import vector_lpt
from src.data.loads import batch_loads
from src.data.order_search import makespans, time_tables
from src.data.interleaved import InterleavedData, encoder_costs, generator_costs, relative_loads, sampler
from src.models.registry import build_model
from src.data.disaggregated import Reordering, unit_loads
from src.schedules.chain import Chain
from src.data.reorder import StageTimes, group_loads, interval_volumes, inter_reorder, lpt


def test_lpt_matches_the_spec_vectors() -> None:
    sizes = [1, 2, 3, 3, 5, 9, 9]
    halves = lpt(sizes, 2)
    assert [[sizes[i] for i in g] for g in halves] == [[9, 5, 2], [9, 3, 3, 1]]
    assert group_loads(sizes, halves) == [16, 16]
    thirds = lpt(sizes, 3)
    assert [[sizes[i] for i in g] for g in thirds] == [[9, 2], [9, 1], [5, 3, 3]]
    assert group_loads(sizes, thirds) == [11, 10, 11]


def test_equal_count_lpt_caps_every_group() -> None:
    sizes = [10] + [1] * 9
    capped, plain = lpt(sizes, 2), lpt(sizes, 2, equal_count=False)
    assert group_loads(sizes, capped) == [14, 5] and [len(g) for g in capped] == [5, 5]
    assert group_loads(sizes, plain) == [10, 9] and [len(g) for g in plain] == [1, 9]


def _toy(size: float) -> StageTimes:
    """A hand-derived toy pipeline: stage costs [s, 2, 2, s/2], backward twice forward."""
    fwd = (size, 2.0, 2.0, 0.5 * size)
    return StageTimes(fwd, tuple(2 * f for f in fwd))


TOY_SIZES = [1, 3, 0.5, 2, 1.5, 0.8, 2.5, 1.2]


def test_interval_volumes_follow_the_1f1b_recurrence() -> None:
    volumes, makespan = interval_volumes([_toy(s) for s in TOY_SIZES])
    assert volumes == pytest.approx([15, 4, 0, 5, 2, 3, 4.4, -1])
    assert makespan == pytest.approx(60.2)


def test_inter_reorder_matches_the_spec_order_and_beats_the_input_order() -> None:
    order = inter_reorder([_toy(s) for s in TOY_SIZES])
    assert [TOY_SIZES[i] for i in order] == [0.5, 3, 2.5, 2, 1.5, 0.8, 1, 1.2]
    assert interval_volumes([_toy(TOY_SIZES[i]) for i in order])[1] == pytest.approx(58.7)
    descending = inter_reorder([_toy(s) for s in TOY_SIZES], descending_tail=True)
    assert interval_volumes([_toy(TOY_SIZES[i]) for i in descending])[1] == pytest.approx(58.3)
    assert sorted(order) == list(range(len(TOY_SIZES)))


def test_interleaved_layouts_are_seeded_skewed_and_fit_the_sequence() -> None:
    data = InterleavedData(seed=0, seq_len=8192, mean_images=8, base_side=16, side_spread=0.3)
    batch = data.batch(1000)
    assert batch == InterleavedData(0, 8192, 8, 16, 0.3).batch(1000)
    assert batch != InterleavedData(1, 8192, 8, 16, 0.3).batch(1000)
    assert all(layout.padding >= 0 and layout.images >= 1 for layout in batch)
    counts = [layout.images for layout in batch]
    assert statistics.median(counts) < statistics.mean(counts) < 8.5  # skewed right; overflow trims the mean
    assert max(counts) > 3 * statistics.median(counts)
    sizes = [side * side for layout in batch for side in layout.image_sides]
    assert statistics.median(sizes) == 256 and min(sizes) >= 64 and max(sizes) <= 1024
    assert {layout.images for layout in InterleavedData(0, 8192, 1, 16, 0.3).batch(50)} == {1}


def test_loads_are_relative_to_the_batch_mean() -> None:
    batch = InterleavedData(seed=3, seq_len=8192, mean_images=4, base_side=16, side_spread=0.3).batch(64)
    for costs in ([encoder_costs(layout, 1.0, 0.01) for layout in batch], [generator_costs(layout) for layout in batch]):
        loads, per_image = relative_loads(costs)
        assert statistics.mean(loads) == pytest.approx(1.0) and statistics.pstdev(loads) > 0.3
        assert [len(each) for each in per_image] == [layout.images for layout in batch]
        assert [sum(each) for each in per_image] == pytest.approx(loads)
    one = InterleavedData(seed=3, seq_len=8192, mean_images=4, base_side=16, side_spread=0.3).layout(0)
    assert encoder_costs(one, 1.0, 0.0) == tuple(s * s + 1 for s in one.image_sides)


def test_the_default_image_size_spread_draws_the_layouts_it_drew_as_a_module_constant() -> None:
    """model.image_size_spread=0.3 (the default) reproduces, bit for bit, the layouts drawn
    when the spread was the data module's constant (their digest, taken before the change)."""
    model = build_model({"name": "mllm_9b", "images_per_sequence": 4})
    assert model.extras["image_size_spread"] == 0.3
    layouts = [sampler(model, 7).layout(i) for i in range(256)]
    assert hashlib.sha256(repr(layouts).encode()).hexdigest()[:16] == "8c649c4016b1f0d9"


def test_spread_zero_draws_every_image_at_the_nominal_side_from_the_same_stream() -> None:
    spread, flat = (InterleavedData(3, 8192, 4, 16, sigma).batch(200) for sigma in (0.3, 0.0))
    assert {side for layout in flat for side in layout.image_sides} == {16}
    assert len({side for layout in spread for side in layout.image_sides}) > 5
    # The sides are drawn at spread 0 too: the captions that follow them are the same draws.
    kept = [(a, b) for a, b in zip(spread, flat) if a.images == b.images == 1]
    assert kept and all(a.caption_tokens == b.caption_tokens for a, b in kept)


def test_the_cost_reordering_mixes_heavy_and_light_sequences_in_a_shared_micro_batch() -> None:
    """Two LLM replicas share one generator replica, whose micro-batch of two sequences
    costs their sum: Algorithm 3's slots of like sizes put the two heaviest together, the
    cost policy spreads them (generator loads 4, 3, 1 and 0 against a mean of 2)."""
    stages = ((0.1,), (1.0,), (1.0,))
    gen = [4.0, 3.0, 1.0, 0.0]
    enc = [1.0] * 4

    def heaviest(policy: str) -> float:
        reordering = Reordering(policy, 2, 2, 1, (0.1, 1.0), stages, stages, Chain(((1, 1),) * 3))
        assignment = reordering.assignment(enc, gen)
        return max(max(row) for row in unit_loads(assignment, gen, 1, 2))

    assert heaviest("cost") == 2.5
    assert heaviest("both") == 3.5


def _slowest_pipeline(reordering: Reordering, positions: tuple[int, ...], enc: list[float], gen: list[float]) -> float:
    """The recurrence of the slowest pipeline of LLM replicas run in step (the devices' own
    orders of the reordering's chain), its slots in the order `positions` gives them, each
    shared unit's micro-batch at its sequences' mean."""
    b_me, b_mg = reordering.dp_lm // reordering.dp_me, reordering.dp_lm // reordering.dp_mg
    width, dp_lm = math.lcm(b_me, b_mg), reordering.dp_lm
    m = len(positions) // dp_lm
    spans = []
    for first in range(0, dp_lm, width):
        times = []
        for j in range(m):
            slot = positions[j * dp_lm + first : j * dp_lm + first + width]
            e = max(sum(enc[q] for q in slot[i : i + b_me]) / b_me for i in range(0, width, b_me))
            g = max(sum(gen[q] for q in slot[i : i + b_mg]) / b_mg for i in range(0, width, b_mg))
            times.append(reordering._slot_times(e, g))
        spans.append(float(makespans(time_tables([times]), np.array([0]), np.array([list(range(m))]), chain=reordering.chain)[0]))
    return max(spans)


def test_the_cost_reordering_is_never_slower_by_its_recurrence_than_disttrain_s_own() -> None:
    """MLLM-9B's plan on 1152 A800s shares an encoder replica among four LLM replicas and a
    generator replica among three (pipelines of 12 replicas), its LLM in two stages of two
    virtual stages each (stage seconds rounded; 24 LLM replicas of 16 micro-batches, the
    sampler's skewed sequences of ten images). Balanced slots are not always the shorter, so
    `cost` also searches on from Algorithms 2 and 3's placement and keeps the shorter by the
    recurrence of the devices' own orders: never longer than `both`, and here shorter than
    its balanced slots alone."""
    fwd = ((0.072,), (0.044, 0.044, 0.044, 0.048), (0.111,))
    bwd = ((0.215,), (0.084, 0.082, 0.082, 0.088), (0.093,))
    reordering = Reordering("cost", 24, 6, 8, (0.072, 0.068), fwd, bwd, Chain(((1, 1), (2, 2), (1, 1))))
    model = build_model({"name": "mllm_9b", "images_per_sequence": 10})
    for seed in range(3):
        loads = batch_loads(model, seed, 24 * 16, "interleaved", None)
        enc, gen = list(loads.by_unit["encoder"]), list(loads.by_unit["generator"])
        cost = _slowest_pipeline(reordering, reordering.assignment(enc, gen).positions, enc, gen)
        both = replace(reordering, policy="both").assignment(enc, gen).positions
        assert cost <= _slowest_pipeline(reordering, both, enc, gen)
        seconds = np.column_stack([enc, gen]) * reordering.per_sequence
        groups, balanced = reordering._inter(vector_lpt(seconds, range(len(enc)), 24), [], enc, gen, mixed=True)
        assert balanced == pytest.approx(_slowest_pipeline(reordering, _positions(groups, 24), enc, gen))
        assert cost < balanced


def _positions(groups: list[list[int]], dp_lm: int) -> tuple[int, ...]:
    return tuple(groups[r][j] for j in range(len(groups[0])) for r in range(dp_lm))


def test_a_reordering_s_chain_must_match_its_stages_times() -> None:
    """The recurrence runs the chain's orders over the stages' times: an LLM of two stages of
    two virtual stages each needs four LLM stage times, not three."""
    stages = ((0.1,), (1.0, 1.0, 1.0), (1.0,))
    with pytest.raises(ValueError, match=r"a chain of \[1, 4, 1\] virtual stages per unit over \[1, 3, 1\]"):
        Reordering("cost", 2, 2, 1, (0.1, 1.0), stages, stages, Chain(((1, 1), (2, 2), (1, 1))))
