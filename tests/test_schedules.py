"""Pipeline schedules: every pass once, dependencies respected, warm-up depths as published."""

from __future__ import annotations

import pytest

from src.errors import ConfigError
from src.schedules.pipeline import PipeOp, build_schedule, in_flight, interleaved, one_f_one_b, warmup_counts


@pytest.mark.parametrize(
    "name,stages,mbs,chunks",
    [
        ("gpipe", 4, 6, 1),
        ("1f1b", 4, 6, 1),
        ("1f1b", 4, 2, 1),
        ("interleaved", 4, 8, 2),
        ("interleaved", 2, 4, 3),
    ],
)
def test_every_pass_runs_once_and_backward_follows_forward(name, stages, mbs, chunks) -> None:
    for order in build_schedule(name, stages, mbs, chunks):
        forwards = [(op.chunk, op.microbatch) for op in order if op.kind == "F"]
        backwards = [(op.chunk, op.microbatch) for op in order if op.kind == "B"]
        everything = {(c, j) for c in range(chunks) for j in range(mbs)}
        assert sorted(forwards) == sorted(everything) and sorted(backwards) == sorted(everything)
        position = {(op.kind, op.chunk, op.microbatch): i for i, op in enumerate(order)}
        assert all(position[("F", c, j)] < position[("B", c, j)] for c, j in everything)


def test_one_f_one_b_keeps_at_most_p_minus_s_micro_batches_in_flight() -> None:
    stages, mbs = 4, 8
    assert [in_flight(order) for order in one_f_one_b(stages, mbs)] == [4, 3, 2, 1]
    # GPipe keeps every micro-batch alive: the memory argument for 1F1B.
    assert all(in_flight(order) == mbs for order in build_schedule("gpipe", stages, mbs))


def test_interleaved_warmup_matches_megatron() -> None:
    stages, mbs, chunks = 4, 8, 2
    orders = interleaved(stages, mbs, chunks)
    for stage, order in enumerate(orders):
        first_backward = next(i for i, op in enumerate(order) if op.kind == "B")
        assert first_backward == (stages - stage - 1) * 2 + (chunks - 1) * stages + 1
    # Micro-batches advance through chunk 0 in groups of `stages` before chunk 1.
    assert [(op.chunk, op.microbatch) for op in orders[0][:8]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]


def _runs_to_the_end(orders: list[list[PipeOp]], chunks: int) -> bool:
    """Whether every stage gets through its order: a pass runs once the pass it waits on
    has (the previous virtual stage's forward; the next one's backward, or at the last
    virtual stage its own forward)."""
    stages, done, position = len(orders), set(), [0] * len(orders)
    last = stages * chunks - 1
    moved = True
    while moved:
        moved = False
        for s, order in enumerate(orders):
            while position[s] < len(order):
                op = order[position[s]]
                v, j = op.chunk * stages + s, op.microbatch
                if op.kind == "F":
                    need = ("F", v - 1, j) if v > 0 else None
                else:
                    need = ("B", v + 1, j) if v < last else ("F", v, j)
                if need is not None and need not in done:
                    break
                done.add((op.kind, v, j))
                position[s] += 1
                moved = True
    return all(position[s] == len(order) for s, order in enumerate(orders))


@pytest.mark.parametrize("stages, mbs", [(2, 2), (4, 8), (6, 5)])
@pytest.mark.parametrize("extra", [0, 1, 2, 100])
def test_extra_warmup_deepens_every_stage_but_the_last(stages, mbs, extra) -> None:
    default = build_schedule("1f1b", stages, mbs)
    deeper = build_schedule("1f1b", stages, mbs, extra_warmup=extra)
    assert _runs_to_the_end(deeper, 1)
    # Up to every forward a stage runs (then all forwards, then all backwards).
    want = [min(in_flight(o) + (extra if s < stages - 1 else 0), mbs) for s, o in enumerate(default)]
    assert [in_flight(o) for o in deeper] == want
    assert warmup_counts(deeper)[-1] == warmup_counts(default)[-1] == 0


def test_every_schedule_runs_to_the_end() -> None:
    assert _runs_to_the_end(build_schedule("interleaved", 4, 8, 2), 2)
    assert _runs_to_the_end(build_schedule("interleaved", 2, 4, 3), 3)
    assert _runs_to_the_end(build_schedule("gpipe", 3, 4), 1)
    # Deeper warm-ups on every interleaved stage but the last need not: its first chunk feeds stage 0's
    # second, so stage 0 ahead waits on stage 3, which waits on stage 0's backward.
    default = build_schedule("interleaved", 4, 8, 2)
    deeper = interleaved(4, 8, 2, [w + (3 if s < 3 else 0) for s, w in enumerate(warmup_counts(default))])
    assert not _runs_to_the_end(deeper, 2)


def test_schedule_errors_name_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"micro-batches \(6\) divisible by pipeline stages \(4\)"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ConfigError, match="vpp=2"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ConfigError, match="unknown schedule"):
        build_schedule("zero_bubble", 4, 8)
    with pytest.raises(ConfigError, match="-1 extra warm-up forwards"):
        build_schedule("1f1b", 4, 8, extra_warmup=-1)
    with pytest.raises(ConfigError, match="GPipe runs every forward first"):
        build_schedule("gpipe", 4, 8, extra_warmup=1)
    with pytest.raises(ConfigError, match="an interleaved last stage also runs the chain's middle"):
        build_schedule("interleaved", 4, 8, 2, extra_warmup=1)
