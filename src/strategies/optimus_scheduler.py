"""Optimus's bubble scheduler (Optimus §4.2-4.3, Algorithm 2; spec §3.4-3.5).

For one encoder plan and one split of the LLM's micro-batches among the encoder pipelines:

- InitSchedule (coarse): every encoder forward runs before the LLM computes (the bubble of
  the DP all-gather and the pipeline warm-up), every backward after it (cool-down and DP
  reduce-scatter). Each pipeline runs its forwards in order, stage after stage.
- OptimizeSchedule(FWD): findCritical picks the encoder pipeline whose forwards hold the LLM
  back the most; ScheduleKernels moves ONE of its micro-batches (its last) out of the
  pre-bubble into the bubbles between LLM operations, kernel by kernel, stage after stage
  (a stage's kernels start once the previous stage's are done and the hop has arrived):
  a kernel goes into a pipeline gap or a TP all-reduce bin only whole; an encoder
  all-reduce never sits in a TP bin: it starts where an LLM compute starts and must end
  within it, and the kernels after it wait for that compute to end. CheckEncLLMDep checks
  the NEW schedule (the printed Algorithm 2 checks the old one, spec §3.4): sorted encoder
  finish times EF must stay before the LLM's F_i without delaying the LLM. The loop stops
  at the first move that fails, as Algorithm 2 does.
- OptimizeSchedule(BWD): the same for backwards (the pipeline whose backwards end last; its
  micro-batch whose gradient comes first, placed after B_i, last stage first).

The LLM's timeline is rigid: encoder work in its bubbles does not move it; what does not
fit delays its start (Δ) or extends the iteration's end. Estimated latency = the end of
the slowest device: its LLM work shifted by Δ, its encoder backwards, the LLM's and the
encoder's gradient reduction and optimizer step. The simulator then prices the Program.

Scheduling efficiency (§5.3.2): the share of the encoder's compute that runs inside the
LLM's bubbles (the LLM-only timeline's bubbles, before its start, between its operations
and after its end until the iteration ends).
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from src.strategies.optimus_encoder import EncoderCosts, Item, Layout
from src.strategies.optimus_timeline import EPS, LLMTimeline


@dataclass(frozen=True)
class Placed:
    """An encoder item placed in the LLM's bubbles of rank class `klass`: a kernel in the
    gap before LLM operation `op` (kind 'gap') or in one of its TP bins ('tp'), or an
    all-reduce issued before its compute ('issue')."""

    klass: int
    kind: str
    op: int
    start: float
    item: Item
    pipeline: int
    local: int
    phase: str


@dataclass(frozen=True)
class Tails:
    """End-of-iteration work per LLM stage (gradient reduce-scatter, optimizer step, the
    parameter all-gather that runs before the LLM starts) and per encoder stage (its
    reduce-scatter, optimizer step and all-gather, after the backwards)."""

    llm_reduce: list[float]
    llm_optimizer: list[float]
    llm_gather: list[float]
    encoder: list[float]


@dataclass
class Schedule:
    counts: list[int]
    pre: list[int]
    fine_forward: dict[tuple[int, int], float] = field(default_factory=dict)
    fine_backward: set[tuple[int, int]] = field(default_factory=set)
    used: list[list[float]] = field(default_factory=list)
    issued: list[list[float]] = field(default_factory=list)
    placed: list[Placed] = field(default_factory=list)
    delta: float = 0.0
    latency: float = math.inf
    mapping: dict[tuple[int, int], int] = field(default_factory=dict)



class Journal:
    """What one move changed, to take it back when the move fails."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.pre = list(schedule.pre)
        self.fine_forward = dict(schedule.fine_forward)
        self.fine_backward = set(schedule.fine_backward)
        self.placed = len(schedule.placed)
        self.cells: list[tuple[list[float], int, float]] = []

    def set(self, cells: list[float], index: int, value: float) -> None:
        self.cells.append((cells, index, cells[index]))
        cells[index] = value

    def undo(self) -> None:
        s = self.schedule
        s.pre, s.fine_forward, s.fine_backward = self.pre, self.fine_forward, self.fine_backward
        del s.placed[self.placed:]
        for cells, index, value in reversed(self.cells):
            cells[index] = value


@dataclass(frozen=True)
class Evaluation:
    delta: float
    latency: float
    mapping: dict[tuple[int, int], int]
    forward_pressure: list[float]    # per pipeline: how far its forwards hold the LLM back
    backward_end: list[float]        # per pipeline: when its last post-bubble backward ends
    pre_busy: list[list[tuple[float, float, float]]]    # per class: (start, end, compute share)
    post_busy: list[list[tuple[float, float, float]]]


class BubbleScheduler:
    def __init__(self, timeline: LLMTimeline, layout: Layout, costs: EncoderCosts, tails: Tails) -> None:
        self.t, self.layout, self.costs, self.tails = timeline, layout, costs, tails
        self.microbatches = len(timeline.forward_points)
        self.pp = layout.plan.pp
        self.stage_of_class = [layout.position(g)[0] for g in range(layout.classes)]
        self.classes_of = [[layout.klass(j, e) for e in range(self.pp)] for j in range(layout.pipelines)]
        self.fwd = [w.seconds(w.forward) for w in costs.stages]
        self.bwd = [w.seconds(w.backward) for w in costs.stages]
        self.fwd_compute = [w.seconds(w.forward, comm=False) for w in costs.stages]
        self.bwd_compute = [w.seconds(w.backward, comm=False) for w in costs.stages]
        self.trains = any(w.backward for w in costs.stages)
        self.first = [st.first for st in timeline.stages]
        self.last = [st.last for st in timeline.stages]
        self.ends = [timeline.slots[s].ends for s in range(timeline.pp)]
        self.f_points, self.b_points = timeline.forward_points, timeline.backward_points
        # The LLM alone: its start after the all-gather, its end of iteration.
        self.delta0 = max(0.0, max(g - f for g, f in zip(tails.llm_gather, self.first)))
        self.llm_end = max(self.delta0 + last + rs + opt for last, rs, opt in
                           zip(self.last, tails.llm_reduce, tails.llm_optimizer))

    # ---- schedules -----------------------------------------------------------------------
    def initial(self, counts: list[int]) -> Schedule:
        """InitSchedule: every forward before the LLM, every backward after it."""
        slots = self.t.slots
        schedule = Schedule(list(counts), list(counts),
                            used=[[0.0] * len(slots[s].start) for s in self.stage_of_class],
                            issued=[[0.0] * len(slots[s].issue_time) for s in self.stage_of_class])
        self._settle(schedule, self.evaluate(schedule))
        return schedule

    def optimize(self, schedule: Schedule, mode: str) -> Schedule:
        """OptimizeSchedule: move one micro-batch of the critical pipeline at a time."""
        current = self.evaluate(schedule)
        while True:
            pipeline = self._critical(schedule, current, mode)
            if pipeline is None:
                return schedule
            journal = Journal(schedule)
            move = self._move_forward if mode == "fwd" else self._move_backward
            evaluation = self.evaluate(schedule) if move(schedule, pipeline, current, journal) else None
            if evaluation is None or not self.check(evaluation, current):
                journal.undo()
                return schedule
            current = evaluation
            self._settle(schedule, current)

    def best(self, counts: list[int], fine: bool = True) -> Schedule:
        schedule = self.initial(counts)
        if fine:
            schedule = self.optimize(schedule, "fwd")
            if self.trains:
                schedule = self.optimize(schedule, "bwd")
        return schedule

    @staticmethod
    def check(new: Evaluation, old: Evaluation) -> bool:
        """CheckEncLLMDep on the new schedule: its encoder outputs, in global order, are
        ready by the LLM's F_i without delaying the LLM further (backwards are placed after
        their B_i by construction)."""
        return math.isfinite(new.delta) and new.delta <= old.delta + EPS and new.latency <= old.latency + EPS

    @staticmethod
    def _settle(schedule: Schedule, evaluation: Evaluation) -> None:
        schedule.delta, schedule.latency, schedule.mapping = evaluation.delta, evaluation.latency, evaluation.mapping

    def _critical(self, schedule: Schedule, evaluation: Evaluation, mode: str) -> int | None:
        """findCritical: the pipeline whose forwards (backwards) are on the critical path."""
        if mode == "fwd":
            candidates = [j for j in range(self.layout.pipelines) if schedule.pre[j] > 0]
            key = evaluation.forward_pressure
        else:
            candidates = [j for j in range(self.layout.pipelines)
                          if any((j, t) not in schedule.fine_backward for t in range(schedule.counts[j]))]
            key = evaluation.backward_end
        return max(candidates, key=lambda j: (key[j], schedule.counts[j], -j), default=None)

    # ---- ScheduleKernels -----------------------------------------------------------------
    def _move_forward(self, schedule: Schedule, pipeline: int, evaluation: Evaluation, journal: Journal) -> bool:
        local = schedule.pre[pipeline] - 1
        deadline = self.f_points[-1] - self.costs.to_llm
        ready = 0.0
        for e in range(self.pp):
            end = self._pack(schedule, journal, self.classes_of[pipeline][e], self.costs.stages[e].forward, ready,
                             deadline, pipeline, local, "fwd")
            if end is None:
                return False
            ready = end + (self.costs.hops[e] if e < self.pp - 1 else self.costs.to_llm)
        schedule.pre[pipeline] -= 1
        schedule.fine_forward[(pipeline, local)] = ready
        return True

    def _move_backward(self, schedule: Schedule, pipeline: int, evaluation: Evaluation, journal: Journal) -> bool:
        waiting = [t for t in range(schedule.counts[pipeline]) if (pipeline, t) not in schedule.fine_backward]
        local = min(waiting, key=lambda t: self.b_points[evaluation.mapping[(pipeline, t)]])
        ready = self.b_points[evaluation.mapping[(pipeline, local)]] + self.costs.to_llm
        for e in reversed(range(self.pp)):
            end = self._pack(schedule, journal, self.classes_of[pipeline][e], self.costs.stages[e].backward, ready,
                             math.inf, pipeline, local, "bwd")
            if end is None:
                return False
            ready = end + (self.costs.hops[e - 1] if e > 0 else 0.0)
        schedule.fine_backward.add((pipeline, local))
        return True

    def _pack(self, schedule: Schedule, journal: Journal, klass: int, items: list[Item], ready: float,
              deadline: float, pipeline: int, local: int, phase: str) -> float | None:
        """Place one stage's items for one micro-batch, first fit in time order from
        `ready`; the end of its last kernel, or None (the journal takes it back)."""
        stage = self.stage_of_class[klass]
        slots = self.t.slots[stage]
        ends = self.ends[stage]
        used, issued = schedule.used[klass], schedule.issued[klass]
        n = len(ends)
        slot = bisect.bisect_right(ends, ready + EPS)
        for item in items:
            if item.is_comm:
                x = slots.first_issue_at(ready)
                while x < len(issued) and issued[x] + item.seconds > slots.issue_capacity[x] + EPS:
                    x += 1
                if x >= len(issued):
                    return None
                journal.set(issued, x, issued[x] + item.seconds)
                schedule.placed.append(Placed(klass, "issue", x, slots.issue_time[x], item, pipeline, local, phase))
                ready = slots.compute_end[x]
                slot = bisect.bisect_right(ends, ready + EPS)
                continue
            while True:
                if slot >= n:
                    return None
                begin = max(slots.start[slot] + used[slot], ready)
                if begin + item.seconds <= ends[slot] + EPS:
                    break
                slot += 1
            if begin + item.seconds > deadline:
                return None
            journal.set(used, slot, begin + item.seconds - slots.start[slot])
            schedule.placed.append(Placed(klass, slots.kind[slot], slots.op[slot], begin, item, pipeline, local, phase))
            ready = begin + item.seconds
        return ready

    # ---- estimates -------------------------------------------------------------------------
    def evaluate(self, schedule: Schedule) -> Evaluation:
        layout, tails = self.layout, self.tails
        classes = layout.classes
        pre_busy: list[list[tuple[float, float, float]]] = [[] for _ in range(classes)]
        pre_end = [0.0] * classes
        pre_ef: list[tuple[float, int, int]] = []
        for j in range(layout.pipelines):
            previous = [0.0] * self.pp
            for t in range(schedule.pre[j]):
                arrive = 0.0
                for e in range(self.pp):
                    g = self.classes_of[j][e]
                    begin = max(previous[e], arrive)
                    end = begin + self.fwd[e]
                    pre_busy[g].append((begin, end, self.fwd_compute[e] / self.fwd[e] if self.fwd[e] else 0.0))
                    previous[e] = end
                    arrive = end + (self.costs.hops[e] if e < self.pp - 1 else self.costs.to_llm)
                pre_ef.append((arrive, j, t))
            for e in range(self.pp):
                pre_end[self.classes_of[j][e]] = previous[e]
        delta = self.delta0
        for g in range(classes):
            delta = max(delta, pre_end[g] - self.first[self.stage_of_class[g]])
        fine = sorted((ef, j, t) for (j, t), ef in schedule.fine_forward.items())
        delta = self._dependency_delta(sorted(pre_ef), fine, delta)
        if not math.isfinite(delta):
            return Evaluation(math.inf, math.inf, {}, [0.0] * layout.pipelines, [0.0] * layout.pipelines,
                              pre_busy, [[] for _ in range(classes)])
        merged = sorted([(ef, 0, j, t) for ef, j, t in pre_ef] + [(ef + delta, 1, j, t) for ef, j, t in fine])
        mapping = {(j, t): i for i, (_, _, j, t) in enumerate(merged)}
        pressure = [0.0] * layout.pipelines
        for j in range(layout.pipelines):
            pressure[j] = max(pre_end[g] - self.first[self.stage_of_class[g]] for g in self.classes_of[j])
        for i, (ef, kind, j, t) in enumerate(merged):
            if kind == 0:
                pressure[j] = max(pressure[j], ef - self.f_points[i])
        # Backwards after the LLM, in the order their gradients arrive.
        post_busy: list[list[tuple[float, float, float]]] = [[] for _ in range(classes)]
        post_end = [0.0] * classes
        backward_end = [0.0] * layout.pipelines
        for j in range(layout.pipelines):
            waiting = sorted((self.b_points[mapping[(j, t)]], t) for t in range(schedule.counts[j])
                             if (j, t) not in schedule.fine_backward)
            if not waiting or not self.trains:
                continue
            previous = [delta + self.last[self.stage_of_class[self.classes_of[j][e]]] for e in range(self.pp)]
            for point, t in waiting:
                arrive = delta + point + self.costs.to_llm
                for e in reversed(range(self.pp)):
                    g = self.classes_of[j][e]
                    begin = max(previous[e], arrive)
                    end = begin + self.bwd[e]
                    post_busy[g].append((begin, end, self.bwd_compute[e] / self.bwd[e] if self.bwd[e] else 0.0))
                    previous[e] = end
                    arrive = end + (self.costs.hops[e - 1] if e > 0 else 0.0)
            for e in range(self.pp):
                post_end[self.classes_of[j][e]] = previous[e]
            backward_end[j] = max(previous)
        latency = 0.0
        encoder_ready = [0.0] * self.pp
        for g in range(classes):
            s = self.stage_of_class[g]
            done = max(delta + self.last[s] + tails.llm_reduce[s], post_end[g]) + tails.llm_optimizer[s]
            latency = max(latency, done)
            e = layout.position(g)[2]
            encoder_ready[e] = max(encoder_ready[e], done)
        for e in range(self.pp):
            latency = max(latency, encoder_ready[e] + tails.encoder[e])
        return Evaluation(delta, latency, mapping, pressure, backward_end, pre_busy, post_busy)

    def _dependency_delta(self, pre: list[tuple[float, int, int]], fine: list[tuple[float, int, int]],
                          least: float) -> float:
        """The least shift Δ ≥ `least` of the LLM for which the k-th encoder output to
        arrive is ready by F_k + Δ; inf if none exists."""
        f = self.f_points
        # However late the LLM starts, the encoder outputs placed in its bubbles keep
        # their place against it: they must fit after every pre-bubble output.
        for k, (ef, _, _) in enumerate(fine):
            if ef > f[len(pre) + k] + EPS:
                return math.inf
        if self._fits(pre, fine, least):
            return least
        low, high = least, max(least, max(ef for ef, _, _ in pre) - f[0]) + EPS
        for _ in range(60):
            mid = (low + high) / 2
            if self._fits(pre, fine, mid):
                high = mid
            else:
                low = mid
            if high - low < 1e-7:
                break
        return high

    def _fits(self, pre: list[tuple[float, int, int]], fine: list[tuple[float, int, int]], delta: float) -> bool:
        f = self.f_points
        merged = sorted([ef for ef, _, _ in pre] + [ef + delta for ef, _, _ in fine])
        return all(ef <= f[i] + delta + EPS for i, ef in enumerate(merged))

    # ---- efficiency ------------------------------------------------------------------------
    def efficiency(self, schedule: Schedule) -> float:
        """Share of the encoder's compute inside the LLM-only timeline's bubbles."""
        evaluation = self.evaluate(schedule)
        total = inside = 0.0
        shift = evaluation.delta - self.delta0
        for g in range(self.layout.classes):
            s, j, e = self.layout.position(g)
            total += schedule.counts[j] * (self.fwd_compute[e] + (self.bwd_compute[e] if self.trains else 0.0))
            pre_bubble = self.delta0 + self.first[s]
            for begin, end, share in evaluation.pre_busy[g]:
                inside += share * max(0.0, min(end, pre_bubble) - begin)
            post_from = self.delta0 + self.last[s]
            post_to = self.llm_end - self.tails.llm_optimizer[s]
            for begin, end, share in evaluation.post_busy[g]:
                b, f = begin - shift, end - shift
                inside += share * max(0.0, min(f, post_to) - max(b, post_from))
        inside += sum(p.item.seconds for p in schedule.placed if not p.item.is_comm)
        return inside / total if total else 1.0


# ---- micro-batch partitions ------------------------------------------------------------------
def partitions(microbatches: int, blocks: int, columns: int, limit: int) -> list[list[int]] | None:
    """Every split of the micro-batches among the blocks' pipelines (each pipeline at
    least one; the columns of a block see the same bubbles, so a block's share is split
    evenly among them), or None when there are more than `limit`."""
    spare = microbatches - blocks * columns
    if spare < 0:
        return []
    if math.comb(spare + blocks - 1, blocks - 1) > limit:
        return None
    out = []
    for cuts in itertools.combinations(range(spare + blocks - 1), blocks - 1):
        bounds = (-1,) + cuts + (spare + blocks - 1,)
        out.append(spread([columns + bounds[i + 1] - bounds[i] - 1 for i in range(blocks)], columns))
    return out


def spread(block_counts: list[int], columns: int) -> list[int]:
    """Per pipeline (j = k·columns + c): block k's micro-batches split evenly over its columns."""
    return [count // columns + (1 if c < count % columns else 0) for count in block_counts for c in range(columns)]


def local_search(microbatches: int, blocks: int, columns: int, latency) -> tuple[list[list[int]], int]:
    """When there are too many splits: from the even split, move one micro-batch between
    two blocks while the coarse latency falls. Returns the splits visited (best first)
    and how many were evaluated."""
    base, extra = divmod(microbatches, blocks)
    current = [base + (1 if k < extra else 0) for k in range(blocks)]
    seen = {tuple(current): latency(spread(current, columns))}
    improved = True
    while improved:
        improved = False
        best = seen[tuple(current)]
        for a in range(blocks):
            for b in range(blocks):
                if a == b or current[a] <= columns:
                    continue
                trial = list(current)
                trial[a] -= 1
                trial[b] += 1
                key = tuple(trial)
                if key not in seen:
                    seen[key] = latency(spread(trial, columns))
                if seen[key] < best - EPS:
                    best, choice = seen[key], trial
                    improved = True
        if improved:
            current = choice
    ranked = sorted(seen, key=lambda k: seen[k])
    return [spread(list(k), columns) for k in ranked], len(seen)
