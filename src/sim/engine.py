"""The discrete-event engine: executes a Program against the cost model.

Every rank class runs its instruction list in issue order; each stream executes its
instructions in order; a communication instruction on a side stream starts once the data
it carries is ready on the compute stream. Cross-rank events are a collective (it starts
when every participating class has issued it and its stream is free) and a message (an
eager send; the receive completes when it has arrived). Classes run until they block on
such an event and are woken when it happens, so each instruction is processed once.

Why the compute stream waits is recorded as it happens: the part of a wait during which
the awaited transfer was moving data is exposed communication of its kind; the part spent
waiting for a peer to issue it (or for a sender to produce the data) is a bubble.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from src.cluster import ClusterSpec
from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.models.spec import ModelSpec
from src.program import (COMPUTE_STREAM, BatchSync, Collective, Compute, Instruction, Program,
                         RankProgram, Recv, Send, Wait)
from src.timeline import BREAKDOWN_CATEGORIES, RankTimeline, Span, Timeline

EPS = 1e-12
PEER_WAIT = "peer_wait"


class SimulationError(RuntimeError):
    """A Program that cannot run: a deadlock, a receive with no send, a bad group."""


@dataclass
class _Op:
    """A communication operation as seen by one rank class."""

    kind: str
    start: float = 0.0
    end: float = 0.0
    resolved: bool = False
    peer_delayed: bool = False


@dataclass
class _Arrival:
    """One collective instance: which classes have issued it, and when each was ready."""

    instruction: Collective
    ready: dict[int, float] = field(default_factory=dict)
    ops: dict[int, _Op] = field(default_factory=dict)


@dataclass
class _ClassState:
    index: int
    program: RankProgram
    instructions: list[Instruction]
    ip: int = 0
    free: dict[str, float] = field(default_factory=lambda: {COMPUTE_STREAM: 0.0})
    pending: dict[str, _Op] = field(default_factory=dict)
    handles: dict[str, _Op] = field(default_factory=dict)
    collective_seq: dict[str, int] = field(default_factory=dict)
    segments: list[tuple[float, float, str]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    first_backward: float | None = None
    last_forward: float | None = None
    queued: bool = False

    def stream_free(self, stream: str) -> float:
        return self.free.get(stream, 0.0)


def _expand(instructions: list[Instruction]) -> list[Instruction]:
    """A BatchSync is its blocking gather followed by the interaction's compute."""
    out: list[Instruction] = []
    for instruction in instructions:
        if isinstance(instruction, BatchSync):
            if instruction.gather is not None:
                out.append(instruction.gather)
            out.append(Compute(instruction.work, microbatch=instruction.microbatches[0]))
        else:
            out.append(instruction)
    return out


class Simulator:
    def __init__(self, program: Program, model: ModelSpec, cluster: ClusterSpec, precision: str):
        self.program = program
        self.model = model
        self.cluster = cluster
        self.compute = ComputeModel(cluster, precision)
        self.comm = CommModel(cluster)
        self.states = [_ClassState(i, rp, _expand(rp.instructions)) for i, rp in enumerate(program.classes)]
        self.class_of_rank: dict[int, int] = {}
        for state in self.states:
            for rank in state.program.ranks:
                if rank in self.class_of_rank:
                    raise SimulationError(f"rank {rank} appears in two instruction lists")
                self.class_of_rank[rank] = state.index
        self.participants: dict[str, tuple[int, ...]] = {}
        self.arrivals: dict[tuple[str, int], _Arrival] = {}
        self.messages: dict[str, _Op] = {}
        self.waiting_for_message: dict[str, list[int]] = {}
        self.waiting_for_op: dict[int, list[int]] = {}
        self.ready: deque[int] = deque()
        self.collective_cost: dict[tuple, float] = {}
        self.p2p_cost: dict[tuple, float] = {}
        self.events = 0

    # ---- driver -------------------------------------------------------------------------
    def run(self) -> Timeline:
        for state in self.states:
            self._wake(state.index)
        while self.ready:
            index = self.ready.popleft()
            state = self.states[index]
            state.queued = False
            while state.ip < len(state.instructions):
                if not self._step(state, state.instructions[state.ip]):
                    break
                state.ip += 1
                self.events += 1
        stuck = [s for s in self.states if s.ip < len(s.instructions)]
        if stuck:
            details = "; ".join(f"{s.program.label or s.index} at #{s.ip} {s.instructions[s.ip]!r}" for s in stuck[:4])
            raise SimulationError(f"deadlock: {len(stuck)} rank classes cannot proceed: {details}")
        return self._timeline()

    def _wake(self, index: int) -> None:
        state = self.states[index]
        if not state.queued:
            state.queued = True
            self.ready.append(index)

    # ---- one instruction ----------------------------------------------------------------
    def _step(self, state: _ClassState, instruction: Instruction) -> bool:
        """Execute one instruction; False if it must wait for another class."""
        if isinstance(instruction, Compute):
            return self._compute(state, instruction)
        if isinstance(instruction, Collective):
            return self._collective(state, instruction)
        if isinstance(instruction, Send):
            return self._send(state, instruction)
        if isinstance(instruction, Recv):
            return self._recv(state, instruction)
        if isinstance(instruction, Wait):
            return self._wait(state, instruction)
        raise SimulationError(f"unknown instruction {instruction!r}")

    def _blocked_on_streams(self, state: _ClassState, *streams: str) -> bool:
        for stream in streams:
            op = state.pending.get(stream)
            if op is not None:
                self.waiting_for_op.setdefault(id(op), []).append(state.index)
                return True
        return False

    def _compute(self, state: _ClassState, instruction: Compute) -> bool:
        if self._blocked_on_streams(state, COMPUTE_STREAM):
            return False
        work = instruction.work
        start = state.stream_free(COMPUTE_STREAM)
        end = start + self.compute.work_time(work, self.model)
        state.free[COMPUTE_STREAM] = end
        state.segments.append((start, end, "compute"))
        state.spans.append(Span(COMPUTE_STREAM, start, end, f"{work.phase} {work.unit} L{work.layers[0]}-{work.layers[1]}",
                                "compute", work.unit, instruction.microbatch))
        if work.phase in ("bwd", "bwd_input", "bwd_weight", "interaction") and state.first_backward is None:
            state.first_backward = start
        if work.phase in ("fwd", "interaction"):
            state.last_forward = end
        return True

    def _collective(self, state: _ClassState, instruction: Collective) -> bool:
        stream = instruction.stream
        if self._blocked_on_streams(state, stream, COMPUTE_STREAM):
            return False
        group = self.program.groups.get(instruction.group)
        if group is None:
            raise SimulationError(f"collective on unknown group {instruction.group!r}")
        seq = state.collective_seq.get(group.name, 0)
        state.collective_seq[group.name] = seq + 1
        arrival = self.arrivals.setdefault((group.name, seq), _Arrival(instruction))
        ready = max(state.stream_free(stream), state.stream_free(COMPUTE_STREAM))
        op = _Op(kind=instruction.kind)
        arrival.ready[state.index] = ready
        arrival.ops[state.index] = op
        if instruction.handle:
            state.handles[instruction.handle] = op
        state.pending[stream] = op
        if instruction.blocking:
            state.pending[COMPUTE_STREAM] = op
        if len(arrival.ready) == len(self._participants(group.name)):
            self._resolve_collective(group.name, arrival)
            del self.arrivals[(group.name, seq)]
        return True

    def _participants(self, group_name: str) -> tuple[int, ...]:
        cached = self.participants.get(group_name)
        if cached is None:
            group = self.program.groups[group_name]
            try:
                cached = tuple(sorted({self.class_of_rank[r] for r in group.ranks}))
            except KeyError as missing:
                raise SimulationError(f"group {group_name} has rank {missing} that no instruction list covers") from None
            self.participants[group_name] = cached
        return cached

    def _resolve_collective(self, group_name: str, arrival: _Arrival) -> None:
        instruction = arrival.instruction
        group = self.program.groups[group_name]
        start = max(arrival.ready.values())
        key = (instruction.op, group_name, instruction.bytes)
        one = self.collective_cost.get(key)
        if one is None:
            one = self.collective_cost[key] = self.comm.collective_time(instruction.op, group.ranks,
                                                                        instruction.bytes, group.sharing)
        duration = instruction.count * one
        end = start + duration
        for index, op in arrival.ops.items():
            state = self.states[index]
            op.start, op.end, op.resolved = start, end, True
            op.peer_delayed = start > arrival.ready[index] + EPS
            stream = instruction.stream
            state.spans.append(Span(stream, start, end, f"{instruction.op} {group_name}", f"comm_{instruction.kind}"))
            if state.pending.get(COMPUTE_STREAM) is op:
                # Blocking: the compute stream waits from where it stood when it issued the op.
                del state.pending[COMPUTE_STREAM]
                self._record_wait(state, state.stream_free(COMPUTE_STREAM), op)
            if state.pending.get(stream) is op:
                del state.pending[stream]
            state.free[stream] = end
            self._release(op)

    def _send(self, state: _ClassState, instruction: Send) -> bool:
        stream = instruction.stream
        if self._blocked_on_streams(state, stream, COMPUTE_STREAM):
            return False
        if instruction.key in self.messages:
            raise SimulationError(f"message key {instruction.key!r} sent twice")
        src = state.program.ranks[0]
        start = max(state.stream_free(stream), state.stream_free(COMPUTE_STREAM))
        key = (src, instruction.dst, instruction.bytes, instruction.sharing)
        cost = self.p2p_cost.get(key)
        if cost is None:
            cost = self.p2p_cost[key] = self.comm.p2p_time(src, instruction.dst, instruction.bytes, instruction.sharing)
        end = start + cost
        state.free[stream] = end
        state.spans.append(Span(stream, start, end, f"send {instruction.key}", f"comm_{instruction.kind}"))
        self.messages[instruction.key] = _Op(instruction.kind, start, end, resolved=True)
        for waiter in self.waiting_for_message.pop(instruction.key, []):
            self._wake(waiter)
        return True

    def _recv(self, state: _ClassState, instruction: Recv) -> bool:
        stream = instruction.stream
        needed = (stream, COMPUTE_STREAM) if instruction.blocking else (stream,)
        if self._blocked_on_streams(state, *needed):
            return False
        message = self.messages.get(instruction.key)
        if message is None:
            self.waiting_for_message.setdefault(instruction.key, []).append(state.index)
            return False
        posted = state.stream_free(stream)
        op = _Op(instruction.kind, start=message.start, end=max(posted, message.end), resolved=True, peer_delayed=True)
        state.free[stream] = op.end
        state.spans.append(Span(stream, max(posted, message.start), op.end, f"recv {instruction.key}", f"comm_{instruction.kind}"))
        if instruction.handle:
            state.handles[instruction.handle] = op
        if instruction.blocking:
            self._compute_waits_for(state, op)
        return True

    def _wait(self, state: _ClassState, instruction: Wait) -> bool:
        if self._blocked_on_streams(state, COMPUTE_STREAM):
            return False
        op = state.handles.get(instruction.handle)
        if op is None:
            raise SimulationError(f"wait on unknown handle {instruction.handle!r} in {state.program.label}")
        if not op.resolved:
            self.waiting_for_op.setdefault(id(op), []).append(state.index)
            return False
        self._compute_waits_for(state, op)
        return True

    def _release(self, op: _Op) -> None:
        for waiter in self.waiting_for_op.pop(id(op), []):
            self._wake(waiter)

    # ---- why the compute stream waited --------------------------------------------------
    def _compute_waits_for(self, state: _ClassState, op: _Op) -> None:
        """The compute stream waits until `op` ends (a Wait, or a blocking side-stream op)."""
        self._record_wait(state, state.stream_free(COMPUTE_STREAM), op)

    def _record_wait(self, state: _ClassState, since: float, op: _Op) -> None:
        if op.end <= since:
            state.free[COMPUTE_STREAM] = max(state.stream_free(COMPUTE_STREAM), since)
            return
        transfer_from = max(since, op.start)
        if transfer_from > since:
            state.segments.append((since, transfer_from, PEER_WAIT if op.peer_delayed else f"comm_{op.kind}"))
        state.segments.append((transfer_from, op.end, f"comm_{op.kind}"))
        state.free[COMPUTE_STREAM] = op.end

    # ---- results ------------------------------------------------------------------------
    def _timeline(self) -> Timeline:
        iteration = max((max(s.free.values()) for s in self.states), default=0.0)
        ranks = [RankTimeline(ranks=s.program.ranks, label=s.program.label or f"class {s.index}",
                              units=s.program.units, spans=s.spans,
                              breakdown=self._breakdown(s, iteration), end=max(s.free.values()))
                 for s in self.states]
        return Timeline(iteration_time=iteration, ranks=ranks, backend="sim", events=self.events)

    def _breakdown(self, state: _ClassState, iteration: float) -> dict[str, float]:
        out = {cat: 0.0 for cat in BREAKDOWN_CATEGORIES}
        tail_start = state.stream_free(COMPUTE_STREAM)
        for start, end, category in state.segments:
            if category == PEER_WAIT:
                out[self._bubble_kind(state, start, end)] += end - start
            else:
                out[category] += end - start
        if iteration > tail_start:
            if state.program.pipelined:
                out[self._bubble_kind(state, tail_start, iteration)] += iteration - tail_start
            else:
                out["idle"] += iteration - tail_start
        return out

    @staticmethod
    def _bubble_kind(state: _ClassState, start: float, end: float) -> str:
        """Pipelined ranks: a wait before the first backward is warm-up, one after the last
        forward is cool-down, one that is both (a barrier between the phases) or neither
        is imbalance. Other ranks: every wait on a peer is imbalance."""
        if not state.program.pipelined:
            return "bubble_imbalance"
        before_backward = state.first_backward is None or end <= state.first_backward + EPS
        after_forward = state.last_forward is not None and start >= state.last_forward - EPS
        if before_backward and not after_forward:
            return "bubble_warmup"
        if after_forward and not before_backward:
            return "bubble_cooldown"
        return "bubble_imbalance"


def simulate(program: Program, model: ModelSpec, cluster: ClusterSpec, precision: str) -> Timeline:
    return Simulator(program, model, cluster, precision).run()
