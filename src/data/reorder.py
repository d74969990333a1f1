"""DistTrain's data reordering within one global batch (§6, Algorithms 2 and 3; docs/strategies.md, DistTrain).

Intra-microbatch reordering (Algorithm 2) balances the samples' sizes over the
data-parallel groups: greedy number partitioning (LPT), largest first, each sample to the
least-loaded group. Every DP rank must process as many samples as the others, so the
equal-count variant caps every group at ceil(n / d) samples.

Inter-microbatch reordering (Algorithm 3) orders one pipeline's micro-batches to fill the
1F1B intervals at its first stage: the smallest micro-batch first, the p-1 next smallest
kept for the cool-down (their intervals are never filled), and every other position
given the micro-batch whose first-stage forward best matches the interval it fills. The
interval volumes come from the 1F1B dependency recurrence (`IntervalSim`), advanced
incrementally as micro-batches are placed (O(p) per placement).

Reordering permutes samples inside one global batch only, so the synchronous training
semantics (and the loss) do not change.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from src.schedules.pipeline import PipeOp, build_schedule


def lpt(sizes: Sequence[float], groups: int, equal_count: bool = True) -> list[list[int]]:
    """Algorithm 2's partition: indices of `sizes` per group, each in the order assigned
    (descending size; ties go to the lower index, and to the lower group)."""
    if groups < 1:
        raise ValueError(f"lpt needs at least one group, got {groups}")
    cap = math.ceil(len(sizes) / groups) if equal_count else len(sizes)
    members: list[list[int]] = [[] for _ in range(groups)]
    heap = [(0.0, g) for g in range(groups)]  # (load, group): the least loaded, lowest index first
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, group = heapq.heappop(heap)
        members[group].append(index)
        if len(members[group]) < cap:
            heapq.heappush(heap, (load + sizes[index], group))
    return members


@functools.lru_cache(maxsize=64)
def _one_f_one_b(stages: int, microbatches: int, extra_warmup: int) -> list[list[PipeOp]]:
    """1F1B's orders, made once per shape: every replica's reordering walks the same ones
    (read, never changed)."""
    return build_schedule("1f1b", stages, microbatches, extra_warmup=extra_warmup)


def group_loads(sizes: Sequence[float], members: list[list[int]]) -> list[float]:
    return [sum(sizes[i] for i in group) for group in members]


@dataclass(frozen=True)
class StageTimes:
    """One micro-batch's forward and backward seconds on every pipeline stage."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]


class IntervalSim:
    """1F1B over `stages` stages and `microbatches` positions, advanced as positions are
    filled: end(op) = max(end of the stage's previous op, end of its dependency) + its
    duration, where F(s, j) depends on F(s-1, j), B(s, j) on B(s+1, j) and B(p-1, j) on
    F(p-1, j). Ops run only once their position is filled, in each stage's 1F1B order
    (`extra_warmup`: that many more warm-up forwards on every stage but the last)."""

    def __init__(self, stages: int, microbatches: int, extra_warmup: int = 0) -> None:
        self.p, self.m = stages, microbatches
        self.orders = _one_f_one_b(stages, microbatches, extra_warmup)
        self.next = [0] * stages
        self.free = [0.0] * stages
        # end of F(s, j) and B(s, j), None until run: indexed [stage][microbatch]
        self.fwd_end: list[list[float | None]] = [[None] * microbatches for _ in range(stages)]
        self.bwd_end: list[list[float | None]] = [[None] * microbatches for _ in range(stages)]
        self.times: list[StageTimes] = []

    def place(self, times: StageTimes) -> None:
        if len(self.times) >= self.m:
            raise ValueError(f"all {self.m} positions are already filled")
        self.times.append(times)
        self._advance()

    def _advance(self) -> None:
        # Every replica's reordering places each of its micro-batches here: kept to plain
        # lists and locals, as it is most of a balancing policy's time.
        p, orders, fwd_end, bwd_end, times = self.p, self.orders, self.fwd_end, self.bwd_end, self.times
        placed = len(times)
        # A stage that moves on may let its neighbours move on (a forward feeds the next
        # stage, a backward the one before): revisit those only.
        pending, queued = list(range(p - 1, -1, -1)), [True] * p
        while pending:
            s = pending.pop()
            queued[s] = False
            order, i, clock = orders[s], self.next[s], self.free[s]
            while i < len(order):
                op = order[i]
                j = op.microbatch
                if j >= placed:
                    break
                if op.kind == "F":
                    dep = 0.0 if s == 0 else fwd_end[s - 1][j]
                    if dep is None:
                        break
                    clock = max(clock, dep) + times[j].fwd[s]
                    fwd_end[s][j] = clock
                else:
                    dep = fwd_end[s][j] if s == p - 1 else bwd_end[s + 1][j]
                    if dep is None:
                        break
                    clock = max(clock, dep) + times[j].bwd[s]
                    bwd_end[s][j] = clock
                i += 1
            if i != self.next[s]:
                self.next[s], self.free[s] = i, clock
                for neighbour in (s - 1, s + 1):
                    if 0 <= neighbour < p and not queued[neighbour]:
                        queued[neighbour] = True
                        pending.append(neighbour)

    def volume(self, k: int) -> float | None:
        """V_k = r_k - a_k (0-based k; may be negative) if both ends are known: a_0 = end
        of F_0 on stage 0, a_k = end of B_{k-1} there; r_k = when B_k's input gradient
        reaches stage 0 (the end of B_k on stage 1)."""
        anchor = self.fwd_end[0][0] if k == 0 else self.bwd_end[0][k - 1]
        ready = self.bwd_end[1][k] if self.p > 1 else self.fwd_end[0][k]
        if anchor is None or ready is None:
            return None
        return ready - anchor

    @property
    def makespan(self) -> float:
        return max(self.free)


def interval_volumes(times: Sequence[StageTimes]) -> tuple[list[float], float]:
    """Raw r_k - a_k for every position of a complete order, and its 1F1B makespan."""
    sim = IntervalSim(len(times[0].fwd), len(times))
    for t in times:
        sim.place(t)
    volumes = [sim.volume(k) for k in range(len(times))]
    known = [v for v in volumes if v is not None]
    assert len(known) == len(volumes), "a complete order has every volume"
    return known, sim.makespan


def round_trip(times: StageTimes) -> float:
    """A lone micro-batch's trip from stage 0's output back to stage 0's input: what
    the first interval holds before the forwards that fill it are chosen."""
    return sum(times.fwd[1:]) + sum(times.bwd[1:])


def _closest(pending: list[int], size: Sequence[float], target: float) -> int:
    return min(pending, key=lambda i: (abs(size[i] - target), size[i], i))


def inter_reorder(times: Sequence[StageTimes], descending_tail: bool = False) -> list[int]:
    """Algorithm 3: an order (indices into `times`) of one pipeline's micro-batches. A
    micro-batch's size is its forward time on stage 0. Interval 0 (filled by p-1
    forwards) is matched in sum against a lone micro-batch's round trip; interval k > 0
    (filled by one forward) against its volume from the recurrence."""
    m = len(times)
    if m == 0:
        return []
    p = len(times[0].fwd)
    size = [t.fwd[0] for t in times]
    pending = sorted(range(m), key=lambda i: (size[i], i))
    order = [pending.pop(0)]
    tail_count = min(p - 1, len(pending))
    tail, pending = pending[:tail_count], pending[tail_count:]
    sim = IntervalSim(p, m)
    sim.place(times[order[0]])
    k = 0
    while pending:
        if k == 0:
            remaining = round_trip(times[order[0]])
            picks = min(p - 1, len(pending))
            for slot in range(picks):
                chosen = _closest(pending, size, remaining / (picks - slot))
                pending.remove(chosen)
                order.append(chosen)
                sim.place(times[chosen])
                remaining -= size[chosen]
        else:
            volume = sim.volume(k)
            chosen = _closest(pending, size, max(0.0, volume if volume is not None else 0.0))
            pending.remove(chosen)
            order.append(chosen)
            sim.place(times[chosen])
        k += 1
    order += sorted(tail, key=lambda i: (-size[i], i)) if descending_tail else tail
    return order
