"""Optimus's bubble scheduler (Optimus §4.2-4.3, Algorithm 2; docs/strategies.md, Optimus).

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
  the NEW schedule (the printed Algorithm 2 checks the old one, a slip: a move is kept
  only if the schedule it makes is valid): sorted encoder finish times EF must stay
  before the LLM's F_i without delaying the LLM. The loop stops at the first move that
  fails, as Algorithm 2 does.
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
import operator
from dataclasses import dataclass, field

from src.program import Phase
from src.strategies.optimus.encoder import EncoderCosts, EncoderPlan, Item, Layout
from src.strategies.optimus.timeline import EPS, LLMTimeline, Slots


@dataclass(slots=True)
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
    phase: Phase


@dataclass(slots=True)
class Run:
    """One encoder stage's items for one micro-batch as _pack placed them, in order: per
    item its start and where it went (a slot index of the stage's `slots`, or -1 - x for
    an all-reduce issued with operation x). A schedule places millions of items while
    the search places most of them again and again; the Placed records are built only
    for the schedule that is emitted."""

    klass: int
    pipeline: int
    local: int
    phase: Phase
    items: list[Item]
    slots: Slots
    where: list[int]
    starts: list[float]

    def placed(self) -> list[Placed]:
        kinds, ops, klass, pipeline, local, phase = self.slots.kind, self.slots.op, self.klass, self.pipeline, self.local, self.phase
        return [
            Placed(klass, kinds[x], ops[x], start, item, pipeline, local, phase)
            if x >= 0
            else Placed(klass, "issue", -1 - x, start, item, pipeline, local, phase)
            for item, x, start in zip(self.items, self.where, self.starts)
        ]


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
    # Per class: a slot's next candidate for a kernel (itself unless it is full: too
    # little room left for the stage's shortest kernel), and one past the last slot.
    skip: list[list[int]] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    delta: float = 0.0
    latency: float = math.inf
    mapping: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def placed(self) -> list[Placed]:
        """Every item placed in the LLM's bubbles, in the order they were placed."""
        return [p for run in self.runs for p in run.placed()]


class Journal:
    """What one move changed (the bubble cells it filled, the micro-batch it moved), to
    take it back when the move fails."""

    def __init__(self, schedule: Schedule, pipeline: int) -> None:
        self.schedule = schedule
        self.pipeline = pipeline
        self.pre = schedule.pre[pipeline]
        self.moved: tuple[int, int] | None = None
        self.runs = len(schedule.runs)
        self.cells: list[tuple[list[float], int, float]] = []

    def undo(self) -> None:
        s = self.schedule
        s.pre[self.pipeline] = self.pre
        if self.moved is not None:
            s.fine_forward.pop(self.moved, None)
            s.fine_backward.discard(self.moved)
        del s.runs[self.runs :]
        for cells, index, value in reversed(self.cells):
            cells[index] = value
        if self.cells:  # slots it filled have room again
            s.skip = [_open_slots(len(used)) for used in s.used]


@dataclass(frozen=True)
class ForwardSide:
    """What the encoder forwards decide: the LLM's shift Δ, which encoder output feeds
    which LLM micro-batch, and how far each pipeline's forwards hold the LLM back."""

    delta: float
    mapping: dict[tuple[int, int], int]
    pressure: list[float]


@dataclass(frozen=True)
class Evaluation:
    delta: float
    latency: float
    mapping: dict[tuple[int, int], int]
    forward_pressure: list[float]  # per pipeline: how far its forwards hold the LLM back
    backward_end: list[float]  # per pipeline: when its last post-bubble backward ends
    waiting: list[list[tuple[float, int]]]  # per pipeline: its post-bubble backwards, (B_i, local) in order
    forward: ForwardSide


@dataclass
class BackwardChains:
    """One pipeline's post-bubble backwards as last priced: Δ, each job's start at the
    last encoder stage, and per encoder stage its end before any job, then after each."""

    delta: float
    arrivals: list[float]
    ends: list[list[float]]

    @property
    def finals(self) -> list[float]:
        return [chain[-1] for chain in self.ends]

    def unchanged_jobs(self, arrivals: list[float]) -> int:
        """How many leading jobs of `arrivals` end where they did: those whose start is
        the same, or that both times waited for the job before them."""
        top = self.ends[-1]
        for k, (new, old) in enumerate(zip(arrivals, self.arrivals)):
            if new != old and (new > top[k] or old > top[k]):
                return k
        return min(len(arrivals), len(self.arrivals))


class BubbleScheduler:
    def __init__(self, timeline: LLMTimeline, layout: Layout, costs: EncoderCosts, tails: Tails) -> None:
        self.t, self.layout, self.costs, self.tails = timeline, layout, costs, tails
        self.microbatches = len(timeline.forward_points)
        self.pp = layout.plan.pp
        self.stage_of_class = [layout.position(g)[0] for g in range(layout.classes)]
        self.encoder_stage_of_class = [layout.position(g)[2] for g in range(layout.classes)]
        self.classes_of = [[layout.klass(j, e) for e in range(self.pp)] for j in range(layout.pipelines)]
        self.fwd = [w.seconds(w.forward) for w in costs.stages]
        self.bwd = [w.seconds(w.backward) for w in costs.stages]
        self.fwd_compute = [w.seconds(w.forward, comm=False) for w in costs.stages]
        self.bwd_compute = [w.seconds(w.backward, comm=False) for w in costs.stages]
        self.trains = any(w.backward for w in costs.stages)
        self.first = [st.first for st in timeline.stages]
        self.last = [st.last for st in timeline.stages]
        self.ends = [timeline.slots[s].ends for s in range(timeline.pp)]
        self.limits = [[end + EPS for end in ends] for ends in self.ends]  # a kernel fits if it ends by these
        self.shortest = [min((i.seconds for i in w.forward + w.backward if not i.is_comm), default=math.inf) for w in costs.stages]
        self.f_points, self.b_points = timeline.forward_points, timeline.backward_points
        # The LLM alone: its start after the all-gather, its end of iteration.
        self.delta0 = max(0.0, max(g - f for g, f in zip(tails.llm_gather, self.first)))
        self.llm_end = max(self.delta0 + last + rs + opt for last, rs, opt in zip(self.last, tails.llm_reduce, tails.llm_optimizer))
        # No schedule of this layout ends sooner: every evaluation has Δ >= delta0 and
        # post-bubble ends >= 0, and its latency is monotone in both (_latency).
        self.floor = self._latency(self.delta0, [0.0] * layout.classes)
        # Every pipeline's pre-bubble forwards start at 0 and cost the same per encoder
        # stage, so the t-th forward's times are one table for all pipelines.
        self.pre_begin, self.pre_end, self.pre_arrive = self._forward_chain(self.microbatches)
        # Per pipeline: the last post-bubble chain priced (Δ, B_i in order) and its ends,
        # which most moves leave as they were.
        self._backward_memo: list[BackwardChains | None] = [None] * layout.pipelines

    # ---- schedules -----------------------------------------------------------------------
    def initial(self, counts: list[int]) -> Schedule:
        """InitSchedule: every forward before the LLM, every backward after it."""
        slots = self.t.slots
        schedule = Schedule(
            list(counts),
            list(counts),
            used=[[0.0] * len(slots[s].start) for s in self.stage_of_class],
            issued=[[0.0] * len(slots[s].issue_time) for s in self.stage_of_class],
            skip=[_open_slots(len(slots[s].start)) for s in self.stage_of_class],
        )
        self._settle(schedule, self.evaluate(schedule))
        return schedule

    def optimize(self, schedule: Schedule, mode: str) -> Schedule:
        """OptimizeSchedule: move one micro-batch of the critical pipeline at a time.
        Backward moves leave the forwards, hence Δ and the mapping, as they are."""
        current = self.evaluate(schedule)
        move = self._move_forward if mode == "fwd" else self._move_backward
        while True:
            pipeline = self._critical(schedule, current, mode)
            if pipeline is None:
                return schedule
            journal = Journal(schedule, pipeline)
            evaluation = None
            if move(schedule, pipeline, current, journal):
                evaluation = self.evaluate(schedule, current.forward if mode == "bwd" else None)
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
            candidates = [j for j in range(self.layout.pipelines) if evaluation.waiting[j]]
            key = evaluation.backward_end
        return max(candidates, key=lambda j: (key[j], schedule.counts[j], -j), default=None)

    # ---- ScheduleKernels -----------------------------------------------------------------
    def _move_forward(self, schedule: Schedule, pipeline: int, evaluation: Evaluation, journal: Journal) -> bool:
        local = schedule.pre[pipeline] - 1
        deadline = self.f_points[-1] - self.costs.to_llm
        ready = 0.0
        for e in range(self.pp):
            end = self._pack(
                schedule, journal, self.classes_of[pipeline][e], self.costs.stages[e].forward, ready, deadline, pipeline, local, "fwd"
            )
            if end is None:
                return False
            ready = end + (self.costs.hops[e] if e < self.pp - 1 else self.costs.to_llm)
        journal.moved = (pipeline, local)
        schedule.pre[pipeline] -= 1
        schedule.fine_forward[(pipeline, local)] = ready
        return True

    def _move_backward(self, schedule: Schedule, pipeline: int, evaluation: Evaluation, journal: Journal) -> bool:
        point, local = evaluation.waiting[pipeline][0]  # the gradient that comes first
        ready = point + self.costs.to_llm
        for e in reversed(range(self.pp)):
            end = self._pack(
                schedule, journal, self.classes_of[pipeline][e], self.costs.stages[e].backward, ready, math.inf, pipeline, local, "bwd"
            )
            if end is None:
                return False
            ready = end + (self.costs.hops[e - 1] if e > 0 else 0.0)
        journal.moved = (pipeline, local)
        schedule.fine_backward.add((pipeline, local))
        return True

    def _pack(
        self,
        schedule: Schedule,
        journal: Journal,
        klass: int,
        items: list[Item],
        ready: float,
        deadline: float,
        pipeline: int,
        local: int,
        phase: Phase,
    ) -> float | None:
        """Place one stage's items for one micro-batch, first fit in time order from
        `ready`; the end of its last kernel, or None (the journal takes it back). The
        hottest loop of the planner: attribute look-ups hoisted out of it."""
        stage = self.stage_of_class[klass]
        slots = self.t.slots[stage]
        ends, limits = self.ends[stage], self.limits[stage]
        starts = slots.start
        issue_capacity = slots.issue_capacity
        used, issued, skip = schedule.used[klass], schedule.issued[klass], schedule.skip[klass]
        shortest = self.shortest[self.encoder_stage_of_class[klass]]
        cells = journal.cells
        run = Run(klass, pipeline, local, phase, items, slots, [], [])
        where, begins = run.where, run.starts
        n, n_issue = len(ends), len(issued)
        slot = _next_open(skip, bisect.bisect_right(ends, ready + EPS))
        # The journal needs a cell's value before the move's first change to it: the
        # kernels after the first in the same slot add no entry.
        journaled = -1
        for item in items:
            seconds = item.seconds
            if item.kernel < 0:  # an all-reduce: issued with an LLM compute it overlaps
                x = slots.first_issue_at(ready)
                while x < n_issue and issued[x] + seconds > issue_capacity[x] + EPS:
                    x += 1
                if x >= n_issue:
                    return None
                cells.append((issued, x, issued[x]))
                issued[x] += seconds
                where.append(-1 - x)
                begins.append(slots.issue_time[x])
                ready = slots.compute_end[x]
                slot = _next_open(skip, bisect.bisect_right(ends, ready + EPS))
                continue
            while True:
                if slot >= n:
                    return None
                begin = starts[slot] + used[slot]
                if begin < ready:
                    begin = ready
                if begin + seconds <= limits[slot]:
                    break
                slot = _next_open(skip, slot + 1)
            ready = begin + seconds
            if ready > deadline:
                return None
            if slot != journaled:
                cells.append((used, slot, used[slot]))
                journaled = slot
            used[slot] = ready - starts[slot]
            where.append(slot)
            begins.append(begin)
            # Full: no kernel fits after its last (rounding is monotone, so this is exact).
            if starts[slot] + used[slot] + shortest > limits[slot]:
                skip[slot] = slot + 1
        schedule.runs.append(run)
        return ready

    # ---- estimates -------------------------------------------------------------------------
    def _forward_chain(self, count: int) -> tuple[list[list[float]], list[list[float]], list[float]]:
        """A pipeline's first `count` forwards back to back, stage after stage: per forward,
        its begin and end on each encoder stage and its output's arrival at the LLM."""
        begins, ends, arrivals = [], [], []
        previous = [0.0] * self.pp
        for _ in range(count):
            arrive = 0.0
            begin_t = []
            for e in range(self.pp):
                begin = max(previous[e], arrive)
                begin_t.append(begin)
                previous[e] = begin + self.fwd[e]
                arrive = previous[e] + (self.costs.hops[e] if e < self.pp - 1 else self.costs.to_llm)
            begins.append(begin_t)
            ends.append(list(previous))
            arrivals.append(arrive)
        return begins, ends, arrivals

    def _pre_end(self, schedule: Schedule, j: int, e: int) -> float:
        """When pipeline j's pre-bubble forwards end on encoder stage e."""
        return self.pre_end[schedule.pre[j] - 1][e] if schedule.pre[j] else 0.0

    def _backward_chain(
        self, j: int, delta: float, points: list[float], busy: list[list[tuple[float, float, float]]] | None = None
    ) -> list[float]:
        """Pipeline j's post-bubble backwards, in the order their gradients arrive (B_i),
        last encoder stage first; each stage's end. Stage after stage: the same sums as
        job after job. The jobs before the first whose start differs from the previous
        call's are not priced again (a job queued behind the one before it starts when
        that one ends, whatever its own B_i). With `busy`, each backward's (begin, end,
        compute share) is kept."""
        arrivals = [delta + point + self.costs.to_llm for point in points]
        classes, memo = self.classes_of[j], self._backward_memo[j]
        if busy is None and memo is not None and memo.delta == delta:
            first, ends = memo.unchanged_jobs(arrivals), memo.ends
        else:
            first, ends = 0, [[delta + self.last[self.stage_of_class[g]]] for g in classes]
        chains: list[list[float]] = [[] for _ in range(self.pp)]
        stage_arrivals = arrivals[first:]
        for e in reversed(range(self.pp)):
            seconds = self.bwd[e]
            chain = ends[e][: first + 1]
            chain += itertools.accumulate(stage_arrivals, lambda prev, a: (a if a > prev else prev) + seconds, initial=chain[-1])
            del chain[first + 1]  # accumulate repeats its initial value
            chains[e] = chain
            if busy is not None:
                share = self.bwd_compute[e] / seconds if seconds else 0.0
                busy[classes[e]] += [(a if a > prev else prev, end, share) for prev, a, end in zip(chain, stage_arrivals, chain[1:])]
            if e > 0:
                hop = self.costs.hops[e - 1]
                stage_arrivals = [end + hop for end in chain[first + 1 :]]
        memo = BackwardChains(delta, arrivals, chains)
        self._backward_memo[j] = memo
        return memo.finals

    def evaluate(self, schedule: Schedule, forward: ForwardSide | None = None) -> Evaluation:
        """Estimate a schedule; `forward`: its forward side when only backwards changed."""
        layout = self.layout
        if forward is None:
            forward = self._forward_side(schedule)
        delta, mapping = forward.delta, forward.mapping
        pipelines = range(layout.pipelines)
        if not math.isfinite(delta):
            return Evaluation(
                math.inf, math.inf, {}, [0.0] * layout.pipelines, [0.0] * layout.pipelines, [[] for _ in pipelines], forward
            )
        # Backwards after the LLM, in the order their gradients arrive.
        post_end = [0.0] * layout.classes
        backward_end = [0.0] * layout.pipelines
        waiting = []
        for j in pipelines:
            waiting.append(
                sorted((self.b_points[mapping[(j, t)]], t) for t in range(schedule.counts[j]) if (j, t) not in schedule.fine_backward)
            )
            if not waiting[j] or not self.trains:
                continue
            finals = self._backward_chain(j, delta, [point for point, _ in waiting[j]])
            for e in range(self.pp):
                post_end[self.classes_of[j][e]] = finals[e]
            backward_end[j] = max(finals)
        latency = self._latency(delta, post_end)
        return Evaluation(delta, latency, mapping, forward.pressure, backward_end, waiting, forward)

    def _latency(self, delta: float, post_end: list[float]) -> float:
        """The iteration's end: each class's LLM work shifted by Δ or its post-bubble
        backwards (`post_end`), then the optimizer steps and the encoder's tails. Monotone
        in Δ and in every post_end, in floating point too (sums and maxima of the same
        terms in the same order), which makes `floor` a lower bound."""
        tails = self.tails
        latency = 0.0
        encoder_ready = [0.0] * self.pp
        for g in range(self.layout.classes):
            s = self.stage_of_class[g]
            done = max(delta + self.last[s] + tails.llm_reduce[s], post_end[g]) + tails.llm_optimizer[s]
            latency = max(latency, done)
            e = self.encoder_stage_of_class[g]
            encoder_ready[e] = max(encoder_ready[e], done)
        for e in range(self.pp):
            latency = max(latency, encoder_ready[e] + tails.encoder[e])
        return latency

    def _forward_side(self, schedule: Schedule) -> ForwardSide:
        pipelines = range(self.layout.pipelines)
        # Pre-bubble outputs in arrival order (the t-th forwards of all pipelines arrive together).
        pre_ef = sorted(
            (arrive, j, t)
            for t, arrive in enumerate(self.pre_arrive[: max(schedule.pre, default=0)])
            for j in pipelines
            if t < schedule.pre[j]
        )
        hold = [
            max(self._pre_end(schedule, j, e) - self.first[self.stage_of_class[self.classes_of[j][e]]] for e in range(self.pp))
            for j in pipelines
        ]
        delta = max([self.delta0, *hold])
        fine = sorted((ef, j, t) for (j, t), ef in schedule.fine_forward.items())
        delta = self._dependency_delta([ef for ef, _, _ in pre_ef], [ef for ef, _, _ in fine], delta)
        if not math.isfinite(delta):
            return ForwardSide(math.inf, {}, [0.0] * self.layout.pipelines)
        merged = sorted([(ef, 0, j, t) for ef, j, t in pre_ef] + [(ef + delta, 1, j, t) for ef, j, t in fine])
        mapping = {(j, t): i for i, (_, _, j, t) in enumerate(merged)}
        pressure = hold
        for i, (ef, kind, j, t) in enumerate(merged):
            if kind == 0:
                pressure[j] = max(pressure[j], ef - self.f_points[i])
        return ForwardSide(delta, mapping, pressure)

    def _dependency_delta(self, pre: list[float], fine: list[float], least: float) -> float:
        """The least shift Δ ≥ `least` of the LLM for which the k-th encoder output to
        arrive is ready by F_k + Δ; inf if none exists. `pre`, `fine`: the pre-bubble
        outputs' and the fine-grained ones' ready times, each in order."""
        f = self.f_points
        # However late the LLM starts, the encoder outputs placed in its bubbles keep
        # their place against it: they must fit after every pre-bubble output.
        if not all(map(operator.le, fine, [point + EPS for point in f[len(pre) :]])):
            return math.inf
        if self._fits(pre, fine, least):
            return least
        low, high = least, max(least, max(pre) - f[0]) + EPS
        for _ in range(60):
            mid = (low + high) / 2
            if self._fits(pre, fine, mid):
                high = mid
            else:
                low = mid
            if high - low < 1e-7:
                break
        return high

    def _fits(self, pre: list[float], fine: list[float], delta: float) -> bool:
        merged = sorted(pre + [ef + delta for ef in fine])
        return all(map(operator.le, merged, [point + delta + EPS for point in self.f_points]))

    # ---- efficiency ------------------------------------------------------------------------
    def efficiency(self, schedule: Schedule) -> float:
        """Share of the encoder's compute inside the LLM-only timeline's bubbles."""
        evaluation = self.evaluate(schedule)
        post_busy: list[list[tuple[float, float, float]]] = [[] for _ in range(self.layout.classes)]
        if self.trains and math.isfinite(evaluation.delta):
            for j, waiting in enumerate(evaluation.waiting):
                if waiting:
                    self._backward_chain(j, evaluation.delta, [point for point, _ in waiting], post_busy)
        total = inside = 0.0
        shift = evaluation.delta - self.delta0
        for g in range(self.layout.classes):
            s, j, e = self.layout.position(g)
            total += schedule.counts[j] * (self.fwd_compute[e] + (self.bwd_compute[e] if self.trains else 0.0))
            pre_bubble = self.delta0 + self.first[s]
            share = self.fwd_compute[e] / self.fwd[e] if self.fwd[e] else 0.0
            for t in range(schedule.pre[j]):
                begin, end = self.pre_begin[t][e], self.pre_end[t][e]
                inside += share * max(0.0, min(end, pre_bubble) - begin)
            post_from = self.delta0 + self.last[s]
            post_to = self.llm_end - self.tails.llm_optimizer[s]
            for begin, end, share in post_busy[g]:
                b, f = begin - shift, end - shift
                inside += share * max(0.0, min(f, post_to) - max(b, post_from))
        # Every placed kernel (not an all-reduce): Item.is_comm read directly, over millions of items.
        inside += sum(item.seconds for run in schedule.runs for item in run.items if item.kernel >= 0)
        return inside / total if total else 1.0


_OPEN: dict[int, list[int]] = {}


def _open_slots(slots: int) -> list[int]:
    """Skip pointers of `slots` slots none of which is full (and one past the last): a
    copy of one list per length, which the search makes again and again."""
    template = _OPEN.get(slots)
    if template is None:
        template = _OPEN[slots] = list(range(slots + 1))
    return template.copy()


def _next_open(skip: list[int], slot: int) -> int:
    """The first slot from `slot` on that is not full (skip pointers, path-halved)."""
    while skip[slot] != slot:
        skip[slot] = skip[skip[slot]]
        slot = skip[slot]
    return slot


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


@dataclass
class Candidate:
    """An encoder plan with its best schedule in the LLM's bubbles, and what ranks it."""

    plan: EncoderPlan
    layout: Layout
    costs: EncoderCosts
    scheduler: BubbleScheduler | None  # None once it came back from another process
    schedule: Schedule
    eff_coarse: float
    eff_fine: float
    coarse_latency: float
    partitions_total: int
    partitions_evaluated: int
    search: str
