"""The floor under every placement of a batch (src/data/placement_bound.py): no permutation
of the sequences prices below it, and on uniform data it is within one micro-batch's step of
the recurrence."""

from __future__ import annotations

import random

import pytest

from src.batch_layout import BatchLayout
from src.data.balance import Balancer
from src.data.placement_bound import placement_bound, why_no_bound
from tests.data.test_balance import STAGES, _skewed


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_placement_prices_below_the_floor(seed):
    balancer, loads = Balancer(BatchLayout(48, 4, 1), STAGES), _skewed(48, seed)
    floor = placement_bound(balancer, loads)
    assert floor is not None and len(floor.last) == 48 and floor.steady == pytest.approx(0.45)
    rng = random.Random(seed)
    orders = [balancer.order(policy, loads) for policy in ("none", "reorder", "cost")]
    orders += [tuple(rng.sample(range(48), 48)) for _ in range(40)]
    spans = [balancer.makespan(loads, order) for order in orders]
    assert min(spans) >= floor.seconds - 1e-9


def test_the_floor_is_the_recurrence_on_uniform_data():
    balancer = Balancer(BatchLayout(48, 4, 1), STAGES)
    uniform = {unit: [1.0] * 48 for unit in ("encoder", "generator")}
    floor = placement_bound(balancer, uniform)
    span = balancer.makespan(uniform, tuple(range(48)))
    assert floor is not None and floor.seconds - 1e-9 <= span <= floor.seconds + STAGES[2].fwd + STAGES[2].bwd


def test_skew_costs_every_placement_something():
    """Micro-batches heavier on the last stage than its neighbour's steady state cost time that
    light ones do not give back: the floor of the skewed batch is above the uniform iteration."""
    balancer, loads = Balancer(BatchLayout(48, 4, 1), STAGES), _skewed(48)
    uniform = {unit: [1.0] * 48 for unit in loads}
    floor = placement_bound(balancer, loads)
    assert floor is not None and floor.seconds > balancer.makespan(uniform, tuple(range(48)))


@pytest.mark.parametrize(
    "balancer, reason",
    [
        (Balancer(BatchLayout(48, 4, 1), STAGES, extra_warmup=2), "warm-up"),
        (Balancer(BatchLayout(48, 4, 2), STAGES), "micro-batches of 2"),
        (Balancer(BatchLayout(48, 4, 1), STAGES[:1]), "one stage"),
    ],
)
def test_no_floor_where_a_placement_can_beat_it(balancer, reason):
    assert reason in (why_no_bound(balancer) or "")
    assert placement_bound(balancer, _skewed(48)) is None
