"""The LLM pipeline's timeline as Optimus's bubble scheduler sees it (Optimus §4.2-4.3).

The LLM's stages are emitted once (PipelineEmitter); every schedule operation is priced by
the cost model the simulator uses (its compute, the TP all-reduces that block the compute
stream, the hop that brings its input) and the operations are timed as a dependency graph:
an operation starts when its stage is free and its input has arrived. From that timeline:

- the bubbles: on each stage, the gap before every operation (pipeline bubbles) and the TP
  all-reduces inside it (one bin per all-reduce: an encoder kernel must fit in one), and
  the issue points where an encoder all-reduce can overlap an LLM compute;
- GetEncLLMDep: F_i, when the first stage starts chunk 0's forward of micro-batch i (it
  needs the encoder's output), and B_i, when it finishes chunk 0's backward of i (the
  encoder's gradient is ready); `defer_warmup` lowers each stage's warm-up count as far as
  the pipeline's length allows, which moves the last F_i later (Optimus Fig. 12).

Times are relative to the LLM's start; the iteration's parameter all-gather comes before.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from dataclasses import dataclass, field
from functools import cached_property

from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.models.spec import ModelSpec
from src.program import COMPUTE_STREAM, Collective, Compute, Hop, Program, Recv
from src.schedules.pipeline import PipeOp, interleaved, warmup_counts
from src.strategies.builders.pipeline import Stage

EPS = 1e-9


@dataclass(frozen=True)
class OpCost:
    """One schedule operation of one stage: its compute, the blocking TP all-reduces after
    it (seconds each), and the hop that brings its input (0 for none)."""

    compute: float
    tp_bins: tuple[float, ...]
    hop: float

    @cached_property  # read for every operation of every trial timing
    def total(self) -> float:
        return self.compute + sum(self.tp_bins)


CostTable = dict[tuple[str, int], OpCost]


def op_costs(stage: Stage, program: Program, model: ModelSpec, compute: ComputeModel, comm: CommModel) -> CostTable:
    """Price the schedule operations of an emitted stage as the simulator would, by (kind,
    chunk): every micro-batch's forward (backward) of a chunk costs the same."""
    out: CostTable = {}
    hop_time: dict[str, float] = {}
    for stage_op in stage.ops:
        op = stage_op.op
        assert isinstance(op, PipeOp), "the LLM's stages run pipeline operations only"
        key = (op.kind, op.chunk)
        if key in out:
            continue
        busy, bins, hop = 0.0, [], 0.0
        for instruction in stage_op.instructions:
            if isinstance(instruction, Compute):
                busy += compute.work_time(instruction.work, model)
            elif isinstance(instruction, Collective) and instruction.stream == COMPUTE_STREAM:
                group = program.groups[instruction.group]
                one = comm.collective_time(instruction.op, group.ranks, instruction.bytes, group.sharing)
                bins += [one] * instruction.count
            elif isinstance(instruction, Recv):
                # The encoders' hand-off (a Table route, not built yet) is the scheduler's.
                route = program.routes.get(instruction.route)
                if isinstance(route, Hop):
                    if route.name not in hop_time:
                        hop_time[route.name] = max(comm.p2p_time(a, b, route.bytes, route.sharing) for a, b in zip(route.a, route.b))
                    hop = max(hop, hop_time[route.name])
        out[key] = OpCost(busy, tuple(bins), hop)
    return out


def costs_of(orders: list[list[PipeOp]], tables: list[CostTable]) -> list[list[OpCost]]:
    return [[table[(op.kind, op.chunk)] for op in order] for order, table in zip(orders, tables)]


@dataclass
class StageTimes:
    """One stage's operations on the LLM's clock."""

    start: list[float]
    end: list[float]
    costs: list[OpCost]

    @property
    def first(self) -> float:
        return self.start[0] if self.start else 0.0

    @property
    def last(self) -> float:
        return self.end[-1] if self.end else 0.0


class Deadlock(ValueError):
    """A schedule whose stages wait on each other forever (a trial warm-up count that a
    stage's predecessor cannot feed)."""


class Overrun(ValueError):
    """A schedule that cannot end by the deadline it was timed against."""


def time_pipeline(orders: list[list[PipeOp]], costs: list[list[OpCost]], deadline: float = math.inf) -> list[StageTimes]:
    """Time the schedule as a dependency graph: a forward of virtual stage v waits for v-1's
    forward of its micro-batch plus the hop, a backward for v+1's backward plus the hop.
    (Run for every warm-up count GetEncLLMDep tries: each operation's input is found by
    its virtual stage and micro-batch, and the sweep over the stages only reads lists.)
    Raises Overrun as soon as a stage cannot end by `deadline`: its operations timed so
    far end later than the deadline less the rest of its work, with a margin far above
    the rounding of the sums (a trial found too long early is not timed to its end)."""
    pp = len(orders)
    virtual = max((max(map(_CHUNK, order), default=0) for order in orders), default=0) * pp + pp
    microbatches = max((max(map(_MICROBATCH, order), default=0) for order in orders), default=0) + 1
    forward_end = [[-1.0] * microbatches for _ in range(virtual)]
    backward_end = [[-1.0] * microbatches for _ in range(virtual)]
    ops = [[(op.kind == "F", op.chunk * pp + s, op.microbatch) for op in order] for s, order in enumerate(orders)]
    totals = [list(map(_TOTAL, stage)) for stage in costs]
    hops = [list(map(_HOP, stage)) for stage in costs]
    # Per stage, the work after each operation (none: no deadline to check against).
    late = deadline * (1 + 1e-6) if math.isfinite(deadline) else math.inf
    rest = [list(itertools.accumulate(reversed(t[1:] + [0.0])))[::-1] for t in totals] if math.isfinite(late) else []
    start = [[0.0] * len(order) for order in orders]
    end = [[-1.0] * len(order) for order in orders]
    position = [0] * pp
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            x, n = position[s], len(ops[s])
            stage_ops, stage_start, stage_end, stage_totals, stage_hops = ops[s], start[s], end[s], totals[s], hops[s]
            ready = stage_end[x - 1] if x else 0.0
            while x < n:
                forward, v, j = stage_ops[x]
                if forward:
                    arrived = forward_end[v - 1][j] if v else None
                elif v < virtual - 1:
                    arrived = backward_end[v + 1][j]
                else:
                    arrived = None
                if arrived is not None:
                    if arrived < 0:
                        break
                    arrived += stage_hops[x]
                    if arrived > ready:
                        ready = arrived
                stage_start[x] = ready
                ready += stage_totals[x]
                stage_end[x] = ready
                (forward_end if forward else backward_end)[v][j] = ready
                x += 1
            if x != position[s]:
                if rest and ready + rest[s][x - 1] > late:
                    raise Overrun(f"stage {s} ends after {deadline}")
                remaining -= x - position[s]
                position[s] = x
                progressed = True
        if not progressed:
            raise Deadlock("the pipeline schedule deadlocks")
    return [StageTimes(start[s], end[s], costs[s]) for s in range(pp)]


_CHUNK, _MICROBATCH = operator.attrgetter("chunk"), operator.attrgetter("microbatch")
_TOTAL, _HOP = operator.attrgetter("total"), operator.attrgetter("hop")


def makespan(times: list[StageTimes]) -> float:
    return max(t.last for t in times)


def deferred_warmups(microbatches: int, chunks: int, tables: list[CostTable], base: list[list[PipeOp]]) -> list[int]:
    """GetEncLLMDep's adjustment: the first stage runs as few warm-up forwards as keep the
    pipeline as short as Megatron's warm-up counts do, each step taking one forward off
    the first stage and, where that alone would stall the next stages, off the fewest
    stages after it too (Optimus Fig. 12: the later stages' warm-ups shrink with it)."""
    pp = len(base)
    warmups = warmup_counts(base)
    target = makespan(time_pipeline(base, costs_of(base, tables)))
    limit = target * (1 + 1e-9) + EPS
    least = (chunks - 1) * pp
    while warmups[0] > least:
        for depth in range(1, pp + 1):
            trial = [w - 1 if s < depth else w for s, w in enumerate(warmups)]
            if min(trial[:depth]) < least:
                return warmups
            orders = interleaved(pp, microbatches, chunks, trial)
            try:
                kept = makespan(time_pipeline(orders, costs_of(orders, tables), limit)) <= limit
            except Deadlock:  # a stage would wait for forwards its predecessor defers: take one off more stages
                continue
            except Overrun:  # longer than Megatron's: as a makespan over the limit
                continue
            if kept:
                warmups = trial
                break
        else:
            return warmups
    return warmups


@dataclass
class Slots:
    """The bubbles of one stage inside the LLM's compute, in time order, each with the LLM
    operation it belongs to: a gap before operation x (kind 'gap') or one TP all-reduce of
    x (kind 'tp'). Issue points: before each operation's compute an encoder all-reduce can
    start and overlap it (capacity: the compute's length)."""

    start: list[float] = field(default_factory=list)
    length: list[float] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    op: list[int] = field(default_factory=list)
    issue_time: list[float] = field(default_factory=list)
    issue_capacity: list[float] = field(default_factory=list)
    compute_end: list[float] = field(default_factory=list)

    @property
    def ends(self) -> list[float]:
        return [s + n for s, n in zip(self.start, self.length)]

    def first_after(self, time: float) -> int:
        """The first slot that ends after `time`."""
        return bisect.bisect_right(self.ends, time + EPS)

    def first_issue_at(self, time: float) -> int:
        """The first operation whose compute starts at or after `time`."""
        return bisect.bisect_left(self.issue_time, time - EPS)


def stage_slots(times: StageTimes, min_gap: float) -> Slots:
    """Bubbles after the stage's first operation starts (the time before it is the
    coarse pre-bubble) and before its last operation ends (after: the post-bubble)."""
    out = Slots()
    previous_end = None
    for x, (start, end, cost) in enumerate(zip(times.start, times.end, times.costs)):
        if previous_end is not None and start - previous_end > min_gap:
            out.start.append(previous_end)
            out.length.append(start - previous_end)
            out.kind.append("gap")
            out.op.append(x)
        out.issue_time.append(start)
        out.issue_capacity.append(cost.compute)
        out.compute_end.append(start + cost.compute)
        at = start + cost.compute
        for one in cost.tp_bins:
            out.start.append(at)
            out.length.append(one)
            out.kind.append("tp")
            out.op.append(x)
            at += one
        previous_end = end
    return out


@dataclass
class LLMTimeline:
    """Everything the bubble scheduler reads about the LLM: per stage the operation times
    and bubbles, the dependency points, and the end of iteration work (gradient
    reduce-scatter and optimizer step per stage; the parameter all-gather before)."""

    orders: list[list[PipeOp]]
    stages: list[StageTimes]
    slots: list[Slots]
    forward_points: list[float]  # F_i
    backward_points: list[float]  # B_i
    all_gather: float
    reduce_scatter: list[float]
    optimizer: list[float]
    warmups: list[int]

    @property
    def pp(self) -> int:
        return len(self.stages)

    def end(self) -> float:
        """The LLM-only iteration on the LLM's clock (its all-gather comes before 0)."""
        return max(t.last + rs + opt for t, rs, opt in zip(self.stages, self.reduce_scatter, self.optimizer))


def dependency_points(orders: list[list[PipeOp]], stage0: StageTimes, microbatches: int) -> tuple[list[float], list[float]]:
    """F_i and B_i on the first stage (chunk 0: the layers that read the encoder)."""
    forward, backward = [0.0] * microbatches, [0.0] * microbatches
    for x, op in enumerate(orders[0]):
        if op.chunk == 0 and op.kind == "F":
            forward[op.microbatch] = stage0.start[x]
        elif op.chunk == 0 and op.kind == "B":
            backward[op.microbatch] = stage0.end[x]
    return forward, backward
