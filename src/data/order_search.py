"""A search over the order of pipelines' micro-batches, judged by the pipeline's recurrence of
every candidate order at once.

Algorithm 3 (src/data/reorder.py) orders a pipeline's micro-batches by their first stage's
forward alone. Where the loads that vary weigh on later stages too (an MLLM's generator after
its LLM) and those stages have slack over the bottleneck, where a heavy micro-batch falls
decides whether the slack absorbs it or the whole pipeline waits for it. `improve` starts
from given orders and, for a fixed number of rounds, tries random swaps of two positions of
each pipeline's order, keeping the swap that shortens that pipeline's recurrence most (end(op)
= max(end of its device's previous op, end of its dependency) + its duration: IntervalSim's
for a 1F1B chain), and none where none does. The devices' orders are the pipeline's own: a
1F1B chain's (with the schedule's extra warm-up forwards), or a chain of units some of whose
devices run several virtual stages interleaved (schedules.chain: DistTrain's LLM), where a
forward of virtual stage v waits for v - 1's and a backward for v + 1's. Every candidate of
every pipeline of one shape is timed in one pass over the recurrence's dependency levels
(numpy over the candidates), so a round costs a few milliseconds however many pipelines it
searches.

The work is fixed (rounds and candidates), not timed, and the random swaps come from a fixed
seed: the same stage times give the same orders, as the real backend needs to place each
step's batch where the planner priced it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from src.data.reorder import StageTimes
from src.schedules.chain import Chain, chain_orders
from src.schedules.pipeline import build_schedule

ROUNDS = 24
# Candidates a round times over all the pipelines searched together, shared among them (each
# at least one): a round's pass over the recurrence costs about the same for a few or a
# hundred (numpy's per-call overhead dominates), and more per round for more, so that a
# batch's search stays within a few tens of milliseconds however many pipelines it has.
CANDIDATES = 96
SEED = 0


@dataclass(frozen=True)
class _Recurrence:
    """A pipeline's operations over (virtual stages, micro-batches), numbered level by level
    (an operation's level is one past the deeper of the two it waits for), so that a level is
    a range of them: per level its bounds, the operations before its members on their devices
    and the ones they depend on (index `ops`: none); per operation its row of a pipeline's
    time table (forward of virtual stage v at v, backward at V + v) and its micro-batch's
    position."""

    ops: int
    levels: tuple[tuple[int, int, np.ndarray, np.ndarray], ...]
    rows: np.ndarray
    positions: np.ndarray


@functools.lru_cache(maxsize=32)
def _recurrence(chain: Chain, microbatches: int, extra_warmup: int) -> _Recurrence:
    if chain.interleaved:
        assert not extra_warmup, "an interleaved chain's warm-ups are its own"
        orders = chain_orders(chain, microbatches)
    else:
        orders = build_schedule("1f1b", chain.depth, microbatches, extra_warmup=extra_warmup)
    virtual_of, stages = chain.virtual_of(), chain.virtual_stages
    index: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro-batch)
    for device, order in enumerate(orders):
        for op in order:
            index[(op.kind, virtual_of[device][op.chunk], op.microbatch)] = len(index)
    count = len(index)
    before, after = [count] * count, [count] * count  # `count`: a row of zeros
    rows, positions = [0] * count, [0] * count
    for device, order in enumerate(orders):
        previous = count
        for op in order:
            v, j = virtual_of[device][op.chunk], op.microbatch
            o = index[(op.kind, v, j)]
            rows[o], positions[o], before[o], previous = (v if op.kind == "F" else stages + v), j, previous, o
            if op.kind == "F":
                after[o] = index[("F", v - 1, j)] if v else count
            else:
                after[o] = index[("F", v, j)] if v == stages - 1 else index[("B", v + 1, j)]
    # Levels in Kahn's order.
    waiting = [sum(d < count for d in (before[o], after[o])) for o in range(count)]
    followers: list[list[int]] = [[] for _ in range(count)]
    for o in range(count):
        for d in (before[o], after[o]):
            if d < count:
                followers[d].append(o)
    level = [0] * count
    ready = [o for o in range(count) if not waiting[o]]
    for o in ready:  # grows as operations become ready
        for f in followers[o]:
            level[f] = max(level[f], level[o] + 1)
            waiting[f] -= 1
            if not waiting[f]:
                ready.append(f)
    assert len(ready) == count, "a pipeline's orders do not wait on each other"
    ranked = sorted(range(count), key=lambda o: (level[o], o))
    number = {o: n for n, o in enumerate(ranked)} | {count: count}
    levels, start = [], 0
    for end in range(1, count + 1):
        if end == count or level[ranked[end]] != level[ranked[start]]:
            members = ranked[start:end]
            levels.append((start, end, np.array([number[before[o]] for o in members]), np.array([number[after[o]] for o in members])))
            start = end
    return _Recurrence(count, tuple(levels), np.array([rows[o] for o in ranked]), np.array([positions[o] for o in ranked]))


def time_tables(times: Sequence[Sequence[StageTimes]]) -> np.ndarray:
    """Per pipeline a row per stage's forward, then per stage's backward; a column per
    micro-batch (what `makespans` reads)."""
    return np.array([[[*t.fwd, *t.bwd] for t in pipe] for pipe in times]).transpose(0, 2, 1)


def makespans(
    tables: np.ndarray, pipelines: np.ndarray, orders: np.ndarray, extra_warmup: int = 0, chain: Chain | None = None
) -> np.ndarray:
    """The makespan of each candidate: `tables[g]` is pipeline g's time table (`time_tables`),
    candidate c runs pipeline `pipelines[c]`'s micro-batches in the order `orders[c]`
    (micro-batch indices by position). The pipeline is `chain` (its virtual stages the
    table's), or one 1F1B chain of the table's stages with `extra_warmup` warm-up forwards
    beyond 1F1B's (schedules.pipeline)."""
    stages, microbatches = tables.shape[1] // 2, tables.shape[2]
    chain = chain or Chain(((stages, 1),))
    assert chain.virtual_stages == stages, f"a chain of {chain.units} over {stages} virtual stages' times"
    rec = _recurrence(chain, microbatches, extra_warmup)
    # Each operation's seconds under each candidate (its row, at the micro-batch its position
    # holds), which the levels turn into its end.
    ends = np.zeros((rec.ops + 1, len(pipelines)))
    ends[: rec.ops] = tables[pipelines[None, :], rec.rows[:, None], orders[:, rec.positions].T]
    for start, end, before, after in rec.levels:
        ends[start:end] += np.maximum(ends[before], ends[after])
    return ends.max(axis=0)


def improve(
    times: Sequence[Sequence[StageTimes]], starts: Sequence[Sequence[int]], extra_warmup: int = 0, chain: Chain | None = None
) -> list[list[int]]:
    """Each pipeline's order (`times[g]`: its micro-batches' stage times, `starts[g]`: the
    order the search starts from), never slower by the recurrence (`makespans`: `chain`, or
    one 1F1B chain with `extra_warmup`) than its start. The pipelines must share their
    numbers of stages and micro-batches."""
    if not starts or len(starts[0]) < 2:
        return [list(start) for start in starts]
    orders = np.array([list(start) for start in starts], dtype=np.int64)
    count, microbatches = orders.shape
    tables = time_tables(times)
    every = np.arange(count)
    best = makespans(tables, every, orders, extra_warmup, chain)
    per = max(1, CANDIDATES // count)
    rng = np.random.default_rng(SEED)
    pipelines, rows = np.repeat(every, per), np.arange(count * per)
    for _ in range(ROUNDS):
        first = rng.integers(0, microbatches, size=count * per)
        second = (first + rng.integers(1, microbatches, size=count * per)) % microbatches  # another position
        candidates = orders[pipelines]  # a copy: fancy indexing
        candidates[rows, first], candidates[rows, second] = orders[pipelines, second], orders[pipelines, first]
        spans = makespans(tables, pipelines, candidates, extra_warmup, chain).reshape(count, per)
        pick = spans.argmin(axis=1)
        shortest = spans[every, pick]
        better = shortest < best
        orders[better] = candidates[(every * per + pick)[better]]
        best[better] = shortest[better]
    return orders.tolist()
