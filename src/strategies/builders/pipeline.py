"""One emitter for every pipeline: a chain of segments cut into virtual stages over a
(tp, dp, pp) mesh, run in a schedule's order.

Megatron-LM's model pipeline, each of DistMM's towers and the coming planners' LLM
pipelines are all this shape. The emitter turns a stage's schedule order into
instructions, one list per schedule operation (`StageOp`), so that a planner can place
other work into the gaps between them (Optimus's encoder kernels) before the lists are
joined into the stage's RankProgram.

Data flow: a segment reads the payloads its layers consume and writes those it produces
(strategies.builders.emit). A payload made by the previous virtual stage arrives over that
boundary's Hop route, from the same position of the previous stage's ranks; one made
and read on the same stage stays local; any other (a tower's feature for a contrastive
loss, tokens another unit cross-attends to) goes through the planner's `Links`.
Gradients flow the same ways back.

A stage may be replicated over its TP group instead (stages.StageRun: a unit too small
for TP, whole on every rank, each on its share of a micro-batch's rows): it runs no TP
collective, its hops carry each rank's share of rows (the TP side all-gathers them), and
it reduces its gradients over its TP x DP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from src.cluster import ClusterSpec, family_sharing
from src.costmodel.memory import element_bytes, reduce_bytes, weight_bytes
from src.mesh import Mesh, tensor_parallel
from src.models.spec import ModelSpec
from src.program import COMPUTE_STREAM, Collective, Hop, Instruction, Payload, Program, RankProgram, Recv, Send, Wait
from src.strategies.builders.emit import TPConfig, backward_io, consumed, dp_grad_op, iteration_tail, produced, segment_pass
from src.strategies.builders.layout import axis_group, pipeline_pairs, stage_group
from src.strategies.builders.stages import (
    Segment,
    StageTransfer,
    boundary_elems,
    replicated_transfer,
    stage_runs,
    stage_transfer,
)


class Links(Protocol):
    """How a pipeline exchanges payloads with the rest of the Program."""

    def receive(self, payload: Payload) -> list[Instruction]: ...

    def send(self, payload: Payload) -> list[Instruction]: ...


class NoLinks:
    """A pipeline that exchanges nothing outside itself."""

    def receive(self, payload: Payload) -> list[Instruction]:
        raise ValueError(f"the pipeline reads {payload}, which nothing provides")

    def send(self, payload: Payload) -> list[Instruction]:
        return []


@dataclass(frozen=True)
class PipelineSettings:
    micro_batch: int
    recompute: str
    sequence_parallel: bool
    zero_stage: int
    overlap_grad_reduce: bool = False
    tp_overlap_chunks: int = 1
    scatter_gather: bool = False  # Megatron-LM's pipeline scatter/gather (stages.stage_transfer)
    replicate: tuple[str, ...] = ()  # units replicated over their stage's TP group (stages.StageRun)
    overlap_param_gather: bool = False  # the distributed optimizer's all-gather chained into the next forward (ParamGathers)
    grad_reduce_dtype: str | None = None  # the type DP reduces gradients in; None: Megatron-LM's (memory.reduce_bytes)
    grad_all_reduce: bool = False  # the whole gradient all-reduced under a sharded optimizer (emit.dp_grad_op)
    p2p: str = "eager"  # how stages exchange payloads (P2P_EXCHANGES: eager sends, or DeepSpeed's engine's)


@dataclass
class StageOp:
    """One schedule operation of a stage and the instructions it became."""

    op: object
    instructions: list[Instruction]


@dataclass
class Stage:
    index: int
    ranks: tuple[int, ...]
    head: list[Instruction] = field(default_factory=list)
    ops: list[StageOp] = field(default_factory=list)
    tail: list[Instruction] = field(default_factory=list)

    def instructions(self) -> list[Instruction]:
        return self.head + [i for op in self.ops for i in op.instructions] + self.tail


# eager: a stage sends what a pass made as soon as the pass ends, on a stream of its own.
# deepspeed: DeepSpeed's pipeline engine (TrainSchedule and p2p.py at v0.3.15, the same at v0.6.5):
# a pass's sends are the next schedule step's, each a synchronous send (rendezvous_exchange).
P2P_EXCHANGES = ("eager", "deepspeed")


def rendezvous_exchange(ops: list[StageOp], hops: set[str]) -> list[Instruction]:
    """DeepSpeed's pipeline engine's order of a stage's sends (TrainSchedule.steps at
    v0.3.15): a step opens with its exchanges, a forward step's RecvActivation then SendGrad
    of the step before, a backward step's SendActivation of the step before then RecvGrad.
    Every pass is one step and the steps alternate, so what a pass made is sent at the start
    of the next op, but for a gradient whose next op is a forward: after that forward's
    receives. Each send is p2p.send, a broadcast over the two stages' group with async_op
    False (v0.6.5: dist.send where torch has it): the compute stream waits until the receiver
    has posted its receive and the data has landed (Send.rendezvous). DeepSpeed 0.9.0 (PR #2862)
    swapped each step's two exchanges; the releases DeepSpeed-3D models (0.3.15 for fp16, the
    first with bf16 pipelines, 0.6.x, for bf16) exchange as here. Rewrites `ops` in place;
    returns the last op's sends, which DeepSpeed sends in the step after it (before the
    iteration's end)."""
    carried: list[Send] = []
    for op in ops:
        sends = [i for i in op.instructions if isinstance(i, Send) and i.route in hops]
        body = [i for i in op.instructions if not (isinstance(i, Send) and i.route in hops)]
        opened: list[Instruction] = list(carried)
        if getattr(op.op, "kind", None) == "F" and carried and all(s.payload.grad for s in carried):
            received = _leading_receives(body, hops)
            body = body[:received] + opened + body[received:]
        else:
            body = opened + body
        op.instructions = body
        carried = [Send(s.route, s.payload, stream=COMPUTE_STREAM, rendezvous=True) for s in sends]
    return list(carried)


def _leading_receives(instructions: list[Instruction], hops: set[str]) -> int:
    """How many of `instructions` are the receives that open a pass: its hop receives and
    the TP all-gathers that rebuild what they carried (a scattered transfer)."""
    n = 0
    for instruction in instructions:
        if isinstance(instruction, Recv) and instruction.route in hops:
            n += 1
        elif n and isinstance(instruction, Collective) and instruction.kind == "pp" and instruction.inputs:
            n += 1
        else:
            break
    return n


class ParamGathers:
    """Megatron-Core's --overlap-param-gather: the distributed optimizer's all-gather of the
    updated parameters, layer by layer in forward order. The step issues the first layer's
    (in zero_grad, before the forward); the forward pre-hook of a layer's first use waits
    for its gather and issues the next layer's (one at a time, so that no gather queues
    ahead of the compute kernels: distrib_optimizer.py, _finish_param_sync_helper, at
    NVIDIA/Megatron-LM 937571c). Its buckets are priced as layers. In the Program the
    gathers serve this iteration's forward; in a run they are the previous step's,
    overlapping the same forward."""

    def __init__(self, layers: list[tuple[str, int, float]], group: str, prefix: str) -> None:
        """`layers`: (unit, layer, bytes gathered) in forward order."""
        self._handles = [f"{prefix}pg{k}" for k in range(len(layers))]
        self._gathers: list[Instruction] = [
            Collective("all_gather", group, nbytes, "dp", blocking=False, handle=handle, grads_of=(unit, (layer, layer + 1)))
            for handle, (unit, layer, nbytes) in zip(self._handles, layers)
        ]
        self._index = {(unit, layer): k for k, (unit, layer, _) in enumerate(layers)}

    def head(self) -> list[Instruction]:
        return self._gathers[:1]

    def holds(self, unit: str, layers: tuple[int, int]) -> bool:
        return any((unit, layer) in self._index for layer in range(*layers))

    def before(self, unit: str, layer: int) -> list[Instruction]:
        """What a layer's first forward issues first: the wait for its gather, the next's."""
        k = self._index.get((unit, layer))
        if k is None:
            return []
        return [Wait(self._handles[k]), *self._gathers[k + 1 : k + 2]]


class PipelineEmitter:
    """`virtual`: the pipeline's pp·vpp virtual stages in model order (stage s, chunk v is
    entry v·pp + s); `prefix` names its groups and routes apart from other pipelines'."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        precision: str,
        program: Program,
        mesh: Mesh,
        virtual: list[list[Segment]],
        settings: PipelineSettings,
        prefix: str = "",
        links: Links | None = None,
    ) -> None:
        self.model, self.program, self.mesh, self.virtual, self.cfg = model, program, mesh, virtual, settings
        self.links = links or NoLinks()
        self.pp = mesh.degree("pp")
        self.dp = mesh.degree("dp")
        self.vpp = len(virtual) // self.pp
        self.act_bytes, self.weight_bytes = element_bytes(precision), weight_bytes(precision, cluster.amp)
        self.grad_bytes = reduce_bytes(precision, settings.grad_reduce_dtype)
        tp = mesh.degree("tp")
        self.sharding = tensor_parallel(tp, settings.sequence_parallel)
        self.runs = stage_runs(model, virtual, self.pp, tp, settings.sequence_parallel, settings.micro_batch, settings.replicate)
        self.needs_bwd = [any(model.needs_backward(seg.unit) for seg in segs) for segs in virtual]
        self.tp_groups: list[str | None] = []
        self.dp_groups: list[str | None] = []
        for stage in range(self.pp):
            first = mesh.rank(pp=stage)
            if self.runs[stage].replicated:
                self.tp_groups.append(None)
                self.dp_groups.append(stage_group(program, cluster, f"{prefix}dp.s{stage}", mesh, stage))
                continue
            self.tp_groups.append(axis_group(program, cluster, f"{prefix}tp.s{stage}", mesh, "tp", first))
            self.dp_groups.append(axis_group(program, cluster, f"{prefix}dp.s{stage}", mesh, "dp", first))
        pairs = pipeline_pairs(mesh)
        sharing = family_sharing(cluster, pairs) if pairs else 1
        self.hops: list[str] = []
        self.transfers: list[StageTransfer] = []
        for v in range(len(virtual) - 1):
            last = virtual[v][-1]
            nbytes = boundary_elems(model.unit(last.unit), last.layers[1]) * settings.micro_batch * self.act_bytes
            replicated = [run.rows for run in (self.runs[v % self.pp], self.runs[(v + 1) % self.pp]) if run.replicated]
            if replicated:
                transfer = replicated_transfer(nbytes, tp, max(replicated))
            else:
                transfer = stage_transfer(nbytes, tp, settings.sequence_parallel, settings.scatter_gather)
            a, b = mesh.slice(pp=v % self.pp), mesh.slice(pp=(v + 1) % self.pp)
            scatter = tuple(mesh.coords(rank)["tp"] for rank in a) if transfer.gather_bytes else ()
            route = Hop(f"{prefix}hop.v{v}", "pp", a, b, transfer.send_bytes, sharing, scatter=scatter, rows=settings.micro_batch)
            self.transfers.append(transfer)
            program.add_route(route)
            self.hops.append(route.name)
        self.pending: dict[int, list[str]] = {stage: [] for stage in range(self.pp)}
        self._tp_configs: dict[int, TPConfig] = {}

    def _tp(self, stage: int) -> TPConfig:
        tp = self._tp_configs.get(stage)
        if tp is None:  # asked for by every pass of every micro-batch
            run, cfg = self.runs[stage], self.cfg
            tp = TPConfig(run.sharding, self.tp_groups[stage], cfg.recompute, self.act_bytes, cfg.tp_overlap_chunks, run.rows)
            self._tp_configs[stage] = tp
        return tp

    def data_replicas(self, stage: int) -> int:
        """The ranks that reduce a stage's gradients together: its DP replicas (and its TP
        ranks where it is replicated over them)."""
        return self.dp * (self.mesh.degree("tp") if self.runs[stage].replicated else 1)

    def stage(self, stage: int, order: list, other: Callable[[object], list[Instruction]] | None = None) -> Stage:
        """A stage's instructions for its schedule `order` (ops with kind F or B, chunk,
        microbatch); ops of any other kind are `other`'s (DistMM's batch-sync)."""
        out = Stage(stage, self.mesh.slice(pp=stage))
        last_backward = {op.chunk: i for i, op in enumerate(order) if op.kind == "B"}
        first_forward = {op.chunk: i for i, op in reversed(list(enumerate(order))) if op.kind == "F"}
        gathers = self._param_gathers(stage)
        if gathers is not None:
            out.head = gathers.head()
        for index, op in enumerate(order):
            v = op.chunk * self.pp + stage
            if op.kind == "F":
                instructions = self._forward(v, op, gathers if index == first_forward[op.chunk] else None)
            elif op.kind == "B":
                final = index == last_backward[op.chunk]
                reduce_into = self.dp_groups[stage] if self.cfg.overlap_grad_reduce and final else None
                instructions = self._backward(v, op, reduce_into) if self.needs_bwd[v] else []
            else:
                assert other is not None, f"a {op.kind} op in stage {stage}'s order and no handler for it"
                instructions = other(op)
            out.ops.append(StageOp(op, instructions))
        last_sends = rendezvous_exchange(out.ops, set(self.hops)) if self.cfg.p2p == "deepspeed" else []
        own = self.segments_of(stage)
        out.tail = last_sends + iteration_tail(
            self.model,
            own,
            self.runs[stage].sharding,
            self.dp_groups[stage],
            self.data_replicas(stage),
            self.cfg.zero_stage,
            self.grad_bytes,
            self.weight_bytes,
            self.pending[stage],
            gather_params=gathers is None,
            # Reductions or gathers layer by layer, or a whole gradient all-reduced under a
            # sharded optimizer, are the plan's own distributed optimizer's: its other
            # collectives name their layers too.
            name_grads=self.cfg.zero_stage >= 1 and (gathers is not None or bool(self.pending[stage]) or self.cfg.grad_all_reduce),
            whole_grads=self.cfg.grad_all_reduce,
        )
        return out

    def _param_gathers(self, stage: int) -> ParamGathers | None:
        """The stage's chain of parameter gathers under overlap_param_gather (the
        distributed optimizer over more than one replica), else None."""
        group = self.dp_groups[stage]
        if not self.cfg.overlap_param_gather or self.cfg.zero_stage not in (1, 2) or self.data_replicas(stage) < 2 or group is None:
            return None
        assert self.cfg.tp_overlap_chunks == 1, "a chunked pass is not cut into layers for the gathers"
        devices = self.runs[stage].sharding.devices
        layers = [
            (seg.unit, layer, self.model.unit(seg.unit).trainable_params(layer, layer + 1) / devices * self.weight_bytes)
            for seg in self.segments_of(stage)
            for layer in range(*seg.layers)
        ]
        layers = [entry for entry in layers if entry[2] > 0]
        return ParamGathers(layers, group, f"s{stage}.") if layers else None

    def segments_of(self, stage: int) -> list[Segment]:
        return [seg for chunk in range(self.vpp) for seg in self.virtual[chunk * self.pp + stage]]

    def rank_program(self, stage: Stage, label: str, extra_units: tuple[str, ...] = ()) -> RankProgram:
        units = tuple(dict.fromkeys([seg.unit for seg in self.segments_of(stage.index)] + list(extra_units)))
        return RankProgram(ranks=stage.ranks, instructions=stage.instructions(), label=label, units=units, pipelined=self.pp > 1)

    # ---- one virtual stage's forward and backward ----------------------------------------
    def _boundary(self, v: int, microbatch: int) -> tuple[set[Payload], set[Payload]]:
        """What virtual stage v receives from v-1 and sends to v+1 (over their hops)."""
        inbound = set(produced(self.model, self.virtual[v - 1][-1], microbatch)) if v > 0 else set()
        outbound = set()
        if v < len(self.virtual) - 1:
            outbound = set(consumed(self.model, self.virtual[v + 1][0], microbatch))
        return inbound, outbound

    def _forward(self, v: int, op, gathers: ParamGathers | None = None) -> list[Instruction]:
        """`gathers`: the parameter gathers this (a chunk's first) forward waits for."""
        j, stage = op.microbatch, v % self.pp
        inbound, outbound = self._boundary(v, j)
        inside = {p for s in self.virtual[v] for p in consumed(self.model, s, j)}
        made_here: set[Payload] = set()
        out: list[Instruction] = []
        for segment in self.virtual[v]:
            for payload in consumed(self.model, segment, j):
                if payload not in made_here:
                    out += self._receive(v - 1, payload, stage) if payload in inbound else self.links.receive(payload)
            if gathers is not None and gathers.holds(segment.unit, segment.layers):
                out += self._gathered_pass(segment, j, op.chunk, stage, gathers)
            else:
                out += segment_pass(self.model, segment, "fwd", self.cfg.micro_batch, j, self._tp(stage), chunk=op.chunk)
            for payload in produced(self.model, segment, j):
                made_here.add(payload)
                if payload in outbound:
                    out += self._send(v, payload, stage, (v + 1) % self.pp)
                elif payload not in inside:
                    out += self.links.send(payload)
        return out

    def _gathered_pass(self, segment: Segment, microbatch: int, chunk: int, stage: int, gathers: ParamGathers) -> list[Instruction]:
        """A segment's forward layer by layer, each after its parameters' gather (and
        issuing the next's), each reading what its layer reads (the token states the layer
        before hands on among them) and writing what it writes."""
        out: list[Instruction] = []
        for layer in range(*segment.layers):
            out += gathers.before(segment.unit, layer)
            out += segment_pass(
                self.model, Segment(segment.unit, (layer, layer + 1)), "fwd", self.cfg.micro_batch, microbatch, self._tp(stage), chunk
            )
        return out

    def _backward(self, v: int, op, reduce_into: str | None) -> list[Instruction]:
        """reduce_into: the DP group that reduces each layer's gradient as soon as this
        backward finishes it (None: the iteration's tail reduces them)."""
        j, stage = op.microbatch, v % self.pp
        inbound, outbound = self._boundary(v, j)
        inside = {p for s in self.virtual[v] for p in consumed(self.model, s, j)}
        made_here = {p for s in self.virtual[v] for p in produced(self.model, s, j)}
        out: list[Instruction] = []
        for segment in reversed([s for s in self.virtual[v] if self.model.needs_backward(s.unit)]):
            grads_in, grads_out = backward_io(self.model, segment, j)
            for grad in grads_in:
                if grad.value() in outbound:
                    out += self._receive(v, grad, stage)
                elif grad.value() not in inside:
                    out += self.links.receive(grad)
            out += self._segment_backward(segment, j, op.chunk, stage, reduce_into)
            for grad in grads_out:
                if grad.value() in inbound:
                    out += self._send(v - 1, grad, stage, (v - 1) % self.pp)
                elif grad.value() not in made_here:
                    out += self.links.send(grad)
        return out

    def _send(self, hop: int, payload: Payload, stage: int, to: int) -> list[Instruction]:
        """A payload (or its gradient) over hop `hop` to stage `to`. Where `to` is replicated
        over its TP group (each of its ranks runs whole rows), a sequence-parallel stage
        first all-gathers the payload over TP: it holds its tokens of every row."""
        out: list[Instruction] = []
        group = self.tp_groups[stage]
        if self.runs[to].replicated and self.runs[stage].sharding.sequence_parallel and group is not None:
            whole = (payload,)
            gather = self.transfers[hop].gather_bytes
            out.append(Collective("all_gather", group, gather, "pp", stream="compute", inputs=whole, outputs=whole))
        out.append(Send(self.hops[hop], payload))
        return out

    def _receive(self, hop: int, payload: Payload, stage: int) -> list[Instruction]:
        """A payload (or its gradient) over hop `hop`: each rank's share, then the TP
        all-gather that rebuilds it where the transfer was scattered."""
        out: list[Instruction] = [Recv(self.hops[hop], payload)]
        gather, group = self.transfers[hop].gather_bytes, self.tp_groups[stage]
        if gather and group is not None:
            whole = (payload,)  # each rank's received part in, the whole payload out
            out.append(Collective("all_gather", group, gather, "pp", stream="compute", inputs=whole, outputs=whole))
        return out

    def _segment_backward(self, segment: Segment, j: int, chunk: int, stage: int, reduce_into: str | None) -> list[Instruction]:
        tp = self._tp(stage)
        if reduce_into is None:
            return segment_pass(self.model, segment, "bwd", self.cfg.micro_batch, j, tp, chunk=chunk)
        # The last micro-batch's backward finishes each layer's gradient: reduce it at
        # once on the DP stream while the earlier layers' backward runs (Megatron's
        # --overlap-grad-reduce, one bucket per layer).
        out: list[Instruction] = []
        unit = self.model.unit(segment.unit)
        for layer in reversed(range(*segment.layers)):
            out += segment_pass(self.model, Segment(segment.unit, (layer, layer + 1)), "bwd", self.cfg.micro_batch, j, tp, chunk=chunk)
            params = unit.trainable_params(layer, layer + 1) / self.runs[stage].sharding.devices
            if params:
                handle = f"grad.{segment.unit}.{layer}"
                op_name = dp_grad_op(self.cfg.zero_stage, self.cfg.grad_all_reduce)
                out.append(
                    Collective(
                        op_name,
                        reduce_into,
                        params * self.grad_bytes,
                        "dp",
                        stream="dp",
                        blocking=False,
                        handle=handle,
                        grads_of=(segment.unit, (layer, layer + 1)),
                    )
                )
                self.pending[stage].append(handle)
        return out
