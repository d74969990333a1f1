"""The discrete-event engine's behaviour: the breakdown adds up, errors name the problem,
rank classes are a pure compression, asynchronous collectives overlap, runs are
deterministic. Expected times are hand computations with the toy cluster of
tests/sim/test_sim_programs.py (efficiency 1, no saturation, no kernel overhead)."""

from __future__ import annotations

import copy
import random

import pytest

from src import progress
from src.mesh import tensor_parallel
from src.program import COMM_KINDS, Collective, Compute, Group, Hop, Program, RankProgram, Send, Wait, Work
from src.sim.engine import SimulationError, simulate
from src.timeline import BREAKDOWN_CATEGORIES, BUBBLE_CATEGORIES
from tests.sim.test_sim_programs import (
    INTRA_BW,
    INTRA_LAT,
    MODEL,
    MS,
    PEAK,
    PRECISION,
    REL,
    all_reduce_s,
    assert_breakdown,
    build_distmm,
    build_disttrain,
    build_megatron,
    build_optimus,
    build_par4d,
    build_par4d_mesh,
    link,
    make_cluster,
    msg,
    p2p_s,
    recv,
    run,
    send,
    timeline_of,
)

F1 = Work("llm", "fwd", 1, (0, 1))  # one (1000 x 1000)@(1000 x 1000) GEMM: 2 ms
T_F1 = 2 * MS


def two_ranks(
    a: list, b: list, groups: tuple[Group, ...] = (), pipelined: bool = False, messages: tuple[tuple[str, int, int], ...] = ()
) -> Program:
    """Ranks 0 ('left') and 1 ('right'); `messages`: (key, src, dst) routes of 1e6 bytes."""
    program = Program(
        world_size=2,
        classes=[
            RankProgram(ranks=(0,), instructions=a, label="left", pipelined=pipelined),
            RankProgram(ranks=(1,), instructions=b, label="right", pipelined=pipelined),
        ],
    )
    for group in groups:
        program.add_group(group)
    for key, src, dst in messages:
        link(program, key, src, dst, 1e6, "pp")
    return program


# ---- a random-ish Program ----------------------------------------------------------------
RANDOM_GROUPS = ((0, 1), (2, 3), (0, 2, 4), (1, 3), (0, 1, 2, 3, 4), (3, 4), (4, 5), (1, 5))


def random_program(seed: int, ranks: int = 6, steps: int = 70) -> Program:
    """Instructions drawn at random but issued in one global order (a rank executes the
    steps it takes part in, in step order; a message is sent and received at the same
    step), so the Program cannot deadlock. Covers compute of every phase and load,
    collectives of every op on the compute stream and on side streams, blocking and
    asynchronous with waits (some never waited), sends and blocking/asynchronous recvs,
    zero-byte messages, pipelined and non-pipelined classes, 6 ranks over 2 nodes."""
    rng = random.Random(seed)
    lists: dict[int, list] = {r: [] for r in range(ranks)}
    handles: dict[int, list[str]] = {r: [] for r in range(ranks)}
    program = Program(world_size=ranks, classes=[])
    for i, members in enumerate(RANDOM_GROUPS):
        program.add_group(Group(f"g{i}", members, sharing=rng.randint(1, 3)))
    for step in range(steps):
        x = rng.random()
        if x < 0.35:
            for r in range(ranks):
                if rng.random() < 0.6:
                    unit = rng.choice(["llm", "encoder", "vision", "text"])
                    phase = rng.choice(["fwd", "bwd", "bwd_input", "bwd_weight"])
                    layers = (0, rng.randint(1, MODEL.unit(unit).num_layers))
                    work = Work(unit, phase, rng.randint(1, 3), layers, load=rng.choice([0.5, 1.0, 1.7]))
                    lists[r].append(Compute(work, microbatch=step))
        elif x < 0.6:
            gi = rng.randrange(len(RANDOM_GROUPS))
            blocking = rng.random() < 0.5
            stream = rng.choice(["compute", "comm", "comm2"]) if blocking else rng.choice(["comm", "comm2"])
            handle = None if blocking else f"c{step}"
            instruction = Collective(
                rng.choice(["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]),
                f"g{gi}",
                rng.choice([0.0, 1e5, 1e6, 3e7]),
                rng.choice(COMM_KINDS),
                stream=stream,
                blocking=blocking,
                handle=handle,
                count=rng.randint(1, 3),
            )
            for r in RANDOM_GROUPS[gi]:
                lists[r].append(instruction)
                if handle:
                    handles[r].append(handle)
        elif x < 0.85:
            src, dst = rng.sample(range(ranks), 2)
            nbytes, kind = rng.choice([0.0, 1e5, 4e6, 3e7]), rng.choice(COMM_KINDS)
            link(program, f"m{step}", src, dst, nbytes, kind, sharing=rng.randint(1, 4))
            lists[src].append(send(f"m{step}", stream=rng.choice(["send", "send2"])))
            blocking = rng.random() < 0.6
            lists[dst].append(
                recv(f"m{step}", stream=rng.choice(["recv", "recv2"]), blocking=blocking, handle=None if blocking else f"m{step}")
            )
            if not blocking:
                handles[dst].append(f"m{step}")
        else:
            for r in range(ranks):
                while handles[r] and rng.random() < 0.5:
                    lists[r].append(Wait(handles[r].pop(rng.randrange(len(handles[r])))))
    for r in range(ranks):
        program.classes.append(
            RankProgram(ranks=(r,), instructions=lists[r], label=f"r{r}", units=("llm",), pipelined=rng.random() < 0.5)
        )
    return program


def every_program() -> dict[str, Program]:
    programs = {
        "megatron/per-rank": build_megatron(per_rank=True),
        "megatron/classes": build_megatron(per_rank=False),
        "megatron/no-p2p-bytes": build_megatron(per_rank=True, s_act=0.0),
        "distmm": build_distmm(),
        "disttrain/01": build_disttrain((0, 1)),
        "disttrain/10": build_disttrain((1, 0)),
        "optimus/bubble": build_optimus("bubble"),
        "optimus/after": build_optimus("after"),
        "par4d/hidden": build_par4d(1e8),
        "par4d/exposed": build_par4d(3e8),
        "par4d/mesh": build_par4d_mesh()[0],
    }
    for seed in range(12):
        programs[f"random/{seed}"] = random_program(seed)
    return programs


PROGRAMS = every_program()


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_breakdown_adds_up_on_every_rank(name):
    timeline = run(PROGRAMS[name])
    assert timeline.iteration_time > 0
    assert timeline.iteration_time == pytest.approx(max(r.end for r in timeline.ranks), rel=REL)
    for rank_timeline in timeline.ranks:
        bd = rank_timeline.breakdown
        assert tuple(bd) == BREAKDOWN_CATEGORIES
        assert all(v >= -1e-15 for v in bd.values()), (rank_timeline.label, bd)
        # The same bubbles, by where they fall on the rank.
        bubbles = sum(bd[cat] for cat in BUBBLE_CATEGORIES)
        assert sum(rank_timeline.bubble_positions.values()) == pytest.approx(bubbles, rel=REL, abs=1e-15)
        assert sum(bd.values()) == pytest.approx(timeline.iteration_time, rel=REL), (rank_timeline.label, bd)
        # compute equals the compute spans; every stream executes its spans in order
        compute = sum(s.end - s.start for s in rank_timeline.spans if s.category == "compute")
        assert bd["compute"] == pytest.approx(compute, rel=REL, abs=1e-15)
        by_stream: dict[str, list] = {}
        for span in rank_timeline.spans:
            assert span.end >= span.start - 1e-15
            by_stream.setdefault(span.stream, []).append(span)
        for stream, spans in by_stream.items():
            for before, after in zip(spans, spans[1:]):
                assert after.start >= before.end - 1e-12, (rank_timeline.label, stream, before, after)
    mean = timeline.mean_breakdown()
    assert sum(mean.values()) == pytest.approx(timeline.iteration_time, rel=REL)


def test_random_programs_are_not_trivial():
    """The random Programs do exercise waits of every sort (else the test above is weak)."""
    seen = {cat: 0.0 for cat in BREAKDOWN_CATEGORIES}
    for seed in range(12):
        for rank_timeline in run(PROGRAMS[f"random/{seed}"]).ranks:
            for cat, v in rank_timeline.breakdown.items():
                seen[cat] += v
    assert all(v > 0 for v in seen.values()), seen


# ---- errors ------------------------------------------------------------------------------
def test_deadlock_names_the_stuck_classes():
    program = two_ranks([recv("a"), send("b")], [recv("b"), send("a")], messages=(("a", 1, 0), ("b", 0, 1)))
    with pytest.raises(SimulationError, match="deadlock") as err:
        run(program)
    assert "left" in str(err.value) and "right" in str(err.value)
    assert "2 rank classes" in str(err.value)


def test_recv_without_send_raises():
    program = two_ranks([Compute(F1), recv("ghost")], [Compute(F1)], messages=(("ghost", 1, 0),))
    with pytest.raises(SimulationError, match="deadlock") as err:
        run(program)
    assert "left" in str(err.value) and "ghost" in str(err.value) and "right" not in str(err.value)


def test_collective_missing_a_participant_deadlocks():
    program = two_ranks([Collective("all_reduce", "g", 1e6, "dp"), Compute(F1)], [Compute(F1)], (Group("g", (0, 1)),))
    with pytest.raises(SimulationError, match="deadlock") as err:
        run(program)
    assert "left" in str(err.value)


@pytest.mark.parametrize("blocking", [True, False])
def test_trailing_collective_missing_a_participant_raises(blocking):
    ar = Collective("all_reduce", "g", 1e6, "dp", stream="dp", blocking=blocking, handle=None if blocking else "h")
    program = two_ranks([ar], [Compute(F1)], (Group("g", (0, 1)),))
    with pytest.raises(SimulationError, match="g"):
        run(program)


def test_collective_on_unknown_group_raises():
    with pytest.raises(SimulationError, match="unknown group 'nope'"):
        run(two_ranks([Collective("all_reduce", "nope", 1e6, "dp")], []))


def test_wait_on_unknown_handle_raises():
    with pytest.raises(SimulationError, match="unknown handle 'h'"):
        run(two_ranks([Compute(F1), Wait("h")], []))


def test_group_with_an_uncovered_rank_raises():
    with pytest.raises(SimulationError, match="no instruction list covers"):
        run(two_ranks([Collective("all_reduce", "g", 1e6, "dp")], [], (Group("g", (0, 7)),)))


def test_rank_in_two_classes_raises():
    program = Program(world_size=2, classes=[RankProgram(ranks=(0, 1), instructions=[]), RankProgram(ranks=(1,), instructions=[])])
    with pytest.raises(SimulationError, match="rank 1 appears in two"):
        run(program)


def test_message_sent_twice_raises():
    with pytest.raises(SimulationError, match="twice"):
        run(two_ranks([send("k"), send("k")], [recv("k")], messages=(("k", 0, 1),)))


def test_message_never_received_raises():
    with pytest.raises(SimulationError, match="never received"):
        run(two_ranks([send("k")], [], messages=(("k", 0, 1),)))


def test_unknown_route_raises():
    with pytest.raises(SimulationError, match="unknown route 'k'"):
        run(two_ranks([send("k")], []))


# ---- rank classes ------------------------------------------------------------------------
def test_rank_classes_equal_one_list_per_rank_megatron():
    """The 2-stage pipeline (TP=2, DP=2: 4 ranks per stage) written with one list per rank
    and with one class per stage (TP and DP groups inside the class) is the same run."""
    per_rank, classes = run(build_megatron(per_rank=True)), run(build_megatron(per_rank=False))
    assert len(per_rank.ranks) == 8 and len(classes.ranks) == 2
    assert classes.iteration_time == pytest.approx(per_rank.iteration_time, rel=REL)
    for p in (0, 1):
        cls = timeline_of(classes, f"stage {p}")
        assert len(cls.ranks) == 4
        for rank in cls.ranks:
            (own,) = [r for r in per_rank.ranks if r.ranks == (rank,)]
            for cat in BREAKDOWN_CATEGORIES:
                assert cls.breakdown[cat] == pytest.approx(own.breakdown[cat], rel=REL, abs=1e-15)
    for cat, v in classes.mean_breakdown().items():
        assert v == pytest.approx(per_rank.mean_breakdown()[cat], rel=REL, abs=1e-15)
    assert classes.events < per_rank.events


def test_rank_classes_equal_one_list_per_rank_distmm():
    """DistMM's 3 vision replicas as one class, or as 3 classes with the same list."""
    merged = build_distmm()
    split = Program(world_size=4, classes=[], groups=dict(merged.groups))
    for rank_program in merged.classes:
        for rank in rank_program.ranks:
            split.classes.append(
                RankProgram(
                    ranks=(rank,),
                    instructions=list(rank_program.instructions),
                    label=f"{rank_program.label}{rank}",
                    units=rank_program.units,
                )
            )
    a, b = run(merged), run(split)
    assert a.iteration_time == pytest.approx(b.iteration_time, rel=REL)
    vision = timeline_of(a, "vision")
    for rank in (0, 1, 2):
        for cat in BREAKDOWN_CATEGORIES:
            assert timeline_of(b, f"vision{rank}").breakdown[cat] == pytest.approx(vision.breakdown[cat], abs=1e-15)


# ---- asynchronous collectives ------------------------------------------------------------
@pytest.mark.parametrize("nbytes, wait_first", [(1e8, False), (3e8, False), (1e8, True)])
def test_async_collective_overlaps_compute(nbytes, wait_first):
    """An asynchronous all-reduce on a side stream runs during the compute that follows it;
    only the part that outlasts the compute is exposed. Waiting right away exposes it all."""
    t_ar = all_reduce_s(2, nbytes, INTRA_BW, INTRA_LAT)  # ranks 0, 1: one node
    ar = Collective("all_reduce", "g", nbytes, "dp", stream="dp", blocking=False, handle="h")
    body = [ar, Wait("h"), Compute(F1)] if wait_first else [ar, Compute(F1), Wait("h")]
    timeline = run(two_ranks(list(body), list(body), (Group("g", (0, 1)),)))
    if wait_first:
        iteration, exposed = t_ar + T_F1, t_ar
    else:
        iteration, exposed = max(T_F1, t_ar), max(0.0, t_ar - T_F1)
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)
    for rank_timeline in timeline.ranks:
        assert_breakdown(rank_timeline, iteration, compute=T_F1, comm_dp=exposed)
        (span,) = [s for s in rank_timeline.spans if s.stream == "dp"]
        assert (span.start, span.end) == (0.0, pytest.approx(t_ar))
    if nbytes == 1e8 and not wait_first:
        assert timeline.ranks[0].breakdown["comm_dp"] == 0.0


def test_async_collective_waits_for_a_late_peer():
    """A peer that issues the collective 2 ms late: the wait for it is a bubble, only the
    transfer itself is communication."""
    nbytes = 1e8
    t_ar = all_reduce_s(2, nbytes, INTRA_BW, INTRA_LAT)
    ar = Collective("all_reduce", "g", nbytes, "dp", stream="dp", blocking=False, handle="h")
    timeline = run(two_ranks([ar, Wait("h")], [Compute(F1), ar, Wait("h")], (Group("g", (0, 1)),)))
    iteration = T_F1 + t_ar
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)
    assert_breakdown(timeline_of(timeline, "left"), iteration, bubble_imbalance=T_F1, comm_dp=t_ar)
    assert_breakdown(timeline_of(timeline, "right"), iteration, compute=T_F1, comm_dp=t_ar)


def test_collective_count_repeats_back_to_back():
    one = all_reduce_s(2, 1e6, INTRA_BW, INTRA_LAT)
    ar = Collective("all_reduce", "g", 1e6, "tp", stream="compute", count=3)
    timeline = run(two_ranks([ar], [ar], (Group("g", (0, 1)),)))
    assert timeline.iteration_time == pytest.approx(3 * one, rel=REL)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # efficiency 0.5 · (1000/2000)(500/1500)(1000/2000) = 1/24 of peak, plus one launch
        (dict(gemm_max_efficiency=0.5, gemm_half_dim=1000.0, kernel_overhead_s=1e-6), 2 * 1000 * 500 * 1000 / (PEAK / 24) + 1e-6),
        # memory-bound: 2 bytes · (m·k + k·n + m·n) over 1 GB/s beats the 1 ms of FLOPs
        (dict(memory_bandwidth=1e9), 2 * (1000 * 1000 + 1000 * 500 + 1000 * 500) / 1e9),
    ],
)
def test_compute_price_formula(overrides, expected):
    """One column-parallel GEMM (m=1000, n=1000/tp, k=1000, tp=2) through the engine."""
    cluster = make_cluster(**overrides)
    program = Program(
        world_size=1,
        classes=[RankProgram(ranks=(0,), instructions=[Compute(Work("llm", "fwd", 1, (0, 1), sharding=tensor_parallel(2)))])],
    )
    assert simulate(program, MODEL, cluster, PRECISION).iteration_time == pytest.approx(expected, rel=REL)


# ---- determinism -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["megatron/per-rank", "distmm", "disttrain/01", "par4d/exposed", "random/3", "random/7"])
def test_deterministic_and_independent_of_class_order(name):
    program = PROGRAMS[name]
    first, second = run(program), run(copy.deepcopy(program))
    assert first == second
    reordered = copy.deepcopy(program)
    reordered.classes.reverse()
    third = run(reordered)
    assert third.iteration_time == pytest.approx(first.iteration_time, rel=REL)
    for rank_timeline in first.ranks:
        other = timeline_of(third, rank_timeline.label)
        for cat in BREAKDOWN_CATEGORIES:
            assert other.breakdown[cat] == pytest.approx(rank_timeline.breakdown[cat], rel=REL, abs=1e-15)


# ---- engine bugs found by these tests, fixed --------------------------------------------
def test_send_recv_on_compute_stream_add_up():
    """A blocking send/recv expressed by putting it on the compute stream."""
    d = p2p_s(4e6, INTRA_BW, INTRA_LAT)
    program = two_ranks([Compute(F1), send("m", stream="compute"), Compute(F1)], [recv("m", stream="compute"), Compute(F1)])
    link(program, "m", 0, 1, 4e6, "pp")
    timeline = run(program)
    iteration = 2 * T_F1 + d
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)
    assert_breakdown(timeline_of(timeline, "left"), iteration, compute=2 * T_F1, comm_pp=d)
    assert_breakdown(timeline_of(timeline, "right"), iteration, compute=T_F1, comm_pp=d, bubble_imbalance=T_F1)


def _rendezvous_pair(rendezvous: bool, receiver_passes: int) -> Program:
    """Left computes a pass, sends over a Hop on its compute stream, computes again; right
    computes `receiver_passes` passes before it receives."""
    left = [Compute(F1), Send("m", msg("m"), stream="compute", rendezvous=rendezvous), Compute(F1)]
    right = [Compute(F1)] * receiver_passes + [recv("m"), Compute(F1)]
    program = two_ranks(left, right)
    program.add_route(Hop("m", "pp", (0,), (1,), 4e6))
    return program


def test_a_rendezvous_send_waits_until_its_receiver_posts():
    """DeepSpeed's pipeline p2p (a synchronous broadcast): the sender's stream waits for the
    receiver to reach its receive, then for the data; an eager send goes at once."""
    d = p2p_s(4e6, INTRA_BW, INTRA_LAT)
    late = run(_rendezvous_pair(True, 2))
    iteration = 3 * T_F1 + d
    assert late.iteration_time == pytest.approx(iteration, rel=REL)
    assert_breakdown(timeline_of(late, "left"), iteration, compute=2 * T_F1, comm_pp=d, bubble_imbalance=T_F1)
    assert_breakdown(timeline_of(late, "right"), iteration, compute=3 * T_F1, comm_pp=d)
    eager = run(_rendezvous_pair(False, 2))  # the data lands while right computes
    assert eager.iteration_time == pytest.approx(3 * T_F1, rel=REL)
    assert_breakdown(timeline_of(eager, "left"), 3 * T_F1, compute=2 * T_F1, comm_pp=d, idle=T_F1 - d)
    assert_breakdown(timeline_of(eager, "right"), 3 * T_F1, compute=3 * T_F1)


def test_a_rendezvous_send_to_a_receiver_already_waiting_goes_at_once():
    d = p2p_s(4e6, INTRA_BW, INTRA_LAT)
    timeline = run(_rendezvous_pair(True, 0))
    iteration = 2 * T_F1 + d
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)
    assert_breakdown(timeline_of(timeline, "left"), iteration, compute=2 * T_F1, comm_pp=d)
    assert_breakdown(timeline_of(timeline, "right"), iteration, compute=T_F1, comm_pp=d, bubble_imbalance=T_F1)


def test_a_rendezvous_send_to_a_posted_irecv_goes_at_once():
    """An asynchronous receive posted before a long pass lets the send land under it."""
    d = p2p_s(4e6, INTRA_BW, INTRA_LAT)
    left = [Send("m", msg("m"), stream="compute", rendezvous=True), Compute(F1)]
    right = [recv("m", blocking=False, handle="h"), Compute(F1), Wait("h")]
    program = two_ranks(left, right)
    program.add_route(Hop("m", "pp", (0,), (1,), 4e6))
    timeline = run(program)
    assert timeline.iteration_time == pytest.approx(T_F1 + d, rel=REL)
    assert_breakdown(timeline_of(timeline, "left"), T_F1 + d, compute=T_F1, comm_pp=d)
    assert_breakdown(timeline_of(timeline, "right"), T_F1 + d, compute=T_F1, idle=d)


def test_two_rendezvous_sends_facing_each_other_deadlock():
    """Each side sends before it receives and waits for the other to post: DeepSpeed's step
    order exists to avoid this."""
    program = two_ranks(
        [Send("a", msg("a"), stream="compute", rendezvous=True), recv("b")],
        [Send("b", msg("b"), stream="compute", rendezvous=True), recv("a")],
    )
    program.add_route(Hop("a", "pp", (0,), (1,), 4e6))
    program.add_route(Hop("b", "pp", (1,), (0,), 4e6))
    with pytest.raises(SimulationError, match="deadlock: 2 rank classes cannot proceed"):
        run(program)


def test_a_rendezvous_send_needs_a_hop():
    program = two_ranks([send("m", stream="compute", rendezvous=True)], [recv("m")], messages=(("m", 0, 1),))
    with pytest.raises(SimulationError, match="rendezvous send needs a Hop route"):
        run(program)


def test_preposted_irecv_exchange_runs():
    """Both ranks post an asynchronous receive, send, then wait: an exchange that any
    isend/irecv backend completes."""
    d = p2p_s(4e6, INTRA_BW, INTRA_LAT)

    def side(out: str, inbound: str) -> list:
        return [Compute(F1), recv(inbound, blocking=False, handle="h"), send(out), Wait("h")]

    program = two_ranks(side("a", "b"), side("b", "a"))
    link(program, "a", 0, 1, 4e6, "pp")
    link(program, "b", 1, 0, 4e6, "pp")
    timeline = run(program)
    assert timeline.iteration_time == pytest.approx(T_F1 + d, rel=REL)
    for rank_timeline in timeline.ranks:
        assert_breakdown(rank_timeline, T_F1 + d, compute=T_F1, comm_pp=d)


def test_async_collective_on_busy_stream_does_not_block_the_class():
    """Rank 0 queues two asynchronous all-reduces on one stream (with rank 1, then rank 2),
    then sends rank 1 the message rank 1 needs before it joins the first all-reduce.
    On a real backend both collectives are merely enqueued and the send goes out."""
    t = all_reduce_s(2, 1e6, INTRA_BW, INTRA_LAT)
    d = p2p_s(1e6, INTRA_BW, INTRA_LAT)
    program = Program(
        world_size=3,
        classes=[
            RankProgram(
                ranks=(0,),
                label="A",
                instructions=[
                    Collective("all_reduce", "ab", 1e6, "dp", stream="comm", blocking=False, handle="h1"),
                    Collective("all_reduce", "ac", 1e6, "dp", stream="comm", blocking=False, handle="h2"),
                    send("m"),
                    Wait("h1"),
                    Wait("h2"),
                ],
            ),
            RankProgram(ranks=(1,), label="B", instructions=[recv("m"), Collective("all_reduce", "ab", 1e6, "dp")]),
            RankProgram(ranks=(2,), label="C", instructions=[Collective("all_reduce", "ac", 1e6, "dp")]),
        ],
    )
    program.add_group(Group("ab", (0, 1)))
    program.add_group(Group("ac", (0, 2)))
    link(program, "m", 0, 1, 1e6, "pp")
    timeline = run(program)
    # the send leaves at 0 and lands at d; "ab" runs [d, d+t]; "ac" queues behind it
    assert timeline.iteration_time == pytest.approx(d + 2 * t, rel=REL)


def test_mismatched_collective_raises():
    program = two_ranks([Collective("all_reduce", "g", 1e6, "dp")], [Collective("all_gather", "g", 4e8, "dp")], (Group("g", (0, 1)),))
    with pytest.raises(SimulationError):
        run(program)


def test_wait_behind_earlier_collective_is_charged_to_its_kind():
    """An asynchronous 3.02 ms dp all-reduce, then a blocking tp all-reduce on the same
    stream: the compute stream waits for both; each is exposed communication of its own kind."""
    t_dp = all_reduce_s(2, 3e8, INTRA_BW, INTRA_LAT)
    t_tp = all_reduce_s(2, 1e6, INTRA_BW, INTRA_LAT)
    body = [
        Collective("all_reduce", "g", 3e8, "dp", stream="comm", blocking=False, handle="h"),
        Collective("all_reduce", "g", 1e6, "tp", stream="comm"),
        Wait("h"),
    ]
    timeline = run(two_ranks(list(body), list(body), (Group("g", (0, 1)),)))
    assert timeline.iteration_time == pytest.approx(t_dp + t_tp, rel=REL)
    for rank_timeline in timeline.ranks:
        assert_breakdown(rank_timeline, t_dp + t_tp, comm_dp=t_dp, comm_tp=t_tp)


def test_long_simulations_report_progress_on_stderr(monkeypatch, capsys) -> None:
    import src.sim.engine as engine

    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    monkeypatch.setattr(progress, "FIRST_CPU_S", 0.0)  # a task's first line: at once here
    monkeypatch.setattr(progress, "CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(engine, "PROGRESS_EVENTS", 1)
    program = random_program(3)
    quiet = run(random_program(3))
    capsys.readouterr()
    timeline = run(program)
    lines = capsys.readouterr().err.splitlines()
    total = sum(len(c.instructions) for c in program.classes)
    assert len(lines) > 2 and all(line.startswith("simulation [") for line in lines)
    assert lines[-2].endswith(f"{total}/{total} instructions") and lines[-1].endswith(f"done: {total} instructions")
    assert timeline.iteration_time == quiet.iteration_time  # looking at the clock changes nothing
