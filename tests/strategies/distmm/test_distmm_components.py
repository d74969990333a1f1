"""DistMM's components on small hand-checked cases: the balancer's dynamic program, the
batch-sync schedules and the pipeline's batch-size bounds (docs/strategies.md, DistMM)."""

from __future__ import annotations

import itertools
import random

import pytest

from src.errors import ConfigError
from src.schedules.distmm_pipe import build_sync_schedule, distmm_pipe, gpipe_sync, max_contrastive_batch, max_pipeline_batch, resident
from src.strategies.distmm.balance import Choice, aligned_time, balance
from src.strategies.distmm.towers import phase_weights


def per_sample_choices(devices: int, batch: int, units_per_sample: float) -> list[Choice[int]]:
    """A tower with d = 1 whose time is proportional to its per-replica batch."""
    return [Choice(n, (units_per_sample * batch / n,), n) for n in range(1, devices + 1) if batch % n == 0]


@pytest.mark.parametrize("fill", [False, True])
def test_balancer_on_a_hand_derived_toy(fill: bool) -> None:
    # Derived by hand: 8 GPUs, B = 24, vision 3 units/sample, text 1 -> vision 6 GPUs
    # (b = 4), text 2 GPUs (b = 12), slowest tower 12. One phase: the paper's min-max.
    vision, text = balance([per_sample_choices(8, 24, 3.0), per_sample_choices(8, 24, 1.0)], 8, fill=fill)
    assert (vision.devices, 24 // vision.devices) == (6, 4)
    assert (text.devices, 24 // text.devices) == (2, 12)
    assert max(vision.phases + text.phases) == pytest.approx(12.0)


def brute_force(choices: list[list[Choice[int]]], devices: int, weights: tuple[float, ...], fill: bool) -> tuple[float, int]:
    combos = [c for c in itertools.product(*choices) if sum(x.devices for x in c) <= devices]
    if fill:
        most = max(sum(x.devices for x in c) for c in combos)
        combos = [c for c in combos if sum(x.devices for x in c) == most]
    best = min(combos, key=lambda c: aligned_time([x.phases for x in c], weights))
    return aligned_time([x.phases for x in best], weights), sum(x.devices for x in best)


@pytest.mark.parametrize("seed", range(20))
def test_balancer_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    devices = rng.randint(4, 12)
    towers = rng.randint(2, 3)
    groups = rng.randint(1, 4)
    weights = phase_weights(groups)
    choices = [
        [Choice(n, tuple(rng.uniform(0, 5) for _ in weights), n) for n in sorted(rng.sample(range(1, devices + 1), rng.randint(1, 4)))]
        for _ in range(towers)
    ]
    for fill in (False, True):
        if min(sum(c) for c in itertools.product(*[[x.devices for x in o] for o in choices])) > devices:
            assert balance(choices, devices, weights, fill=fill) is None
            continue
        picked = balance(choices, devices, weights, fill=fill)
        time, used = brute_force(choices, devices, weights, fill)
        assert aligned_time([c.phases for c in picked], weights) == pytest.approx(time)
        assert sum(c.devices for c in picked) <= devices
        if fill:
            assert sum(c.devices for c in picked) == used


def test_balancer_aligns_the_towers_at_the_batch_sync() -> None:
    # Phases (before the batch-sync, batch-sync, between two, after), one group. A frozen
    # tower (LiT's) only runs forwards; the trained one runs its backward and gradient
    # reduction after the barrier, and the aligned run waits for the slower side of each.
    weights = phase_weights(1)
    frozen = [Choice(2, (7.0, 0.0, 0.0, 0.0), "frozen2"), Choice(4, (4.0, 0.0, 0.0, 0.0), "frozen4")]
    trained = [Choice(4, (4.0, 0.0, 0.0, 4.0), "trained4"), Choice(6, (2.0, 0.0, 0.0, 5.0), "trained6")]
    picked = balance([frozen, trained], 8, weights)
    assert [c.payload for c in picked] == ["frozen4", "trained4"]
    assert aligned_time([c.phases for c in picked], weights) == pytest.approx(8.0)
    # Minimising the slowest tower's own time (7 and 7 against 4 and 8) would pick 2 + 6,
    # which aligns to 7 + 5 = 12.
    assert aligned_time([frozen[0].phases, trained[1].phases], weights) == pytest.approx(12.0)


def test_balancer_gives_spare_devices_to_towers_that_are_not_the_bottleneck() -> None:
    # Tower A is the bottleneck whatever it gets beyond 4 devices; B gets faster with more.
    a = [Choice(4, (10.0,), "a4"), Choice(6, (10.0,), "a6")]
    b = [Choice(1, (8.0,), "b1"), Choice(4, (2.0,), "b4")]
    picked = balance([a, b], 8)
    assert [c.payload for c in picked] == ["a4", "b4"]


def groups_in(order, k: int) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for op in order:
        out.setdefault(op.group, []).append(op.kind)
    return out


@pytest.mark.parametrize("builder", [distmm_pipe, gpipe_sync])
@pytest.mark.parametrize("stages,groups,k", [(1, 1, 1), (2, 2, 2), (4, 3, 2), (4, 2, 8), (3, 4, 1)])
def test_batch_sync_covers_whole_groups(builder, stages: int, groups: int, k: int) -> None:
    orders = builder(stages, groups, k)
    assert len(orders) == stages
    for stage, order in enumerate(orders):
        forwards = [op.microbatch for op in order if op.kind == "F"]
        backwards = [op.microbatch for op in order if op.kind == "B"]
        assert sorted(forwards) == sorted(backwards) == list(range(groups * k))
        syncs = [i for i, op in enumerate(order) if op.kind == "S"]
        assert len(syncs) == (groups if stage == stages - 1 else 0)
        for i in syncs:
            g = order[i].group
            # The interaction sees all k micro-batches of its group: every forward of the
            # group before it, every backward after it (never a part of a group).
            before = [op.microbatch for op in order[:i] if op.kind == "F" and op.group == g]
            after = [op.microbatch for op in order[i:] if op.kind == "B" and op.group == g]
            assert len(before) == len(after) == k


def test_gpipe_sync_is_a_barrier_and_distmm_pipe_interleaves() -> None:
    # Figure 6 with K = 2, two groups, 2 stages: GPipe-sync finishes group 0 before
    # group 1 starts; DistMM-Pipe runs group 1's forwards between group 0's backwards.
    gpipe = [op.kind + str(op.microbatch) for op in gpipe_sync(2, 2, 2)[1]]
    pipe = [op.kind + str(op.microbatch) for op in distmm_pipe(2, 2, 2)[1]]
    assert gpipe == ["F0", "F1", "S0", "B0", "B1", "F2", "F3", "S2", "B2", "B3"]
    assert pipe == ["F0", "F1", "S0", "B0", "F2", "B1", "F3", "S2", "B2", "B3"]
    first = [op.kind + str(op.microbatch) for op in distmm_pipe(2, 2, 2)[0]]
    assert first[:3] == ["F0", "F1", "F2"]  # one forward of the next group ahead


def test_distmm_pipe_keeps_at_most_two_groups_resident() -> None:
    for stages, k in ((4, 8), (8, 2), (2, 1)):
        orders = distmm_pipe(stages, 3, k)
        assert resident(orders[0]) == k + min(k, stages - 1)
        assert all(resident(o) <= 2 * k for o in orders)
        assert all(resident(o) == k for o in gpipe_sync(stages, 3, k))


def test_maximum_batches_of_a_hand_derived_case() -> None:
    # Derived by hand: M = 16, M_s = 32, M_a = 1, P = 4 -> existing PP 8, DistMM-Pipe 16.
    assert max_pipeline_batch(16, 32, 1, 4) == pytest.approx(8)
    assert max_contrastive_batch(16, 32, 1, 4) == pytest.approx(16)
    # The same bound from the schedule: a stage holds M_s/P of static memory and M_a/P per
    # resident sample; DistMM-Pipe's first stage keeps two whole groups (2·Rbs samples)
    # alive when a group has no more micro-batches than the pipeline has later stages
    # (with more, it keeps k + P - 1 < 2k: the paper's bound is the worst case).
    k, stages = 3, 4
    groups_resident = resident(distmm_pipe(stages, 2, k)[0]) / k
    assert groups_resident == 2
    rbs = (16 - 32 / stages) / (groups_resident * 1 / stages)
    assert rbs == pytest.approx(max_contrastive_batch(16, 32, 1, stages))
    assert max_contrastive_batch(16, 32, 1, 8) > max_contrastive_batch(16, 32, 1, 4)  # grows with P


def test_unknown_schedule_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="gpipe_sync"):
        build_sync_schedule("1f1b", 2, 2, 2)


def test_gantt_reads_back_the_simulator_trace(tmp_path) -> None:
    from src.gantt import load_trace, render
    from src.report.trace import write_chrome_trace
    from src.timeline import RankTimeline, Span, Timeline

    spans = [
        Span("compute", 0.0, 0.002, "fwd vision L0-3", "compute", "vision", 0),
        Span("compute", 0.002, 0.003, "interaction interaction L0-1", "compute", "interaction", 0),
        Span("comm", 0.003, 0.004, "all_gather interaction", "comm_interaction"),
    ]
    timeline = Timeline(0.004, [RankTimeline((0, 1), "vision stage 0", ("vision",), spans, {}, 0.004)])
    write_chrome_trace(timeline, tmp_path / "trace.json")
    back = load_trace(tmp_path / "trace.json")
    assert back.iteration_time == pytest.approx(0.004)
    assert [(s.name, s.stream, s.microbatch) for s in back.ranks[0].spans] == [(s.name, s.stream, s.microbatch) for s in spans]
    assert back.ranks[0].label.startswith("vision stage 0")
    render([("example", back)], tmp_path / "gantt.png")
    assert (tmp_path / "gantt.png").stat().st_size > 1000
