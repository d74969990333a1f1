"""The one instruction set: what a strategy emits and both backends execute.

A Program gives every rank an ordered instruction list. Ranks that are interchangeable by
symmetry (the TP peers and DP replicas of one pipeline stage, say) share one list: a
RankProgram covers a class of ranks and is written for its first rank, so the simulator
prices GPT-175B on 3072 GPUs by running 8 classes, not 3072 lists. A hand-built Program
simply gives every rank its own class.

Streams: every rank has a `compute` stream and any number of communication streams,
each executing its instructions in issue order. A communication instruction issued on a
side stream starts after everything issued before it on the compute stream (the data it
sends was produced there). `blocking=True` makes the compute stream wait for the
operation; otherwise it returns a handle that a later Wait consumes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

Phase = Literal["fwd", "bwd", "bwd_input", "bwd_weight", "optimizer", "interaction"]
CommKind = Literal["tp", "pp", "dp", "interaction", "broker"]
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
COMM_KINDS: tuple[str, ...] = ("tp", "pp", "dp", "interaction", "broker")
COMPUTE_STREAM = "compute"


@dataclass(frozen=True, slots=True)
class Work:
    """A piece of one unit's computation for one micro-batch on one device.

    layers: [start, end) of the unit's layers. kernels: optionally a [start, end) range of
    kernels of layer `layers[0]` only (kernel-granular placement, e.g. Optimus).
    phase: fwd; bwd (input and weight gradients; preceded by re-running the forward, or
    only its attention core, when recompute is 'full' or 'selective'); bwd_input /
    bwd_weight separately; optimizer (the update of the layers' local parameter shard,
    `shard` = how many ranks share the optimizer state);
    interaction (forward + backward of an interaction unit on a gathered batch).
    load: relative size of this micro-batch's input against the nominal sample (data
    heterogeneity); time and FLOPs scale with it.
    fraction: this is one chunk of the work (1/n of its GEMM rows), for overlap.
    """

    unit: str
    phase: Phase
    samples: int
    layers: tuple[int, int]
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    contrastive_batch: int = 1
    kernels: tuple[int, int] | None = None
    fraction: float = 1.0
    load: float = 1.0
    shard: int = 1


@dataclass(frozen=True, slots=True)
class Compute:
    work: Work
    microbatch: int = 0
    chunk: int = 0


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective over a named group. `bytes` is each rank's full buffer: the tensor
    reduced (all_reduce), the gathered output (all_gather) or the input to scatter
    (reduce_scatter). `count` repeats it back to back (e.g. the TP all-reduces of many
    layers priced as one instruction)."""

    op: CollectiveOp
    group: str
    bytes: float
    kind: CommKind
    stream: str = "comm"
    blocking: bool = True
    handle: str | None = None
    count: int = 1


@dataclass(frozen=True, slots=True)
class Send:
    """Point-to-point send, eager: it starts as soon as its data and stream are ready.
    `key` names the message uniquely in the Program; the matching Recv uses the same key.
    `sharing`: how many transfers of this kind share the node's network links at once."""

    dst: int
    key: str
    bytes: float
    kind: CommKind
    stream: str = "send"
    sharing: int = 1


@dataclass(frozen=True, slots=True)
class Recv:
    src: int
    key: str
    bytes: float
    kind: CommKind
    stream: str = "recv"
    blocking: bool = True
    handle: str | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """The compute stream waits until the operation that returned `handle` is done."""

    handle: str


@dataclass(frozen=True, slots=True)
class BatchSync:
    """DistMM's batch-sync: gather the features of K micro-batches (the `gather`
    collective, if the interaction is distributed), run the interaction unit's forward and
    backward once on the whole contrastive batch (`work`), scatter K gradients back.
    It is a barrier between the K forwards and the K backwards."""

    microbatches: tuple[int, ...]
    work: Work
    gather: Collective | None = None


Instruction = Union[Compute, Collective, Send, Recv, Wait, BatchSync]


@dataclass(frozen=True)
class Group:
    """A process group. `sharing`: how many groups of its family cross the busiest node's
    network links at the same time (Par4D eq. 10), set when the family is built."""

    name: str
    ranks: tuple[int, ...]
    sharing: int = 1
    # Every group of this group's family (this one included), when the group is written
    # for a class's first rank: the real backend finds each rank's own member here.
    family: tuple[tuple[int, ...], ...] = ()


@dataclass
class RankProgram:
    """The instruction list of one class of interchangeable ranks, written for ranks[0].

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

    def add_group(self, group: Group) -> None:
        self.groups[group.name] = group

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

    # A class program is written for its first rank; the real backend runs it on every
    # rank of the class, so it needs each rank's own group and peers.
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

    def peer_for(self, rank: int, written: int) -> int:
        """The peer of `rank` for a Send/Recv written (for the class's first rank) with
        peer `written`: ranks correspond by position in their classes, as Megatron's
        stage_ranks order every stage the same way."""
        mine = self.class_of(rank).ranks
        theirs = self.class_of(written).ranks
        if len(mine) != len(theirs):
            raise KeyError(f"rank {rank}'s class has {len(mine)} ranks but peer {written}'s has {len(theirs)}: "
                           f"no position correspondence")
        return theirs[(theirs.index(written) + mine.index(rank)) % len(theirs)]


@dataclass
class UnitPlan:
    """How one unit is parallelised: its degrees, ranks, and micro-batching.

    stage_layers: the [start, end) layer range of every (virtual) pipeline stage, in
    model order (stage s, chunk v is entry v*pp + s). batch_per_replica: samples each
    data-parallel replica processes per iteration.
    """

    unit: str
    dp: int
    tp: int
    pp: int
    ranks: tuple[int, ...]
    micro_batch: int
    num_microbatches: int
    batch_per_replica: int
    stage_layers: tuple[tuple[int, int], ...]
    vpp: int = 1
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp,
            "devices": len(self.ranks),
            "ranks": compress_ranks(self.ranks),
            "micro_batch": self.micro_batch,
            "num_microbatches": self.num_microbatches,
            "batch_per_replica": self.batch_per_replica,
            "stage_layers": [list(r) for r in self.stage_layers],
            **self.details,
        }


@dataclass
class Plan:
    strategy: str
    devices: int
    units: list[UnitPlan]
    program: Program
    details: dict = field(default_factory=dict)

    def unit(self, name: str) -> UnitPlan:
        for unit_plan in self.units:
            if unit_plan.unit == name:
                return unit_plan
        raise KeyError(name)

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "devices": self.devices,
                "units": {u.unit: u.as_dict() for u in self.units}, **self.details}


def compress_ranks(ranks: tuple[int, ...]) -> str:
    """'0-7,16-23': rank lists of thousands of entries stay readable in summaries."""
    parts: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0] if ordered else None
    for rank in ordered[1:]:
        if rank == prev + 1:
            prev = rank
            continue
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
        start = prev = rank
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(parts)
