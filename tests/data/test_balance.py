"""The balancing step: a permutation of the step's batch that shortens the cost model's
critical path, each policy as documented in src/data/balance.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from src.batch_layout import BatchLayout
from src.config import train_from_config
from src.data.balance import Balancer, Dealt, StageCosts, busiest_share, dealt_images, spread, vector_lpt
from src.data.loads import BatchLoads
from src.data.reorder import lpt
from src.errors import ConfigError
from src.setup import validate
from tests.test_configs import compose_config

# An encoder stage, two LLM stages and a generator stage, as Megatron-LM's MLLM pipelines are cut.
STAGES = (
    StageCosts(0.0, 0.0, (("encoder", 0.02),), (("encoder", 0.04),)),
    StageCosts(0.15, 0.30),
    StageCosts(0.15, 0.30),
    StageCosts(0.0, 0.0, (("generator", 0.14),), (("generator", 0.12),)),
)


def _skewed(count: int, seed: int = 3) -> dict[str, list[float]]:
    """Loads of mean 1 with a long tail, the generator's (images) and encoder's (their sizes) apart."""
    rng = random.Random(seed)
    images = [1 + int(rng.expovariate(1 / 9)) for _ in range(count)]
    sizes = [n * rng.uniform(0.5, 1.5) for n in images]
    return {
        "encoder": [s * count / sum(sizes) for s in sizes],
        "generator": [n * count / sum(images) for n in images],
    }


@pytest.mark.parametrize("dp, micro_batch", [(1, 1), (4, 1), (4, 2), (3, 4)])
@pytest.mark.parametrize("policy", ["none", "reorder", "cost"])
def test_every_policy_permutes_the_batch(dp, micro_batch, policy):
    layout = BatchLayout(24, dp, micro_batch)
    order = Balancer(layout, STAGES).order(policy, _skewed(24))
    assert sorted(order) == list(range(24))


def test_none_keeps_the_data_order():
    assert Balancer(BatchLayout(16, 4), STAGES).order("none", _skewed(16)) == tuple(range(16))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_balanced_policies_shorten_the_critical_path(seed):
    layout = BatchLayout(96, 8, 1)
    balancer, loads = Balancer(layout, STAGES), _skewed(96, seed)
    alike = {unit: [1.0] * 96 for unit in loads}
    spans = {policy: balancer.makespan(loads, balancer.order(policy, loads)) for policy in ("none", "reorder", "cost")}
    uniform = balancer.makespan(alike, tuple(range(96)))
    assert spans["none"] > uniform  # skew costs
    assert spans["cost"] < spans["none"] and spans["reorder"] < spans["none"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_extra_warmup_lets_the_quick_micro_batches_catch_up_on_the_slow_ones(seed):
    # The generator's stage is the last: under 1F1B a heavy micro-batch there stalls every stage
    # before it; k more warm-up forwards queue k micro-batches in front of it, which the light
    # ones after a heavy one drain. The recurrence prices the plan's schedule, deeper warm-up included.
    layout, loads = BatchLayout(96, 8, 1), _skewed(96, seed)
    alike = {unit: [1.0] * 96 for unit in loads}
    plain = Balancer(layout, STAGES)
    none, uniform = plain.makespan(loads, tuple(range(96))), plain.makespan(alike, tuple(range(96)))
    recovered = []  # of what skew costs Megatron-LM's 1F1B in the data order
    for extra in (0, 2, 4):
        balancer = Balancer(layout, STAGES, extra_warmup=extra)
        recovered.append((none - balancer.makespan(loads, balancer.order("cost", loads))) / (none - uniform))
    assert 0 < recovered[0] < recovered[1] < recovered[2]
    assert recovered[2] > 0.75


def test_spread_lays_the_heavy_items_evenly_along_the_order():
    order = spread([10.0] * 5 + [1.0] * 15)
    assert sorted(order) == list(range(20)) and order[0] == 0  # the heaviest first
    heavy = [position for position, item in enumerate(order) if item < 5]
    assert min(b - a for a, b in zip(heavy, heavy[1:])) >= 3  # 20 / 5 = 4 apart at best


def test_cost_balances_each_stage_where_a_sum_does_not():
    """Scalar LPT (Algorithm 2) sees two sequences of size 3 and two of 1.5 and pairs each
    large with a small; split by stage, one replica gets all the encoder's work."""
    seconds = np.array([[3.0, 0.0], [0.0, 3.0], [1.5, 0.0], [0.0, 1.5]])
    scalar = lpt(seconds.sum(axis=1).tolist(), 2)
    vector = vector_lpt(seconds, range(4), 2)
    busiest = lambda groups: max(seconds[g].sum(axis=0).max() for g in groups)  # noqa: E731
    assert busiest(scalar) == 4.5 and busiest(vector) == 3.0
    assert sorted(len(g) for g in vector) == [2, 2]


def test_a_micro_batch_of_several_sequences_takes_their_mean_load():
    balancer = Balancer(BatchLayout(4, 1, 2), STAGES)
    loads = {"encoder": [1.0, 3.0, 1.0, 1.0], "generator": [2.0, 0.0, 1.0, 1.0]}
    times = balancer.times([0, 1], loads)
    assert times.fwd[0] == pytest.approx(0.02 * 2.0) and times.fwd[3] == pytest.approx(0.14 * 1.0)
    assert times.bwd[1] == pytest.approx(0.30)


def test_bad_requests_are_one_line():
    with pytest.raises(ConfigError, match="choose one of"):
        Balancer(BatchLayout(8, 2), STAGES).order("greedy", _skewed(8))
    with pytest.raises(ConfigError, match="sample groups scored together"):
        Balancer(BatchLayout(8, 2, 1, groups=2), STAGES)
    with pytest.raises(ConfigError, match="7 encoder loads for a batch of 8"):
        Balancer(BatchLayout(8, 2), STAGES).order("cost", {"encoder": [1.0] * 7, "generator": [1.0] * 8})


def test_train_balance_is_checked_at_the_door():
    cluster = validate(compose_config("model=mllm_9b", "cluster=a800")).cluster
    with pytest.raises(ConfigError, match=r"train.balance='fast'; choose one of \['none', 'reorder', 'cost'\]"):
        train_from_config({"global_batch": 8, "steps": 1, "balance": "fast"}, cluster)
    assert train_from_config({"global_batch": 8, "steps": 1}, cluster).balance is None


def test_a_dealt_unit_weighs_a_sequence_by_its_busiest_rank_s_images():
    # The generator replicated over 4 ranks, built for 2 images a sequence: the busiest rank
    # runs ceil(2 / 4) = 1 image at the mean. Sequences of 3, 1 and 5 images (the batch's
    # mean 3: each image a third of the mean sequence) run 1, 1 and 2 images there.
    thirds = tuple((1 / 3,) * n for n in (3, 1, 5))
    loads = BatchLoads(
        {"encoder": (1.0, 1 / 3, 5 / 3), "generator": (1.0, 1 / 3, 5 / 3)}, (3, 1, 5), {"encoder": thirds, "generator": thirds}
    )
    dealt = Balancer(BatchLayout(3, 1), STAGES, (Dealt("generator", 4, 2),))
    by_unit = dealt.sequence_loads(loads)
    assert by_unit["generator"] == pytest.approx((2 / 3, 2 / 3, 4 / 3))
    assert by_unit["encoder"] == loads.by_unit["encoder"]  # split by TP: in proportion to its images
    assert Balancer(BatchLayout(3, 1), STAGES).sequence_loads(loads)["generator"] == loads.by_unit["generator"]
    # Whole images of unequal loads over two ranks: the heavier half is the busiest's.
    assert busiest_share((1.0, 0.25, 0.25), 2) == 1.25 and busiest_share((0.5,), 4) == 0.5 and busiest_share((), 2) == 0.0


def test_the_images_dealt_to_each_share_are_the_blocks_busiest_share_prices():
    # The real backend runs these blocks (data.interleaved_mllm.dealt_slots); the plan prices the busiest.
    loads = (0.5, 2.0, 0.25, 1.0, 0.75)
    for shares in (1, 2, 3, 5, 8):
        blocks = dealt_images(len(loads), shares)
        assert len(blocks) == shares
        assert [i for block in blocks for i in block] == list(range(len(loads)))  # every image once, in order
        sizes = [len(block) for block in blocks]
        assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1  # the first ranks one more
        assert busiest_share(loads, shares) == max(sum(loads[i] for i in block) for block in blocks)
    assert dealt_images(5, 2) == (range(0, 3), range(3, 5))
    assert dealt_images(1, 2) == (range(0, 1), range(1, 1))  # fewer images than shares: a rank runs none
    assert dealt_images(0, 2) == (range(0, 0), range(0, 0))


def test_a_dealt_unit_weighs_the_sequences_of_a_shared_micro_batch_by_their_images():
    # The generator replicated over 8 ranks, built for 8 images a sequence; micro-batches of two
    # sequences of 1, 8, 8 and 15 images (each image an eighth of the mean sequence). Alone, a
    # sequence of 1 image costs the busiest rank as much as one of 8: dealt together, the pair
    # {15, 1} costs it 2 images, as {8, 8} does, and {15, 8} costs 3.
    counts = (1, 8, 8, 15)
    eighths = tuple((1 / 8,) * n for n in counts)
    loads = BatchLoads(
        {"encoder": (1.0,) * 4, "generator": tuple(n / 8 for n in counts)},
        counts,
        {"encoder": tuple((1 / n,) * n for n in counts), "generator": eighths},
    )
    dealt = Dealt("generator", 8, 8)
    balancer = Balancer(BatchLayout(4, 1, 2), STAGES, (dealt,))
    assert balancer.sequence_loads(loads)["generator"] == loads.by_unit["generator"]
    order = balancer.order("cost", balancer.sequence_loads(loads))
    pairs = [sorted(counts[q] for q in order[p : p + 2]) for p in (0, 2)]
    assert sorted(pairs) == [[1, 15], [8, 8]]
    assert [dealt.load([x for q in order[p : p + 2] for x in eighths[q]], 2) for p in (0, 2)] == [1.0, 1.0]
