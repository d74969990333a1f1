"""The discrete-event engine: executes a Program against the cost model.

Every rank class runs its instruction list in issue order; each stream executes its
instructions in order; a communication instruction on a side stream starts once the data
it carries is ready on the compute stream and the stream's previous operation is done.
Cross-rank events are a collective (it starts when every participating class has issued
it and is ready) and a message (an eager send; the receive completes when it has
arrived). A class runs until an instruction needs an event that has not happened (a
blocking operation, a Wait, a message not yet sent) and is woken when it happens;
asynchronous operations queue on their stream without stopping the class, so each
instruction is processed once.

Two resources are shared between a rank's streams. Its share of its node's NICs: the
rings of one family that cross a node's NICs at once are already in the group's
bandwidth (Group.sharing); a node-crossing transfer that overlaps one already priced
on another of the rank's streams (DP gradient reduction under the pipeline's sends,
ZeRO-3's reduce-scatters under its parameter gathers) gets half the NICs while they
overlap (two flows sharing a link fairly). And a communication
kernel holds SMs while it runs (ClusterSpec.collective_sm_fraction, p2p_sm_fraction):
compute that overlaps it runs on the rest and takes longer (a collective that the copy
engines move, Collective.sms false, holds none). Both are decided when an
operation is priced, from the operations already priced: one priced later does not
re-time it, so the earlier of two overlapping transfers keeps the whole link, and compute
priced before a collective is (one whose other participants are classes that have not
issued it yet) runs beside it at full speed.

Where devices share a host's cores, the scheduler lets them lag each other: a collective
waits for the expected lag of its slowest member, a message lands late by the expected lag
of its sender, and the step ends when its last rank does, each by the compute done since
the class last synchronized (src/costmodel/comm.py, CommModel.skew).

Why the compute stream waits is recorded as it happens: while the awaited transfer moves
data the wait is exposed communication of its kind; while it waits for a peer to issue it
(or a sender to produce the data) it is a bubble; while it waits behind an earlier
operation on the same stream, the wait is charged to that operation, and so on back.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.models.spec import ModelSpec
from src.cluster import ClusterSpec
from src.collector import collector_paused
from src.progress import Progress
from src.program import (
    COMPUTE_STREAM,
    Collective,
    Compute,
    Group,
    Hop,
    Instruction,
    Message,
    Payload,
    Program,
    RankProgram,
    Recv,
    Route,
    Send,
    Table,
    Wait,
)
from src.sim.cores import MAX_PASSES, SETTLED, ComputeSpan, relaxed, shares_cores, span_scales
from src.sim.intervals import Intervals
from src.timeline import BREAKDOWN_CATEGORIES, BUBBLE_POSITIONS, RankTimeline, Span, Timeline

EPS = 1e-12
PROGRESS_EVENTS = 4096  # instructions between looks at the clock
PEER_WAIT = "peer_wait"
# Two transfers on one link at once each get half of it.
SHARED_LINK_RATE = 0.5


class SimulationError(RuntimeError):
    """A Program that cannot run: a deadlock, a receive with no send, a bad group."""


@dataclass(eq=False, slots=True)
class _Op:
    """A communication operation as one rank class sees it.

    ready: when this class could have started it (its data and its stream were ready);
    start, end: when it really ran (a collective starts when all participants are ready;
    a receive's transfer is the sender's); prev: the operation before it on its stream.
    nic_from: when a send really started, if it shared the node's NICs with another
    transfer and is priced as starting late at the full rate (None otherwise).
    computed: the compute its class had done since it last synchronized (its last
    collective or receive) when it issued this one: how far it may lag its peers.
    copies: the device seconds of copies the compute stream runs once it has waited for it
    (a listed all-gather's: Collective.listed).
    """

    kind: str
    stream: str
    ready: float | None = None
    start: float = 0.0
    end: float = 0.0
    resolved: bool = False
    prev: "_Op | None" = None
    next: "_Op | None" = field(default=None, repr=False)
    compute_ready: float = 0.0
    nic_from: float | None = None
    computed: float = 0.0
    copies: float = 0.0


def _ready(op: _Op) -> float:
    """When an operation could start: known once it was issued behind a resolved one."""
    assert op.ready is not None, "an operation is priced only once its stream is ready"
    return op.ready


@dataclass(slots=True)
class _Arrival:
    """One collective instance: the classes that issued it, and their operations."""

    instruction: Collective
    ops: dict[int, _Op] = field(default_factory=dict)


@dataclass
class _PostedRecv:
    """A receive issued before all its messages were sent (an irecv)."""

    index: int
    op: _Op
    instruction: Recv
    entries: dict[tuple[str, int, Payload], tuple[float, float]]


class _RoutePrices:
    """What a route costs a class, message by message on the links each message crosses.

    A class's Send keeps its send stream busy for the slowest of its ranks: each rank
    sends its messages of the payload one after the other. A class's Recv completes when
    the last message to any of its ranks has arrived: a message arrives when its sender's
    class started the Send, plus the sender's earlier messages of that payload, plus its
    own transfer."""

    def __init__(self, program: Program, comm: CommModel, class_of_rank: dict[int, int]) -> None:
        self.program, self.comm, self.class_of_rank = program, comm, class_of_rank
        self._hop: dict[str, float] = {}
        self._hop_crosses: dict[str, bool] = {}
        self._hop_sender: dict[tuple[str, int], tuple[int, float]] = {}  # (hop, receiving class): (sender class, cost)
        self._send: dict[tuple[str, int, Payload], tuple[float, float, bool]] = {}
        self._recv: dict[tuple[str, int, Payload], dict] = {}
        self._offsets: dict[tuple[str, int, Payload], dict[int, tuple[float, float]]] = {}

    def route(self, name: str) -> Route:
        route = self.program.routes.get(name)
        if route is None:
            raise SimulationError(f"send/receive on unknown route {name!r}")
        return route

    def _cost(self, route: Route, src: int, dst: int, nbytes: float) -> float:
        return self.comm.p2p_time(src, dst, nbytes, route.sharing)

    def _hop_cost(self, route: Hop) -> float:
        cost = self._hop.get(route.name)
        if cost is None:
            # The pairs of a hop move at once; the slowest one bounds the stage. A pair's
            # time depends only on whether it stays on its rank and whether it leaves its
            # node (CommModel.p2p_time): one pair of each kind is priced.
            node_of = self.comm.cluster.node_of
            kinds = {(a == b, node_of(a) != node_of(b)): (a, b) for a, b in zip(route.a, route.b)}
            cost = self._hop[route.name] = max((self._cost(route, a, b, route.bytes) for a, b in kinds.values()), default=0.0)
            self._hop_crosses[route.name] = any(crosses for _, crosses in kinds)
        return cost

    def _sender_class(self, route: Route, rank: int) -> int:
        index = self.class_of_rank.get(rank)
        if index is None:
            raise SimulationError(f"route {route.name} sends from rank {rank}, which no instruction list covers")
        return index

    def send(self, route: Route, state: "_ClassState", payload: Payload) -> tuple[float, float, bool]:
        """(seconds the class's send stream is busy, bytes its ranks put on links, whether
        any of them leaves its node)."""
        ranks = state.program.ranks
        node_of = self.comm.cluster.node_of
        if isinstance(route, Hop):
            return self._hop_cost(route), route.bytes * len(ranks), self._hop_crosses[route.name]
        key = (route.name, state.index, payload)
        cached = self._send.get(key)
        if cached is None:
            per_rank = [route.sends(rank, payload) for rank in ranks]
            seconds = max((sum(self._cost(route, m.src, m.dst, m.bytes) for m in sends) for sends in per_rank), default=0.0)
            nbytes = sum(m.bytes for sends in per_rank for m in sends if m.src != m.dst)
            crosses = any(node_of(m.src) != node_of(m.dst) for sends in per_rank for m in sends)
            cached = self._send[key] = (seconds, nbytes, crosses)
        return cached

    def _landing(self, route: Table, message: Message) -> tuple[float, float]:
        """(when the message lands after its send starts, its own transfer time): a
        sender's messages of one payload leave one after another, in the route's order."""
        key = (route.name, message.src, message.sent.whole)  # the sends() list, computed once
        offsets = self._offsets.get(key)
        if offsets is None:
            offsets, clock = {}, 0.0
            for sent in route.sends(message.src, message.sent):
                cost = self._cost(route, sent.src, sent.dst, sent.bytes)
                clock += cost
                offsets[id(sent)] = (clock, cost)
            self._offsets[key] = offsets
        return offsets[id(message)]

    def receive_entries(
        self, route: Route, state: "_ClassState", payload: Payload
    ) -> dict[tuple[str, int, Payload], tuple[float, float]]:
        """For every send the class waits on, keyed (route, sender class, payload): when
        its last message to the class lands after that send starts, and that message's
        own transfer time."""
        if isinstance(route, Hop):
            sender = self._hop_sender.get((route.name, state.index))
            if sender is None:
                peer = route.peer(state.program.ranks[0])
                sender = self._hop_sender[(route.name, state.index)] = (self._sender_class(route, peer), self._hop_cost(route))
            index, cost = sender
            return {(route.name, index, payload): (cost, cost)}
        key = (route.name, state.index, payload)
        cached = self._recv.get(key)
        if cached is None:
            assert isinstance(route, Table), "a Hop was priced above"
            cached = {}
            for rank in state.program.ranks:
                for message in route.receives(rank, payload):
                    offset, cost = self._landing(route, message)
                    send_key = (route.name, self._sender_class(route, message.src), message.sent.whole)
                    if offset >= cached.get(send_key, (-1.0, 0.0))[0]:
                        cached[send_key] = (offset, cost)
            if not cached:
                raise SimulationError(
                    f"{state.program.label or state.index} receives {payload} over route "
                    f"{route.name}, which sends none of its ranks anything of it"
                )
            self._recv[key] = cached
        return cached


@dataclass(slots=True)
class _ClassState:
    index: int
    program: RankProgram
    instructions: list[Instruction]
    ip: int = 0
    free: dict[str, float] = field(default_factory=lambda: {COMPUTE_STREAM: 0.0})
    tail: dict[str, _Op] = field(default_factory=dict)
    blocker: _Op | None = None
    handles: dict[str, _Op] = field(default_factory=dict)
    collective_seq: dict[str, int] = field(default_factory=dict)
    segments: list[tuple[float, float, str]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    first_backward: float | None = None
    last_forward: float | None = None
    # The start of its first forward or backward and the end of its last.
    first_pass: float | None = None
    last_pass: float = 0.0
    queued: bool = False
    # The rank's share of its node's NICs (node-crossing transfers); SMs held by
    # collectives and by sends/receives.
    nic: Intervals = field(default_factory=Intervals)
    collective_busy: Intervals = field(default_factory=Intervals)
    p2p_busy: Intervals = field(default_factory=Intervals)
    # How many of the class's ranks each node holds (node, ranks): where cores are shared.
    per_node: tuple[tuple[int, int], ...] = ()
    # Compute seconds since the class last synchronized (a collective or a receive
    # resolved): how far it may lag its peers where devices share cores.
    computed: float = 0.0

    def stream_free(self, stream: str) -> float:
        return self.free.get(stream, 0.0)

    def last_on(self, stream: str) -> _Op | None:
        return self.tail.get(stream)


class Simulator:
    def __init__(
        self,
        program: Program,
        model: ModelSpec,
        cluster: ClusterSpec,
        precision: str,
        compute: ComputeModel | None = None,
        compute_scale: Mapping[tuple[int, int], float] | None = None,
    ):
        """`compute_scale`: a factor on the price of compute instructions, keyed (rank
        class, instruction index): the share of shared cores each got (src.sim.cores)."""
        self.program = program
        self.compute_scale = compute_scale or {}
        self.compute_spans: list[ComputeSpan] = []
        self.model = model
        self.cluster = cluster
        self.compute = compute or ComputeModel(cluster, precision)
        self.comm = CommModel(cluster)
        self.states = [_ClassState(i, rp, rp.instructions) for i, rp in enumerate(program.classes)]
        self.class_of_rank: dict[int, int] = {}
        for state in self.states:
            for rank in state.program.ranks:
                if rank in self.class_of_rank:
                    raise SimulationError(f"rank {rank} appears in two instruction lists")
                self.class_of_rank[rank] = state.index
        self.participants: dict[str, tuple[int, ...]] = {}
        self.arrivals: dict[tuple[str, int], _Arrival] = {}
        self.arrival_of: dict[int, tuple[str, int]] = {}
        # Point-to-point traffic, keyed (route, sender class, sender's payload).
        self.sent: dict[tuple[str, int, Payload], _Op] = {}
        self.received: set[tuple[str, int, Payload]] = set()
        self.posted_recvs: dict[tuple[str, int, Payload], _PostedRecv] = {}
        # The posted receives by a send each still waits on (as they were posted).
        self.posted_on: dict[tuple[str, int, Payload], list[tuple[str, int, Payload]]] = {}
        self.waiting_for_send: dict[tuple[str, int, Payload], list[int]] = {}
        # Rendezvous sends (Send.rendezvous), keyed as `sent`: when the receiver posted the
        # matching receive, and the senders waiting for it to.
        self.recv_posted: dict[tuple[str, int, Payload], float] = {}
        self.waiting_for_post: dict[tuple[str, int, Payload], list[int]] = {}
        self.waiting_for_op: dict[int, list[int]] = {}
        self.ready: deque[int] = deque()
        self.collective_cost: dict[tuple, tuple[float, float]] = {}
        self.crosses_nodes: dict[str, bool] = {}
        self.collective_rate = 1.0 - cluster.collective_sm_fraction
        self.p2p_rate = 1.0 - cluster.p2p_sm_fraction
        self.routes = _RoutePrices(program, self.comm, self.class_of_rank)
        self.events = 0
        self.p2p_bytes = 0.0
        self.total_events = sum(len(state.instructions) for state in self.states)
        self.progress = Progress("simulation")
        self.cores_shared = shares_cores(cluster)
        if self.cores_shared:
            for state in self.states:
                nodes = [cluster.node_of(r) for r in state.program.ranks]
                state.per_node = tuple((node, nodes.count(node)) for node in sorted(set(nodes)))

    # ---- driver -------------------------------------------------------------------------
    def run(self) -> Timeline:
        for state in self.states:
            self._wake(state.index)
        while self.ready:
            index = self.ready.popleft()
            state = self.states[index]
            state.queued = False
            instructions, step = state.instructions, self._step
            while state.ip < len(instructions):
                if not step(state, instructions[state.ip]):
                    break
                state.ip += 1
                self.events += 1
                if self.events % PROGRESS_EVENTS == 0 and self.progress.due():
                    self.progress.show(f"{self.events}/{self.total_events} instructions")
            if state.ip == len(state.instructions) and state.blocker is not None:
                self._flush_blocker(state)
        self._check_finished()
        self.progress.end(f"done: {self.events} instructions")
        timeline = self._timeline()
        self._unlink_streams()
        return timeline

    def _unlink_streams(self) -> None:
        """A stream's operations link both ways (prev, next): cycles only the cyclic
        collector frees, 10^5 of them on a large Program, walked again by its first pass.
        Unlinked once the run is priced, reference counting frees them."""
        for state in self.states:
            for last in state.tail.values():
                op: _Op | None = last
                while op is not None:
                    op.next, op.prev, op = None, None, op.prev

    def _check_finished(self) -> None:
        stuck = [s for s in self.states if s.ip < len(s.instructions)]
        if stuck:
            details = "; ".join(f"{s.program.label or s.index} at #{s.ip} {s.instructions[s.ip]!r}" for s in stuck[:4])
            raise SimulationError(f"deadlock: {len(stuck)} rank classes cannot proceed: {details}")
        if self.arrivals:
            (group, seq), arrival = next(iter(self.arrivals.items()))
            missing = sorted(set(self._participants(group)) - set(arrival.ops))
            labels = [self.states[i].program.label or str(i) for i in missing]
            raise SimulationError(
                f"{len(self.arrivals)} collectives never completed: {arrival.instruction.op} "
                f"#{seq} on group {group} was never issued by {labels}"
            )
        if self.posted_recvs:
            keys = [f"{payload} over {route}" for route, _, payload in list(self.posted_recvs)[:4]]
            raise SimulationError(f"receives with no matching send: {keys}")
        unreceived = self._unreceived()
        if unreceived:
            raise SimulationError(f"{len(unreceived)} sends never received: {unreceived[:4]}")

    def _unreceived(self) -> list[str]:
        """Sends with a message to a class that never received that payload."""
        out = []
        for route_name, index, payload in self.sent:
            route = self.program.routes[route_name]
            senders = self.states[index].program.ranks
            if isinstance(route, Hop):
                # A hop's message carries the payload (or a part of it) to one peer class.
                peer = route.peer(senders[0])
                if (route_name, self.class_of_rank.get(peer), payload) not in self.received:
                    out.append(f"{payload} from rank {senders[0]} to rank {peer} over {route_name}")
                continue
            for rank in senders:
                for message in route.sends(rank, payload):
                    receiver = self.class_of_rank.get(message.dst)
                    if (route_name, receiver, message.received.whole) not in self.received:
                        out.append(f"{payload} from rank {rank} to rank {message.dst} over {route_name}")
                        break
        return out

    def _wake(self, index: int) -> None:
        state = self.states[index]
        if not state.queued:
            state.queued = True
            self.ready.append(index)

    def _wait_on(self, op: _Op, state: _ClassState) -> bool:
        self.waiting_for_op.setdefault(id(op), []).append(state.index)
        return False

    # ---- one instruction ----------------------------------------------------------------
    def _flush_blocker(self, state: _ClassState) -> bool:
        """The compute stream waits for the blocking operation it issued last; False if
        that operation has not happened yet."""
        blocker = state.blocker
        assert blocker is not None
        if not blocker.resolved:
            return self._wait_on(blocker, state)
        state.blocker = None
        self._record_wait(state, state.stream_free(COMPUTE_STREAM), blocker)
        if blocker.copies:
            # A listed all-gather's copies run once it has landed, before the work that waits for it.
            start = state.stream_free(COMPUTE_STREAM)
            end = self._device_end(state, start, blocker.copies)
            self._occupy_compute(state, Span(COMPUTE_STREAM, start, end, "copy out and concatenate", "compute"))
        return True

    def _step(self, state: _ClassState, instruction: Instruction) -> bool:
        """Execute one instruction; False if it must wait for another class."""
        if state.blocker is not None and not self._flush_blocker(state):
            return False
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

    def _compute(self, state: _ClassState, instruction: Compute) -> bool:
        work = instruction.work
        start = state.stream_free(COMPUTE_STREAM)
        seconds = self.compute.work_time(work, self.model)
        if self.compute_scale:  # shared cores (src.sim.cores): this span's share
            seconds *= self.compute_scale.get((state.index, state.ip), 1.0)
        end = self._device_end(state, start, seconds)
        if self.cores_shared:
            self.compute_spans.append(ComputeSpan((state.index, state.ip), start, end, state.per_node))
        name = f"{work.phase} {work.unit} L{work.layers[0]}-{work.layers[1]}"
        self._occupy_compute(state, Span(COMPUTE_STREAM, start, end, name, "compute", work.unit, instruction.microbatch))
        if work.phase in ("bwd", "bwd_input", "bwd_weight", "interaction") and state.first_backward is None:
            state.first_backward = start
        if work.phase in ("fwd", "interaction"):
            state.last_forward = end
        if work.phase != "optimizer":
            if state.first_pass is None:
                state.first_pass = start
            state.last_pass = end
        return True

    def _device_end(self, state: _ClassState, start: float, seconds: float) -> float:
        """When `seconds` of device work on the compute stream from `start` end, slowed where
        collectives or transfers hold SMs."""
        end = start + seconds
        if self.collective_rate < 1.0:
            end = state.collective_busy.stretched_end(start, end - start, self.collective_rate)
        if self.p2p_rate < 1.0:
            end = state.p2p_busy.stretched_end(start, end - start, self.p2p_rate)
        return end

    @staticmethod
    def _occupy_compute(state: _ClassState, span: Span) -> None:
        """The compute stream busy computing over `span`."""
        state.free[COMPUTE_STREAM] = span.end
        state.computed += span.end - span.start
        state.segments.append((span.start, span.end, "compute"))
        state.spans.append(span)

    def _issue(self, state: _ClassState, kind: str, stream: str) -> _Op:
        """A new operation on `stream`, queued behind the stream's previous operation."""
        compute_ready = state.stream_free(COMPUTE_STREAM)
        op = _Op(kind=kind, stream=stream, compute_ready=compute_ready)
        if stream != COMPUTE_STREAM:
            op.prev = state.last_on(stream)
            if op.prev is not None:
                op.prev.next = op
            if op.prev is None or op.prev.resolved:
                op.ready = max(compute_ready, state.stream_free(stream))
        else:
            op.ready = compute_ready
        state.tail[stream] = op
        return op

    def _collective(self, state: _ClassState, instruction: Collective) -> bool:
        group = self.program.groups.get(instruction.group)
        if group is None:
            raise SimulationError(f"collective on unknown group {instruction.group!r}")
        seq = state.collective_seq.get(group.name, 0)
        state.collective_seq[group.name] = seq + 1
        key = (group.name, seq)
        arrival = self.arrivals.get(key)
        if arrival is None:
            arrival = self.arrivals[key] = _Arrival(instruction)
        elif (arrival.instruction.op, arrival.instruction.bytes, arrival.instruction.count) != (
            instruction.op,
            instruction.bytes,
            instruction.count,
        ):
            first = arrival.instruction
            raise SimulationError(
                f"collective #{seq} on group {group.name} does not match across ranks: "
                f"{first.op} of {first.bytes:g} B x{first.count} vs {instruction.op} of "
                f"{instruction.bytes:g} B x{instruction.count} ({state.program.label})"
            )
        op = self._issue(state, instruction.kind, instruction.stream)
        op.computed = state.computed
        if instruction.listed:
            op.copies = self.compute.listed_gather_copies(instruction.bytes, len(group.ranks))
        arrival.ops[state.index] = op
        self.arrival_of[id(op)] = key
        if instruction.handle:
            state.handles[instruction.handle] = op
        if instruction.blocking or instruction.stream == COMPUTE_STREAM:
            state.blocker = op
        elif instruction.beside:
            self._outlasting(state, instruction, group)
        self._try_resolve(key)
        return True

    def _parts(self, instruction: Collective, group: Group) -> tuple[float, float]:
        """(latency, transfer) seconds of one of the instruction's collectives on its group."""
        rows = instruction.op == "all_to_all" and bool(instruction.inputs or instruction.outputs)
        cost_key = (instruction.op, group.name, instruction.bytes, rows)
        parts = self.collective_cost.get(cost_key)
        if parts is None:
            # An all-to-all carrying rows (a batch-sync) runs as the real backend runs it:
            # the group's row layout gathered first, then the padded pieces swapped.
            price = self.comm.row_exchange_parts if rows else functools.partial(self.comm.collective_parts, instruction.op)
            parts = self.collective_cost[cost_key] = price(group.ranks, instruction.bytes, group.sharing)
        return parts

    def _outlasting(self, state: _ClassState, instruction: Collective, group: Group) -> None:
        """A transfer paired with GEMM chunks (Collective.beside) holds the compute stream
        back by what of it each product's chunk does not cover, on each of its `count`
        layers: exposed communication of its kind, where the stream stands now."""
        latency, transfer = self._parts(instruction, group)
        exposed = instruction.count * self.compute.outlasting(latency + transfer, instruction.beside, self.model)
        if exposed <= 0.0:
            return
        start = state.stream_free(COMPUTE_STREAM)
        end = state.free[COMPUTE_STREAM] = start + exposed
        category = f"comm_{instruction.kind}"
        state.segments.append((start, end, category))
        state.spans.append(Span(COMPUTE_STREAM, start, end, f"{instruction.op} {group.name} beyond its GEMM", category))

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

    def _try_resolve(self, key: tuple[str, int]) -> None:
        """Resolve a collective once every participant issued it and is ready."""
        arrival = self.arrivals.get(key)
        if arrival is None or len(arrival.ops) < len(self._participants(key[0])):
            return
        start = computed = 0.0  # when the last member is ready; the most compute one did since it synchronized
        for op in arrival.ops.values():
            ready = op.ready
            if ready is None:
                assert op.prev is not None, "an operation without a predecessor is ready when issued"
                if not op.prev.resolved:
                    return
                ready = op.ready = max(op.compute_ready, op.prev.end)
            if ready > start:
                start = ready
            if op.computed > computed:
                computed = op.computed
        del self.arrivals[key]
        for op in arrival.ops.values():
            del self.arrival_of[id(op)]
        instruction = arrival.instruction
        group = self.program.groups[key[0]]
        parts = self._parts(instruction, group)
        latency, transfer = parts[0] * instruction.count, parts[1] * instruction.count
        # Its members reach it as far apart as they drifted since they last synchronized;
        # the wait is the collective's. A count stands for collectives spread over that
        # compute (the layers priced as one instruction): count waits, each after its share.
        latency += instruction.count * self.comm.skew(len(group.ranks), computed / instruction.count)
        crosses = self.crosses_nodes.get(group.name)
        if crosses is None:
            crosses = self.crosses_nodes[group.name] = self.cluster.spans_nodes(group.ranks)
        states = [self.states[index] for index in arrival.ops]
        moved = start + transfer
        if crosses and transfer > 0:
            moved = max(state.nic.stretched_end(start, transfer, SHARED_LINK_RATE) for state in states)
        end = moved + latency
        name, category = f"{instruction.op} {group.name}", f"comm_{instruction.kind}"
        for state, op in zip(states, arrival.ops.values()):
            op.start, op.end, op.resolved = start, end, True
            state.computed = max(0.0, state.computed - op.computed)
            if crosses and transfer > 0:
                state.nic.add(start, moved)
            if op.stream != COMPUTE_STREAM and instruction.sms:
                state.collective_busy.add(start, end)
            self._advance_stream(state, op)
            state.spans.append(Span(op.stream, start, end, name, category))
            self._release(op)

    @staticmethod
    def _advance_stream(state: _ClassState, op: _Op) -> None:
        """A side stream is busy until its operation ends. The compute stream is advanced
        by the wait that blocks on the operation, which also says why it waited."""
        if op.stream != COMPUTE_STREAM:
            state.free[op.stream] = max(state.stream_free(op.stream), op.end)

    def _release(self, op: _Op) -> None:
        for waiter in self.waiting_for_op.pop(id(op), []):
            self._wake(waiter)
        # A collective queued behind this operation on its stream may now be ready.
        queued = op.next
        if queued is not None and id(queued) in self.arrival_of:
            self._try_resolve(self.arrival_of[id(queued)])

    def _send(self, state: _ClassState, instruction: Send) -> bool:
        stream = instruction.stream
        last = state.last_on(stream)
        if last is not None and not last.resolved:
            return self._wait_on(last, state)
        route = self.routes.route(instruction.route)
        payload = instruction.payload.whole
        key = (route.name, state.index, payload)
        if key in self.sent:
            raise SimulationError(f"{state.program.label} sends {instruction.payload} over {route.name} twice")
        receiver_at = 0.0
        if instruction.rendezvous:
            if not isinstance(route, Hop):
                raise SimulationError(f"a rendezvous send needs a Hop route; {route.name} is not one")
            if key not in self.recv_posted:
                self.waiting_for_post.setdefault(key, []).append(state.index)
                return False
            receiver_at = self.recv_posted.pop(key)
        op = self._issue(state, route.kind, stream)
        op.computed = state.computed
        issued = _ready(op)
        ready = max(issued, receiver_at)
        if ready > issued and stream == COMPUTE_STREAM:
            state.segments.append((issued, ready, PEER_WAIT))  # the receiver is not there yet
        seconds, nbytes, crosses = self.routes.send(route, state, payload)
        op.start, op.end, op.resolved = ready, ready + seconds, True
        if crosses and seconds > 0:
            op.end = state.nic.stretched_end(ready, seconds, SHARED_LINK_RATE)
            state.nic.add(ready, op.end)
            # Its messages land as if it had started late at the full rate: its last
            # one lands when it ends.
            op.start = op.end - seconds
            if op.start > ready:
                op.nic_from = ready
        state.p2p_busy.add(ready, op.end)
        self.p2p_bytes += nbytes
        state.free[stream] = op.end
        state.spans.append(Span(stream, op.start, op.end, f"send {instruction.payload}", f"comm_{route.kind}"))
        if stream == COMPUTE_STREAM:
            state.segments.append((ready, op.end, f"comm_{route.kind}"))
        self.sent[key] = op
        for waiter in self.waiting_for_send.pop(key, []):
            self._wake(waiter)
        for recv_key in self.posted_on.pop(key, ()):
            posted = self.posted_recvs[recv_key]
            if all(k in self.sent for k in posted.entries):
                del self.posted_recvs[recv_key]
                self._complete_recv(self.states[posted.index], posted.op, posted.instruction, posted.entries)
        return True

    def _recv(self, state: _ClassState, instruction: Recv) -> bool:
        stream = instruction.stream
        last = state.last_on(stream)
        if last is not None and not last.resolved:
            return self._wait_on(last, state)
        route = self.routes.route(instruction.route)
        payload = instruction.payload.whole
        entries = self.routes.receive_entries(route, state, payload)
        missing = [key for key in entries if key not in self.sent]
        blocking = instruction.blocking or stream == COMPUTE_STREAM
        if missing and blocking:
            self._post(missing, max(state.stream_free(COMPUTE_STREAM), state.stream_free(stream)))
            self.waiting_for_send.setdefault(missing[0], []).append(state.index)
            return False
        recv_key = (route.name, state.index, payload)
        if recv_key in self.received or recv_key in self.posted_recvs:
            raise SimulationError(f"{state.program.label} receives {payload} over {route.name} twice")
        op = self._issue(state, route.kind, stream)
        op.computed = state.computed
        if instruction.handle:
            state.handles[instruction.handle] = op
        if missing:
            # Posted before its sends (an irecv): it completes when the last one lands.
            self._post(missing, _ready(op))
            self.posted_recvs[recv_key] = _PostedRecv(state.index, op, instruction, entries)
            for key in missing:
                self.posted_on.setdefault(key, []).append(recv_key)
            return True
        self._complete_recv(state, op, instruction, entries)
        if blocking:
            state.blocker = op
        return True

    def _post(self, missing: list[tuple[str, int, Payload]], at: float) -> None:
        """A blocking receive waits at `at` for the sends `missing`: a rendezvous send
        among them may now start (once; a receive retried after a wake posts nothing new)."""
        for key in missing:
            if key not in self.recv_posted:
                self.recv_posted[key] = at
                for waiter in self.waiting_for_post.pop(key, []):
                    self._wake(waiter)

    def _complete_recv(
        self, state: _ClassState, op: _Op, recv: Recv, entries: dict[tuple[str, int, Payload], tuple[float, float]]
    ) -> None:
        """The receive ends when its last message lands; that message's transfer is the
        communication, the wait before it is the sender's (a bubble). Where devices share
        cores, the sender may lag the receiver: the message lands the later by the
        expected lag of the pair."""
        self.received.add((recv.route, state.index, recv.payload.whole))
        land, cost, sender_computed = max(
            (self.sent[key].start + offset, cost, self.sent[key].computed) for key, (offset, cost) in entries.items()
        )
        land += self.comm.skew(2, max(op.computed, sender_computed))
        ready = _ready(op)
        op.start, op.end, op.resolved = land - cost, max(ready, land), True
        state.computed = max(0.0, state.computed - op.computed)
        state.p2p_busy.add(max(ready, op.start), op.end)
        self._advance_stream(state, op)
        state.spans.append(Span(op.stream, max(ready, op.start), op.end, f"recv {recv.payload}", f"comm_{op.kind}"))
        self._release(op)

    def _wait(self, state: _ClassState, instruction: Wait) -> bool:
        op = state.handles.get(instruction.handle)
        if op is None:
            raise SimulationError(f"wait on unknown handle {instruction.handle!r} in {state.program.label}")
        if not op.resolved:
            return self._wait_on(op, state)
        self._record_wait(state, state.stream_free(COMPUTE_STREAM), op)
        return True

    # ---- why the compute stream waited --------------------------------------------------
    def _record_wait(self, state: _ClassState, since: float, op: _Op) -> None:
        """The compute stream, free since `since`, waits until `op` ends. Walk back along
        the stream's queue: the transfer of each operation is communication of its kind,
        its wait for peers a bubble, its wait for the previous operation that operation's."""
        until = op.end
        current: _Op | None = op
        while current is not None and until > since + EPS:
            transfer_from = max(since, current.start)
            if until > transfer_from:
                state.segments.append((transfer_from, until, f"comm_{current.kind}"))
            until = min(until, current.start)
            if until <= since:
                break
            if current.nic_from is not None and until > max(since, current.nic_from):
                # Sharing the NICs with another family's transfer: communication.
                state.segments.append((max(since, current.nic_from), until, f"comm_{current.kind}"))
                until = max(since, current.nic_from)
                if until <= since:
                    break
            ready = current.ready if current.ready is not None else since
            peer_from = max(since, ready)
            if until > peer_from:
                state.segments.append((peer_from, until, PEER_WAIT))
            until = min(until, ready)
            current = current.prev
        if until > since + EPS:
            state.segments.append((since, until, f"comm_{op.kind}"))
        state.free[COMPUTE_STREAM] = max(since, op.end)

    # ---- results ------------------------------------------------------------------------
    def _timeline(self) -> Timeline:
        # A step ends when every rank has (the real backend times it between barriers): the
        # last ranks to finish may lag by the compute since they last synchronized.
        world = self.program.world_size
        iteration = max((max(s.free.values()) + self.comm.skew(world, s.computed) for s in self.states), default=0.0)
        ranks = [
            RankTimeline(
                ranks=s.program.ranks,
                label=s.program.label or f"class {s.index}",
                units=s.program.units,
                spans=s.spans,
                breakdown=self._breakdown(s, iteration),
                end=max(s.free.values()),
                bubble_positions=self._bubble_positions(s, iteration),
            )
            for s in self.states
        ]
        return Timeline(iteration_time=iteration, ranks=ranks, backend="sim", events=self.events, p2p_bytes=self.p2p_bytes)

    def _breakdown(self, state: _ClassState, iteration: float) -> dict[str, float]:
        out = {cat: 0.0 for cat in BREAKDOWN_CATEGORIES}
        for start, end, category in state.segments:
            if category != PEER_WAIT:
                out[category] += end - start
        for start, end in self._bubbles(state, iteration):
            out[self._bubble_kind(state, start, end)] += end - start
        tail_start = state.stream_free(COMPUTE_STREAM)
        if not state.program.pipelined and iteration > tail_start:
            out["idle"] += iteration - tail_start
        return out

    @staticmethod
    def _bubbles(state: _ClassState, iteration: float) -> list[tuple[float, float]]:
        """A rank's waits on its peers and, on a pipelined rank, its tail until the step
        ends (on others the tail is idle)."""
        waits = [(start, end) for start, end, category in state.segments if category == PEER_WAIT]
        tail_start = state.stream_free(COMPUTE_STREAM)
        if state.program.pipelined and iteration > tail_start:
            waits.append((tail_start, iteration))
        return waits

    @classmethod
    def _bubble_positions(cls, state: _ClassState, iteration: float) -> dict[str, float]:
        """The bubbles of _breakdown by where they fall: before the rank's first forward
        or backward, after its last, or between."""
        out = dict.fromkeys(BUBBLE_POSITIONS, 0.0)
        first = state.first_pass if state.first_pass is not None else math.inf
        for start, end in cls._bubbles(state, iteration):
            if end <= first + EPS:
                out["leading"] += end - start
            elif start >= state.last_pass - EPS:
                out["trailing"] += end - start
            else:
                out["inner"] += end - start
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


def simulate(
    program: Program, model: ModelSpec, cluster: ClusterSpec, precision: str, compute: ComputeModel | None = None
) -> Timeline:
    """Simulate one iteration. Pass a ComputeModel to share its price cache across the
    many Programs of a planner's search. Devices that share a host's cores are simulated
    again until each compute span runs at the share its node's other work left it
    (src.sim.cores)."""
    with collector_paused():
        return _simulate(program, model, cluster, precision, compute)


def _simulate(program: Program, model: ModelSpec, cluster: ClusterSpec, precision: str, compute: ComputeModel | None) -> Timeline:
    simulator = Simulator(program, model, cluster, precision, compute)
    timeline = simulator.run()
    if not simulator.cores_shared:
        return timeline
    scales: dict[tuple[int, int], float] = {}
    for _ in range(MAX_PASSES - 1):
        scales = relaxed(scales, span_scales(cluster, simulator.compute_spans))
        simulator = Simulator(program, model, cluster, precision, simulator.compute, scales)
        settled, timeline = timeline, simulator.run()
        if abs(timeline.iteration_time - settled.iteration_time) <= SETTLED * settled.iteration_time:
            break
    return timeline


def compute_lower_bound(program: Program, model: ModelSpec, compute: ComputeModel) -> float:
    """No rank can finish before its compute stream has run all its work: the busiest
    rank's compute time bounds the iteration time from below, with compute priced at every
    device's share (where devices share cores, times speedup_limit of src.sim.cores)."""
    busiest = 0.0
    for rank_program in program.classes:
        total = 0.0
        for instruction in rank_program.instructions:
            if isinstance(instruction, Compute):
                total += compute.work_time(instruction.work, model)
        busiest = max(busiest, total)
    return busiest
