"""The one instruction set: what a strategy emits and both backends execute.

A Program gives every rank an ordered instruction list. Ranks that are interchangeable by
symmetry (the TP peers and DP replicas of one pipeline stage, say) share one list: a
RankProgram covers a class of ranks. Every name in a list is the same on every rank of
its class: payloads are named in the rank's own micro-batch numbering, collectives name a
group whose family holds each rank's own member, and Send/Recv name a route whose table
says, for every rank, which rows go to which rank. So the simulator prices GPT-175B on
3072 GPUs by running 8 classes, and the runtime runs each rank's list as written.

Data flow is explicit. A Compute names the payloads it consumes and produces; a Send or
Recv names the payload it moves over a route (runtime and simulator never infer what
travels from instruction order). A Collective without payloads is one that the runtime
performs inside the preceding Compute's parallel layers (tp) or inside the optimizer
engine (dp): its time is priced here and measured there.

Streams: every rank has a `compute` stream and any number of communication streams,
each executing its instructions in issue order. A communication instruction issued on a
side stream starts after everything issued before it on the compute stream (the data it
sends was produced there). `blocking=True` makes the compute stream wait for the
operation; otherwise it returns a handle that a later Wait consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Union

from src.data.balance import Balancing
from src.data.disaggregated import Reordering
from src.mesh import ROWS, Mesh, Sharding

Phase = Literal["fwd", "bwd", "bwd_input", "bwd_weight", "optimizer", "interaction"]
CommKind = Literal["tp", "pp", "dp", "interaction", "broker"]
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
COMM_KINDS: tuple[str, ...] = ("tp", "pp", "dp", "interaction", "broker")
COMPUTE_STREAM = "compute"
RECOMPUTE_MODES = ("none", "selective", "full")
PARAM_GATHERS = ("step_end", "overlapped")  # UnitPlan.param_gather
# DeepSpeed's default stage3_param_persistence_threshold (elements).
DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000

# The instruction types (Payload, Work, the five instructions, Message) are hashed by value
# but not frozen: a frozen dataclass sets each field through object.__setattr__, which makes
# building one about four times slower, and a 1024-GPU plan builds about a million of them.
# Nothing changes one once built: rank classes share them.


@dataclass(unsafe_hash=True, slots=True)
class Payload:
    """A tensor one rank holds during a step, named the same on every rank of its class.

    unit, layer: the tensor at layer boundary `layer` of `unit` (0: what enters its first
    layer, num_layers: what leaves its last). tensor: which one ('x' token states,
    'feature' the pooled embedding, 'tokens' final states another unit reads). microbatch:
    in the numbering of the holder's Work that produces or consumes it (an interaction
    unit numbers its contrastive batches). grad: its gradient. rows: [start, end) of its
    samples, or None for all of them.
    """

    unit: str
    layer: int
    microbatch: int
    tensor: str = "x"
    grad: bool = False
    rows: tuple[int, int] | None = None

    # Built field by field, not with dataclasses.replace: routes of a large batch-sync
    # derive millions of these, and replace() is several times slower.
    @property
    def whole(self) -> Payload:
        return self if self.rows is None else Payload(self.unit, self.layer, self.microbatch, self.tensor, self.grad)

    def gradient(self) -> Payload:
        return Payload(self.unit, self.layer, self.microbatch, self.tensor, True, self.rows)

    def value(self) -> Payload:
        """The tensor whose gradient this is (itself if it is no gradient)."""
        return Payload(self.unit, self.layer, self.microbatch, self.tensor)

    def part(self, start: int, end: int) -> Payload:
        return Payload(self.unit, self.layer, self.microbatch, self.tensor, self.grad, (start, end))

    def __str__(self) -> str:
        rows = "" if self.rows is None else f"[{self.rows[0]}:{self.rows[1]}]"
        return f"{'d' if self.grad else ''}{self.unit}.{self.tensor}@{self.layer}.mb{self.microbatch}{rows}"


@dataclass(unsafe_hash=True, slots=True)
class Work:
    """A piece of one unit's computation for one micro-batch on one device.

    layers: [start, end) of the unit's layers. kernels: optionally a [start, end) range of
    kernels of layer `layers[0]` only (kernel-granular placement, e.g. Optimus).
    phase: fwd; bwd (input and weight gradients; preceded by re-running the forward, or
    only its attention core, when recompute is 'full' or 'selective'); bwd_input /
    bwd_weight separately; optimizer (the update of the layers' local parameter shard,
    `shard` = how many ranks share the optimizer state, `grad_shard` how many their
    gradients: ZeRO-2/3's partitions);
    interaction (forward + backward of an interaction unit on a gathered batch).
    sharding: how the layers' tensors are split over this device's tensor-parallel axes.
    load: relative size of this micro-batch's input against the nominal sample (data
    heterogeneity); time and FLOPs scale with it.
    fraction: the part of its GEMM rows this work runs: one of n chunks of a pass, for
    overlap; or a replicated unit's share of a micro-batch that is no whole number of
    samples (a sequence's images split over the ranks).
    chunks: n where the work is one of a pass's n row chunks that overlap its GEMMs with
    their TP collectives (DistTrain's StepCCL): the framework still issues the pass once,
    so a chunk carries 1/n of the pass's kernel launches on the host, but each GEMM paired
    with a collective launches once per chunk.
    fetches, fetched: ZeRO-3's module fetches that the framework's hooks make to run this
    work (each gathers a module's parameters: the host's part of it, beside the plan's
    all-gather that moves them) and the parameters they fetch, this rank's TP share.
    fetch_blocking: the fetches wait for their gathers (none prefetched), so the device has
    nothing of this work queued while the hooks run: their host time precedes its kernels.
    fetch_copies: each fetch gathers into a zero-filled buffer through a list of the group's
    partitions, which the collective's flat buffer is copied out to one by one (DeepSpeed
    before 0.5.5 over PyTorch's list all_gather): that many copies a fetch; 0: none.
    scatters, scattered, scatter_copies: the gradient reduce-scatters that follow this work
    through a list of the group's partitions (DeepSpeed before 0.6.0 over PyTorch's list
    reduce_scatter, one per trained tensor), the parameters they reduce, and the copies each
    makes flattening its list into the collective's buffer; 0: none.
    """

    unit: str
    phase: Phase
    samples: int
    layers: tuple[int, int]
    sharding: Sharding = Sharding()
    recompute: str = "none"
    contrastive_batch: int = 1
    kernels: tuple[int, int] | None = None
    fraction: float = 1.0
    load: float = 1.0
    chunks: int = 1
    shard: int = 1
    grad_shard: int = 1
    fetches: int = 0
    fetched: float = 0.0
    fetch_blocking: bool = False
    fetch_copies: int = 0
    scatters: int = 0
    scattered: float = 0.0
    scatter_copies: int = 0


@dataclass(unsafe_hash=True, slots=True)
class Compute:
    work: Work
    microbatch: int = 0
    chunk: int = 0
    inputs: tuple[Payload, ...] = ()
    outputs: tuple[Payload, ...] = ()


@dataclass(unsafe_hash=True, slots=True)
class Collective:
    """A collective over a named group. `bytes` is each rank's full buffer: the tensor
    reduced (all_reduce), the gathered output (all_gather) or the input to scatter
    (reduce_scatter). `count` repeats it back to back (e.g. the TP all-reduces of many
    layers priced as one instruction). `inputs`/`outputs`: the payloads it carries, when
    it moves model tensors between instructions (a batch's features gathered for a
    contrastive loss); without them it is a layer's (tp) or the optimizer's (dp) own.
    `grads_of`: the (unit, [start, end) layers) whose parameter gradients a DP reduction
    reduces, where the plan reduces them itself during the backward (Megatron-LM's
    overlapped buckets) rather than all at once in the optimizer's step; on a reduce-scatter
    or all-gather, the layers whose gradients and parameters the plan's distributed
    optimizer (ZeRO-1) moves where the plan places it (Optimus's LLM).
    `sms`: its kernels hold SMs while it runs (NCCL's), so compute beside it is slower;
    False where the GPU's copy engines move the data (DistTrain's StepCCL, §7).
    `beside`: an asynchronous transfer paired with GEMMs (StepCCL's pairs, emit's
    overlapped pass): the chunk of each product it runs beside, on one of the `count`
    layers, the transfer split evenly among them. Each pair runs in lock step, so what of a
    transfer outlasts its product holds the compute stream back by that much.
    `listed`: a blocking all-gather into a list of the group's parts, concatenated after it
    (AxoNN's on-the-spot weight gather: PyTorch's list all_gather copies its flat buffer out
    to each part, then `torch.cat` copies the parts into one tensor): the rank's device
    copies the gathered bytes twice before the work that waits for it runs."""

    op: CollectiveOp
    group: str
    bytes: float
    kind: CommKind
    stream: str = "comm"
    blocking: bool = True
    handle: str | None = None
    count: int = 1
    inputs: tuple[Payload, ...] = ()
    outputs: tuple[Payload, ...] = ()
    grads_of: tuple[str, tuple[int, int]] | None = None
    sms: bool = True
    beside: tuple[Work, ...] = ()
    listed: bool = False

    def __post_init__(self) -> None:
        if self.listed and (self.op != "all_gather" or not self.blocking):
            raise ValueError(f"{self.op} on {self.group}: only a blocking all_gather is gathered into a list (listed)")


@dataclass(unsafe_hash=True, slots=True)
class Send:
    """Send the rows of `payload` that the route's table gives this rank, eagerly: it
    starts as soon as its data and stream are ready. `rendezvous`: it starts only once its
    receiver has posted the matching Recv, and the stream that issues it waits until it
    has landed (a synchronous two-rank broadcast, DeepSpeed's pipeline p2p); a Hop's only."""

    route: str
    payload: Payload
    stream: str = "send"
    rendezvous: bool = False


@dataclass(unsafe_hash=True, slots=True)
class Recv:
    """Receive the rows of `payload` that the route's table sends this rank (summed where
    the route reduces)."""

    route: str
    payload: Payload
    stream: str = "recv"
    blocking: bool = True
    handle: str | None = None


@dataclass(unsafe_hash=True, slots=True)
class Wait:
    """The compute stream waits until the operation that returned `handle` is done."""

    handle: str


Instruction = Union[Compute, Collective, Send, Recv, Wait]


@dataclass(frozen=True)
class Group:
    """A process group. `sharing`: how many groups of its family cross the busiest node's
    network links at the same time (Par4D eq. 10), set when the family is built."""

    name: str
    ranks: tuple[int, ...]
    sharing: int = 1
    # Every group of this group's family (this one included), when the group is written
    # for a class's first rank: each rank of the class finds its own member here.
    family: tuple[tuple[int, ...], ...] = ()


@dataclass(unsafe_hash=True, slots=True)
class Message:
    """One point-to-point transfer of a route: rows of the sender's payload that become
    rows of the receiver's (src == dst: a local copy)."""

    src: int
    dst: int
    sent: Payload
    received: Payload
    bytes: float


class Route:
    """Who sends which rows of which payload to whom (Megatron-Core's bridge
    communicators' RankCommInfo, made explicit per rank). `sharing`: how many of the
    route's messages cross the busiest node's links at once. `reduce`: messages that land
    on the same rows of a payload are summed (a gradient flowing back over a broadcast)."""

    name: str
    kind: CommKind
    sharing: int
    reduce: bool

    def sends(self, rank: int, payload: Payload) -> tuple[Message, ...]:
        raise NotImplementedError

    def receives(self, rank: int, payload: Payload) -> tuple[Message, ...]:
        raise NotImplementedError

    def messages(self) -> Iterator[Message]:
        raise NotImplementedError


@dataclass(frozen=True)
class Hop(Route):
    """Between two equally long rank lists, in both directions: position i of one side
    sends its whole payload to position i of the other, under the same name (pipeline
    neighbours: Megatron's stages order their ranks alike). Every message is `bytes`."""

    name: str
    kind: CommKind
    a: tuple[int, ...]
    b: tuple[int, ...]
    bytes: float
    sharing: int = 1
    reduce: bool = False
    # Megatron-LM's scatter/gather: position i of either side sends and receives only its
    # part scatter[i] (its TP index) of `parts` equal row blocks of a payload of `rows`
    # rows; the receiving stage all-gathers the rest over TP. () sends whole payloads.
    # Where the rows do not divide into the parts, a part's rows only name its index
    # (fewer rows than parts: [i, i + 1)), which the real backend reads as the share of
    # images a dealing unit's part carries or the block of rows a replicated unit's share
    # runs (runtime.row_shares), or else as an equal chunk of the flattened payload
    # (Megatron-LM's split_tensor_into_1d_equal_chunks).
    scatter: tuple[int, ...] = ()
    rows: int = 0
    _peer: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    _part: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.a) != len(self.b):
            raise ValueError(f"route {self.name}: {len(self.a)} ranks on one side, {len(self.b)} on the other")
        if self.scatter and len(self.scatter) != len(self.a):
            raise ValueError(f"route {self.name}: {len(self.scatter)} scatter parts for {len(self.a)} ranks a side")
        self._peer.update(zip(self.a, self.b))
        self._peer.update(zip(self.b, self.a))
        self._part.update(zip(self.a, self.scatter))
        self._part.update(zip(self.b, self.scatter))

    @property
    def parts(self) -> int:
        return len(set(self.scatter)) or 1

    @property
    def block(self) -> int:
        """Rows that name a part: its row block, or 1 where the rows do not reach the parts."""
        return max(1, self.rows // self.parts)

    def _one(self, src: int, dst: int, payload: Payload) -> tuple[Message, ...]:
        if not self.scatter:
            return (Message(src, dst, payload.whole, payload.whole, self.bytes),)
        part = payload.whole.part(self._part[src] * self.block, (self._part[src] + 1) * self.block)
        return (Message(src, dst, part, part, self.bytes),)

    def sends(self, rank: int, payload: Payload) -> tuple[Message, ...]:
        return self._one(rank, self.peer(rank), payload)

    def receives(self, rank: int, payload: Payload) -> tuple[Message, ...]:
        return self._one(self.peer(rank), rank, payload)

    def peer(self, rank: int) -> int:
        try:
            return self._peer[rank]
        except KeyError:
            raise KeyError(f"rank {rank} is on neither side of route {self.name}") from None

    def messages(self) -> Iterator[Message]:
        placeholder = Payload("?", 0, 0)
        for src, dst in list(zip(self.a, self.b)) + list(zip(self.b, self.a)):
            yield Message(src, dst, placeholder, placeholder, self.bytes)


@dataclass(frozen=True)
class Table(Route):
    """A route given message by message (fan-in and fan-out between units of different
    sizes, brokers, a batch-sync's exchange). Messages of one sender keep their order
    here, which is the order they are sent in."""

    name: str
    kind: CommKind
    table: tuple[Message, ...]
    sharing: int = 1
    reduce: bool = False
    _by_sender: dict = field(default_factory=dict, repr=False, compare=False)
    _by_receiver: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for message in self.table:
            self._by_sender.setdefault((message.src, message.sent.whole), []).append(message)
            self._by_receiver.setdefault((message.dst, message.received.whole), []).append(message)

    def sends(self, rank: int, payload: Payload) -> tuple[Message, ...]:
        return tuple(self._by_sender.get((rank, payload.whole), ()))

    def receives(self, rank: int, payload: Payload) -> tuple[Message, ...]:
        return tuple(self._by_receiver.get((rank, payload.whole), ()))

    def messages(self) -> Iterator[Message]:
        return iter(self.table)

    def transposed(self, name: str) -> Table:
        """The route the gradients take back: every message reversed, carrying the
        gradient of what it carried; rows that went to several ranks come back summed."""
        back = tuple(Message(m.dst, m.src, m.received.gradient(), m.sent.gradient(), m.bytes) for m in self.table)
        fanned_out = len({(m.src, m.sent) for m in self.table}) < len(self.table)
        return Table(name, self.kind, back, self.sharing, reduce=self.reduce or fanned_out)


@dataclass
class RankProgram:
    """The instruction list of one class of interchangeable ranks.

    pipelined: waiting on peers is a pipeline bubble (warm-up/cool-down) rather than
    load imbalance; units: the units whose work these ranks do.
    """

    ranks: tuple[int, ...]
    instructions: list[Instruction]
    label: str = ""
    units: tuple[str, ...] = ()
    pipelined: bool = False


@dataclass
class Program:
    world_size: int
    classes: list[RankProgram]
    groups: dict[str, Group] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)

    def add_group(self, group: Group) -> None:
        self.groups[group.name] = group

    def add_route(self, route: Route) -> None:
        if route.name in self.routes:
            raise ValueError(f"the Program already has a route {route.name!r}")
        self.routes[route.name] = route

    def class_of(self, rank: int) -> RankProgram:
        for rank_program in self.classes:
            if rank in rank_program.ranks:
                return rank_program
        raise KeyError(f"rank {rank} has no instruction list in this Program")

    def instructions_for(self, rank: int) -> list[Instruction]:
        return self.class_of(rank).instructions

    @property
    def num_instructions(self) -> int:
        return sum(len(c.instructions) for c in self.classes)

    def group_for(self, name: str, rank: int) -> tuple[int, ...]:
        """The ranks of group `name` as `rank` sees it: the group itself if `rank` is a
        member, else the member of its family that holds `rank`."""
        group = self.groups.get(name)
        if group is None:
            raise KeyError(f"the Program has no group {name!r}")
        if rank in group.ranks:
            return group.ranks
        for member in group.family:
            if rank in member:
                return tuple(member)
        raise KeyError(f"rank {rank} is in no group of the family of {name!r}")

    def route(self, name: str) -> Route:
        route = self.routes.get(name)
        if route is None:
            raise KeyError(f"the Program has no route {name!r}")
        return route


@dataclass(frozen=True)
class GridLayer:
    """How one layer lies on a tensor grid. transposed: its first FC writes its output
    columns over y (else x); replicated: the whole layer on each rank of the tensor grid,
    rows split over z, its input all-gathered over `gathers` (split there before) and its
    output sliced over `scatters` for the next FC; resplit: its skip projection's output
    is moved onto the axis the layer's output lies over."""

    transposed: bool = False
    replicated: bool = False
    gathers: str | None = None
    scatters: str | None = None
    resplit: bool = False


GRID_OVERLAPS = ("all_reduce", "reduce_scatter", "all_gather", "cache")
GRID_GATHERS = ("paper", "lightning")  # how a grid's weights are gathered (strategies.par4d.programs)
TENSOR_GRID_AXES = ("x", "y", "z")


@dataclass(frozen=True)
class TensorGrid:
    """A unit whose tensors lie on a 3D grid of ranks, the mesh axes x, y and z (3D tensor
    parallelism, docs/strategies.md): each FC's weight split over two of them, its rows over
    the third. layers: how each of the unit's layers lies on the grid. overlaps: the
    communication overlaps that are on (all_reduce: an input gradient's all-reduce under the
    weight gradient's GEMM; reduce_scatter: weight gradients reduced in flight; all_gather:
    the next weight block prefetched; cache: gathered weights kept for the recomputation).
    cached_layers: with cache on, the layers whose recomputation reuses the forward's
    gathered weights. gathers: paper (Algorithm 1's, the gathered weights kept for the
    backward, one prefetch chain) or lightning (AxoNN's Lightning strategy's)."""

    layers: tuple[GridLayer, ...]
    overlaps: tuple[str, ...] = ()
    cached_layers: tuple[int, ...] = ()
    gathers: str = "paper"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.overlaps) - set(GRID_OVERLAPS))
        if unknown:
            raise ValueError(f"tensor grid overlaps {unknown}: choose from {list(GRID_OVERLAPS)}")
        if self.gathers not in GRID_GATHERS:
            raise ValueError(f"tensor grid gathers {self.gathers!r}: choose from {list(GRID_GATHERS)}")


@dataclass
class UnitPlan:
    """How one unit is parallelised: its device mesh, micro-batching and memory options.

    Everything a backend, the memory model or the metrics read is a field here; `details`
    is for display only. mesh: the unit's devices by axis (tp, dp, pp; x, y, z for a 3D
    tensor grid; rows for a unit replicated over its pipeline's TP group, whose ranks then
    split each of its micro-batches' rows: row_shares). stage_layers: the [start, end) layer range of every (virtual) pipeline
    stage, in model order (stage s, chunk v is entry v*pp + s). batch_per_replica: samples
    each data-parallel replica processes per iteration. sample_groups: the step's batch is
    cut into this many contiguous groups, each split over the replicas and then into
    micro-batches in order (DistMM's contrastive batches; elsewhere one group per
    micro-batch index: src/batch_layout.py), unless `samples_of` names the unit whose
    samples it reads.
    gathered_params: parameters a rank holds gathered (16-bit) beyond its own shard at
    its peak: ZeRO-3's live layers, a tensor grid's all-gathered weight blocks
    kept for the backward or cached for recomputation.
    """

    unit: str
    mesh: Mesh
    micro_batch: int
    num_microbatches: int
    batch_per_replica: int
    stage_layers: tuple[tuple[int, int], ...]
    sample_groups: int
    vpp: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    # A unit whose micro-batch j holds the samples of another unit's micro-batch j on the
    # same rank's replica of it (Optimus's encoders: micro-batch j is the LLM micro-batch
    # its output becomes); None: its own batching says which samples.
    samples_of: str | None = None
    sequence_parallel: bool = False
    gathered_params: float = 0.0
    overlap_comm: bool = False  # gradients reduced asynchronously during the backward (ZeRO-3 also prefetches parameters)
    prefetch_params: float = 0.0  # ZeRO-3 with overlap_comm: parameters prefetched ahead of a layer
    # ZeRO-3 (DeepSpeed's stage3_max_reuse_distance): a module's parameters stay gathered from
    # its recomputed forward to its backward when fewer are fetched in between; 0: not ZeRO-3.
    reuse_distance: float = 0.0
    # ZeRO-3 (DeepSpeed's stage3_param_persistence_threshold): parameter tensors of at most
    # this many elements are never partitioned, so no module hook fetches them.
    persistence_threshold: float = DEEPSPEED_PERSISTENCE_THRESHOLD
    # ZeRO-3's fetch as a DeepSpeed release ran it: per_tensor (before 0.5.5), coalesced, prefetched.
    zero3_fetch: str = "prefetched"
    # The type a data-parallel reduction sends gradients in, where the planner sets one (ddp:
    # DeepSpeed's communication_data_type or FSDP's reduce_dtype); None: its framework's own
    # (src.costmodel.memory.grad_bytes).
    grad_reduce_dtype: str | None = None
    # The type a second copy of the gradients accumulates in beside them (DeepSpeed's
    # BF16_Optimizer: fp32); None: none (src.costmodel.memory.kept_grad_bytes).
    grad_accum_dtype: str | None = None
    # When the distributed optimizer all-gathers the updated parameters: at the step's end
    # (step_end), or layer by layer into the next forward (overlapped: Megatron-Core's
    # --overlap-param-gather, strategies/builders/pipeline.py's ParamGathers).
    param_gather: str = "step_end"
    grid: TensorGrid | None = None  # a unit whose mesh has the tensor grid's axes: how it lies on them
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"unit {self.unit}: recompute {self.recompute!r} is not one of {RECOMPUTE_MODES}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"unit {self.unit}: zero_stage {self.zero_stage!r} is not 0-3")
        if self.param_gather not in PARAM_GATHERS:
            raise ValueError(f"unit {self.unit}: param_gather {self.param_gather!r} is not one of {PARAM_GATHERS}")
        if self.num_microbatches % self.sample_groups:
            raise ValueError(
                f"unit {self.unit}: {self.num_microbatches} micro-batches do not split into {self.sample_groups} sample groups"
            )
        if len(self.stage_layers) != self.pp * self.vpp:
            raise ValueError(f"unit {self.unit}: {len(self.stage_layers)} stage layer ranges for pp={self.pp} x vpp={self.vpp}")
        on_grid = any(axis in TENSOR_GRID_AXES for axis, _ in self.mesh.axes)
        if on_grid != (self.grid is not None):
            raise ValueError(
                f"unit {self.unit}: mesh {self.mesh.shape()} {'has' if on_grid else 'has no'} tensor grid axes "
                f"{list(TENSOR_GRID_AXES)} but the plan {'gives no' if on_grid else 'gives a'} tensor grid layout"
            )

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.mesh.ranks

    @property
    def dp(self) -> int:
        return self.mesh.degree("dp")

    @property
    def tp(self) -> int:
        return self.mesh.degree("tp")

    @property
    def pp(self) -> int:
        return self.mesh.degree("pp")

    @property
    def row_shares(self) -> int:
        """Ranks that split each micro-batch's rows, each holding the whole unit (a unit
        replicated over its pipeline's TP group: its mesh's `rows` axis); 1: none."""
        return self.mesh.degree(ROWS)

    @property
    def data_replicas(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together: the
        data-parallel replicas, times the row shares of a replicated unit."""
        return self.dp * self.row_shares

    def layers_on(self, rank: int) -> set[int]:
        """The unit's layers that `rank` computes (every chunk of its pipeline stage)."""
        stage = self.mesh.coords(rank).get("pp", 0)
        return {layer for chunk in range(self.vpp) for layer in range(*self.stage_layers[chunk * self.pp + stage])}

    def as_dict(self) -> dict:
        return {
            "mesh": {name: degree for name, degree in self.mesh.axes},
            "dp": self.dp,
            "tp": self.tp,
            **({"rows": self.row_shares} if self.row_shares > 1 else {}),
            "pp": self.pp,
            "vpp": self.vpp,
            "devices": len(self.ranks),
            "ranks": compress_ranks(self.ranks),
            "micro_batch": self.micro_batch,
            "num_microbatches": self.num_microbatches,
            "batch_per_replica": self.batch_per_replica,
            "stage_layers": [list(r) for r in self.stage_layers],
            "zero_stage": self.zero_stage,
            "recompute": self.recompute,
            "sequence_parallel": self.sequence_parallel,
            **({"gathered_params": self.gathered_params} if self.gathered_params else {}),
            **({"param_gather": self.param_gather} if self.param_gather != "step_end" else {}),
            **self.details,
        }


@dataclass
class Plan:
    """A strategy's plan: its units' plans and the Program. precision: the numeric format
    the plan is priced and runs in (train.precision; fp32, fp16 or bf16)."""

    strategy: str
    devices: int
    units: list[UnitPlan]
    program: Program
    precision: str
    details: dict = field(default_factory=dict)
    # sample_order[p]: which sample of the step's batch (in data order) batch position p
    # holds, when the strategy reorders its batch (DistTrain); None: data order.
    sample_order: tuple[int, ...] | None = None
    # What an MLLM's sequences hold: "uniform" (one image each) or "interleaved" (each its
    # sample's images, as data.interleaved's sampler draws them: the workload's train.data).
    sample_content: str = "uniform"
    # Images per sample of the first step's batch (in data order) that the plan prices, where
    # its loads follow them (DistTrain's interleaved data, or an MLLM's tar shards); None: none.
    sample_images: tuple[int, ...] | None = None
    # The mean images per sequence its Program prices where it is not the model's
    # images_per_sequence: loads against the model's nominal sequence (DistTrain on given
    # sample images, an MLLM's tar shards); None: the model's (loads against the batch's mean).
    images_per_sequence: float | None = None
    # Where set, the policy that placed sample_order (for the first step's batch) places every
    # step's batch by that step's loads (train.balance on Megatron-LM's and ZeRO's pipelines,
    # DistTrain's reordering).
    balancing: Balancing | Reordering | None = None

    def unit(self, name: str) -> UnitPlan:
        for unit_plan in self.units:
            if unit_plan.unit == name:
                return unit_plan
        raise KeyError(name)

    def units_on(self, rank: int) -> list[UnitPlan]:
        return [u for u in self.units if rank in u.mesh]

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "devices": self.devices, "units": {u.unit: u.as_dict() for u in self.units}, **self.details}


def compress_ranks(ranks: tuple[int, ...]) -> str:
    """'0-7,16-23': rank lists of thousands of entries stay readable in summaries."""
    parts: list[str] = []
    ordered = sorted(ranks)
    if not ordered:
        return ""
    start = prev = ordered[0]
    for rank in ordered[1:]:
        if rank == prev + 1:
            prev = rank
            continue
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
        start = prev = rank
    parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(parts)
