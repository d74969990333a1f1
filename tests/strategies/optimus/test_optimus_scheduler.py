"""The bubble scheduler's shortcuts change nothing: its incremental estimates equal a pricing
of the whole schedule from scratch (the scheduler's original, quadratic code), and skipping
full bubbles keeps first fit."""

from __future__ import annotations

import math
import random

import pytest

from src.strategies.optimus import planner as optimus_planner
from src.strategies.optimus.scheduler import BubbleScheduler, Schedule, partitions
from tests.strategies.optimus.test_optimus import MODEL_A, SMALL, candidate, setup


def from_scratch(sch: BubbleScheduler, schedule: Schedule) -> tuple[float, float, dict[tuple[int, int], int]]:
    """(Δ, latency, mapping): every pipeline's forwards and backwards priced job after job."""
    layout, costs, pp = sch.layout, sch.costs, sch.pp
    pre_end = [0.0] * layout.classes
    pre_ef = []
    for j in range(layout.pipelines):
        previous = [0.0] * pp
        for t in range(schedule.pre[j]):
            arrive = 0.0
            for e in range(pp):
                previous[e] = max(previous[e], arrive) + sch.fwd[e]
                arrive = previous[e] + (costs.hops[e] if e < pp - 1 else costs.to_llm)
            pre_ef.append((arrive, j, t))
        for e in range(pp):
            pre_end[sch.classes_of[j][e]] = previous[e]
    delta = max([sch.delta0] + [pre_end[g] - sch.first[sch.stage_of_class[g]] for g in range(layout.classes)])
    pre_ef.sort()
    fine = sorted((ef, j, t) for (j, t), ef in schedule.fine_forward.items())
    delta = sch._dependency_delta([ef for ef, _, _ in pre_ef], [ef for ef, _, _ in fine], delta)
    if not math.isfinite(delta):
        return math.inf, math.inf, {}
    merged = sorted([(ef, 0, j, t) for ef, j, t in pre_ef] + [(ef + delta, 1, j, t) for ef, j, t in fine])
    mapping = {(j, t): i for i, (_, _, j, t) in enumerate(merged)}
    post_end = [0.0] * layout.classes
    for j in range(layout.pipelines):
        waiting = sorted(sch.b_points[mapping[(j, t)]] for t in range(schedule.counts[j]) if (j, t) not in schedule.fine_backward)
        if not waiting or not sch.trains:
            continue
        previous = [delta + sch.last[sch.stage_of_class[sch.classes_of[j][e]]] for e in range(pp)]
        for point in waiting:
            arrive = delta + point + costs.to_llm
            for e in reversed(range(pp)):
                previous[e] = max(previous[e], arrive) + sch.bwd[e]
                arrive = previous[e] + (costs.hops[e - 1] if e > 0 else 0.0)
        for e in range(pp):
            post_end[sch.classes_of[j][e]] = previous[e]
    tails, latency = sch.tails, 0.0
    encoder_ready = [0.0] * pp
    for g in range(layout.classes):
        s, e = sch.stage_of_class[g], layout.position(g)[2]
        done = max(delta + sch.last[s] + tails.llm_reduce[s], post_end[g]) + tails.llm_optimizer[s]
        latency = max(latency, done)
        encoder_ready[e] = max(encoder_ready[e], done)
    latency = max([latency] + [ready + tail for ready, tail in zip(encoder_ready, tails.encoder)])
    return delta, latency, mapping


class Checked(BubbleScheduler):
    """Asserts every estimate against the pricing from scratch."""

    estimates = 0

    def evaluate(self, schedule, forward=None):
        evaluation = super().evaluate(schedule, forward)
        assert (evaluation.delta, evaluation.latency, evaluation.mapping) == from_scratch(self, schedule)
        Checked.estimates += 1
        return evaluation


class NoSkip(BubbleScheduler):
    """Looks at every bubble, full or not."""

    def _pack(self, schedule, *args):
        schedule.skip = [list(range(len(used) + 1)) for used in schedule.used]
        return super()._pack(schedule, *args)


class NoFloor(BubbleScheduler):
    """Knows no bound on its schedules: every split in `refine` is refined."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.floor = -math.inf


def placements(schedule: Schedule) -> list[tuple]:
    return [(p.klass, p.kind, p.op, p.start, p.item, p.pipeline, p.local, p.phase) for p in schedule.placed]


# Each case schedules an encoder plan twice; the wide one (3 s) runs in the full suite.
@pytest.mark.parametrize("pp, tp", [(4, 1), pytest.param(2, 8, marks=pytest.mark.slow)])
def test_incremental_estimates_equal_pricing_from_scratch(monkeypatch, pp: int, tp: int) -> None:
    # Without the framework's host cost per kernel the encoders' backward kernels fit the
    # LLM's bubbles, so the schedule has backward moves to check as well as forward ones.
    s = setup(*SMALL, "cluster.host_forward_kernel_s=0", "cluster.host_backward_kernel_s=0")
    _, plain = candidate(s, pp, tp)
    monkeypatch.setattr(optimus_planner, "BubbleScheduler", Checked)
    Checked.estimates = 0
    _, checked = candidate(s, pp, tp)
    # Forward and backward moves were priced (and checked), and the result is the same.
    assert checked.schedule.fine_forward and checked.schedule.fine_backward and Checked.estimates > 30
    assert checked.schedule.latency == plain.schedule.latency
    assert placements(checked.schedule) == placements(plain.schedule)


def test_skipping_full_bubbles_keeps_first_fit(monkeypatch) -> None:
    s = setup(*SMALL)
    _, plain = candidate(s, 4, 1)
    monkeypatch.setattr(optimus_planner, "BubbleScheduler", NoSkip)
    _, every = candidate(s, 4, 1)
    assert len(plain.schedule.placed) > 1000
    assert placements(every.schedule) == placements(plain.schedule)
    assert (plain.schedule.used, plain.schedule.latency) == (every.schedule.used, every.schedule.latency)


def test_backward_chains_reprice_every_job_whose_start_changed() -> None:
    """A pipeline's chain after a move (first job gone, a job later or earlier, one more)
    equals the chain priced afresh, also where the jobs do not queue behind each other."""
    s = setup(*SMALL)
    sch = candidate(s, 4, 1)[1].scheduler
    rng = random.Random(0)
    horizon = 1.5 * max(sch.last)
    variants = [
        lambda p: p[1:],
        lambda p: p[:-1],
        lambda p: sorted(p + [rng.uniform(0, horizon)]),
        lambda p: sorted(p[:-2] + [rng.uniform(p[-2], horizon)] * 2),
    ]
    for _ in range(300):
        j, delta = rng.randrange(sch.layout.pipelines), rng.choice([0.0, 0.02])
        points = sorted(rng.uniform(0, horizon) for _ in range(rng.randint(3, 12)))
        sch._backward_chain(j, delta, points)
        moved = rng.choice(variants)(points)
        reused = sch._backward_chain(j, delta, moved)
        sch._backward_memo[j] = None
        assert reused == sch._backward_chain(j, delta, moved)


def test_no_schedule_beats_the_floor_and_refining_stops_there(monkeypatch) -> None:
    # Encoder PP 2, TP 4 on the distributed-optimizer rung: two encoder pipelines share
    # 8 micro-batches (5 splits), and the first split refined ends at the floor.
    s = setup(*MODEL_A)
    _, stopped = candidate(s, 2, 4, zero_stage=1)
    sch = stopped.scheduler
    splits = partitions(8, sch.layout.blocks, sch.layout.columns, 100)
    assert len(splits) == stopped.partitions_evaluated == 5
    assert all(sch.best(counts).latency >= sch.floor for counts in splits)
    assert all(sch.initial(counts).latency >= sch.floor for counts in splits)
    assert stopped.schedule.latency == sch.floor
    monkeypatch.setattr(optimus_planner, "BubbleScheduler", NoFloor)
    _, every = candidate(s, 2, 4, zero_stage=1)
    assert (every.schedule.latency, every.eff_fine, every.schedule.counts) == (
        stopped.schedule.latency,
        stopped.eff_fine,
        stopped.schedule.counts,
    )
    assert placements(every.schedule) == placements(stopped.schedule)
