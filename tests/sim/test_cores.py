"""Workers sharing a host's cores: a span computes at the share its node's other
computing workers leave it (src.sim.cores), hand-computed on the toy cluster."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from src.program import Collective, Compute, Group, Program, RankProgram
from src.costmodel.comm import CommModel, expected_maximum
from src.costmodel.compute import ComputeModel
from src.sim.cores import SETTLED, ComputeSpan, occupancy, relaxed, shares_cores, span_scales, speedup_limit
from src.sim.engine import compute_lower_bound, simulate
from tests.sim.test_sim_engine import F1, T_F1, two_ranks
from tests.sim.test_sim_programs import (
    INTRA_BW,
    INTRA_LAT,
    MODEL,
    PRECISION,
    all_reduce_s,
    assert_breakdown,
    make_cluster,
    p2p_s,
    recv,
    send,
)

# Two workers on one node: each alone at the peak, both at once at half of it.
SHARED = make_cluster(nodes=1, devices_per_node=2, oversubscription={1: 1.0, 2: 0.5})


def test_only_oversubscribed_nodes_share_cores() -> None:
    assert shares_cores(SHARED)
    assert not shares_cores(make_cluster(nodes=1, devices_per_node=2))
    assert not shares_cores(make_cluster(nodes=1, devices_per_node=2, oversubscription={1: 1.0, 2: 1.0}))


def test_span_scale_is_the_share_of_everyone_over_the_share_it_got() -> None:
    # Class 0 computes over [0, 2], class 1 over [0, 1]: class 0 shares the cores for
    # half its span (0.5) and has them alone for the other half (1.0): 0.75 on average.
    spans = [ComputeSpan((0, 0), 0.0, 2.0, ((0, 1),)), ComputeSpan((1, 0), 0.0, 1.0, ((0, 1),))]
    scales = span_scales(SHARED, spans)
    assert scales[(0, 0)] == pytest.approx(0.5 / 0.75)
    assert scales[(1, 0)] == pytest.approx(1.0)


def test_a_worker_left_alone_computes_at_the_whole_rate() -> None:
    # Left computes F1 twice, right once. Both at half the peak, right ends at 2 T; then
    # left has done one F1's work and does the second alone, at the whole peak: 3 T, not
    # the 4 T of pricing every span at the share of both computing.
    program = Program(
        world_size=2,
        classes=[
            RankProgram(ranks=(0,), instructions=[Compute(F1), Compute(F1)], label="left"),
            RankProgram(ranks=(1,), instructions=[Compute(F1)], label="right"),
        ],
    )
    assert simulate(program, MODEL, SHARED, PRECISION).iteration_time == pytest.approx(3 * T_F1, rel=2 * SETTLED)
    everyone = make_cluster(nodes=1, devices_per_node=2, peak_flops={"bf16": 0.5 * SHARED.peak_flops["bf16"]})
    assert simulate(program, MODEL, everyone, PRECISION).iteration_time == pytest.approx(4 * T_F1, rel=1e-6)


def test_a_class_of_two_ranks_counts_twice() -> None:
    # One class holding both workers: they always compute together, at half the peak.
    program = Program(world_size=2, classes=[RankProgram(ranks=(0, 1), instructions=[Compute(F1)], label="both")])
    assert simulate(program, MODEL, SHARED, PRECISION).iteration_time == pytest.approx(2 * T_F1, rel=1e-6)


def test_each_run_takes_the_mean_of_the_old_factor_and_the_new() -> None:
    assert relaxed({}, {(0, 0): 0.5}) == {(0, 0): 0.75}  # none before: 1
    assert relaxed({(0, 0): 0.75, (1, 0): 0.9}, {(0, 0): 0.5}) == {(0, 0): 0.625}  # a span that no longer ran is dropped


def test_a_wait_shorter_than_the_handover_keeps_the_core() -> None:
    # Class 0 computes over [0, 1] and [1.5, 2.5]; class 1 over [0, 2.5]. With every wait
    # handed over, class 1 has the cores alone for 0.5 of its 2.5: mean share (2 x 0.5 +
    # 0.5 x 1) / 2.5 = 0.6. Waits under 1 s kept: class 0 holds its core throughout.
    spans = [
        ComputeSpan((0, 0), 0.0, 1.0, ((0, 1),)),
        ComputeSpan((0, 2), 1.5, 2.5, ((0, 1),)),
        ComputeSpan((1, 0), 0.0, 2.5, ((0, 1),)),
    ]
    assert span_scales(SHARED, spans)[(1, 0)] == pytest.approx(0.5 / 0.6)
    keeping = replace(SHARED, core_handover_s=1.0)
    assert [(s.start, s.end) for s in occupancy(spans, 1.0)] == [(0.0, 2.5), (0.0, 2.5)]
    assert span_scales(keeping, spans)[(1, 0)] == pytest.approx(1.0)
    assert span_scales(replace(SHARED, core_handover_s=0.4), spans)[(1, 0)] == pytest.approx(0.5 / 0.6)  # 0.5 s is handed over


def test_the_speedup_limit_keeps_a_bound_a_bound() -> None:
    # All at 0.5, one alone at 1: a span priced at 0.5 can run twice as fast.
    assert speedup_limit(SHARED) == pytest.approx(0.5)
    assert speedup_limit(make_cluster(nodes=1, devices_per_node=2)) == 1.0
    program = Program(
        world_size=2,
        classes=[
            RankProgram(ranks=(0,), instructions=[Compute(F1), Compute(F1)], label="left"),
            RankProgram(ranks=(1,), instructions=[Compute(F1)], label="right"),
        ],
    )
    bound = compute_lower_bound(program, MODEL, ComputeModel(SHARED, PRECISION))
    assert bound == pytest.approx(4 * T_F1)  # both spans of the left at half the peak
    assert bound * speedup_limit(SHARED) <= simulate(program, MODEL, SHARED, PRECISION).iteration_time


# ---- how far apart workers reach a collective ---------------------------------------------
SKEW_S, SKEW_BUILD_S = 3e-3, 4e-3  # a lag of up to 3 ms, built up over 4 ms of compute


def lag(computed: float) -> float:
    return SKEW_S * (1 - math.exp(-computed / SKEW_BUILD_S))


def test_a_collective_waits_for_the_lag_built_since_the_last() -> None:
    # Two workers (the node's all): after 4 F1 (8 ms) the all-reduce waits for the slower
    # one's lag, as communication; one right after it waits for nothing more, the two
    # having just synchronized.
    lagging = make_cluster(nodes=1, devices_per_node=2, sync_skew_s=SKEW_S, sync_skew_build_s=SKEW_BUILD_S)
    ar = Collective("all_reduce", "g", 1e6, "dp", stream="compute")
    body = [Compute(F1)] * 4 + [ar, ar]
    program = Program(world_size=2, classes=[RankProgram(ranks=(0, 1), instructions=body, label="both")])
    program.add_group(Group("g", (0, 1)))
    iteration = 4 * T_F1 + 2 * all_reduce_s(2, 1e6, INTRA_BW, INTRA_LAT) + lag(4 * T_F1)
    timeline = simulate(program, MODEL, lagging, PRECISION)
    assert timeline.iteration_time == pytest.approx(iteration, rel=1e-9)
    assert_breakdown(timeline.ranks[0], iteration, compute=4 * T_F1, comm_dp=iteration - 4 * T_F1)
    steady = make_cluster(nodes=1, devices_per_node=2)
    assert simulate(program, MODEL, steady, PRECISION).iteration_time == pytest.approx(iteration - lag(4 * T_F1), rel=1e-9)


def test_a_count_of_collectives_waits_once_per_collective_and_a_pair_less_than_the_node() -> None:
    # A count of 4 stands for 4 all-reduces spread over the compute before it: 4 waits
    # after a quarter of it each. On a node of 4 workers (where the lag is measured over
    # all 4), a pair waits for the larger of 2 lags, not of 4.
    node = make_cluster(nodes=1, devices_per_node=4, sync_skew_s=SKEW_S, sync_skew_build_s=SKEW_BUILD_S)
    pair = lag(T_F1 / 4) * expected_maximum(2) / expected_maximum(4)
    assert CommModel(node).skew(2, T_F1 / 4) == pytest.approx(pair)
    assert CommModel(node).skew(4, T_F1) == pytest.approx(lag(T_F1))
    assert CommModel(node).skew(1, T_F1) == 0.0
    assert expected_maximum(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    ar = Collective("all_reduce", "g", 1e6, "tp", stream="compute", count=4)
    program = Program(world_size=2, classes=[RankProgram(ranks=(0, 1), instructions=[Compute(F1), ar], label="both")])
    program.add_group(Group("g", (0, 1)))
    steady = make_cluster(nodes=1, devices_per_node=4)
    waits = simulate(program, MODEL, node, PRECISION).iteration_time - simulate(program, MODEL, steady, PRECISION).iteration_time
    assert waits == pytest.approx(4 * pair, rel=1e-9)


def test_a_message_lands_late_by_the_lag_of_its_sender() -> None:
    # Left computes 4 F1 then sends; right receives at once: the message lands the pair's
    # expected lag after the model's clock, a wait on the peer (a bubble), not a transfer.
    lagging = make_cluster(nodes=1, devices_per_node=2, sync_skew_s=SKEW_S, sync_skew_build_s=SKEW_BUILD_S)
    program = two_ranks([Compute(F1)] * 4 + [send("a")], [recv("a")], messages=(("a", 0, 1),))
    transfer = p2p_s(1e6, INTRA_BW, INTRA_LAT)
    iteration = 4 * T_F1 + transfer + lag(4 * T_F1)
    timeline = simulate(program, MODEL, lagging, PRECISION)
    assert timeline.iteration_time == pytest.approx(iteration, rel=1e-9)
    right = [r for r in timeline.ranks if r.label == "right"][0]
    assert_breakdown(right, iteration, bubble_imbalance=iteration - transfer, comm_pp=transfer)


def test_the_step_ends_when_the_last_rank_does() -> None:
    # Two workers computing 4 F1 with no collective: the step (timed between barriers) ends
    # when the later of them does, by the lag of what they computed; the wait is idle.
    lagging = make_cluster(nodes=1, devices_per_node=2, sync_skew_s=SKEW_S, sync_skew_build_s=SKEW_BUILD_S)
    body = [Compute(F1)] * 4
    program = Program(world_size=2, classes=[RankProgram(ranks=(0, 1), instructions=body, label="both")])
    iteration = 4 * T_F1 + lag(4 * T_F1)
    timeline = simulate(program, MODEL, lagging, PRECISION)
    assert timeline.iteration_time == pytest.approx(iteration, rel=1e-9)
    assert_breakdown(timeline.ranks[0], iteration, compute=4 * T_F1, idle=lag(4 * T_F1))
