"""DistTrain's Program: three parallelism units on disjoint GPUs, joined by brokers (§4.1, §7).

Each unit (encoder, LLM, generator) is a pipeline of its own over a (tp, dp, pp) mesh on a
contiguous block of ranks (widest TP first, so no TP group crosses a node), emitted by
strategies.builders.pipeline, with vpp virtual stages per stage where it interleaves.
Together they form one end-to-end 1F1B pipeline (schedules.chain.chain_orders): the encoder's
stages come first, then the LLM's, then the generator's, and every stage runs the
schedule of its position in that pipeline (the encoder's first stage warms up with as
many forwards as the whole depth needs).

A unit replicated over its TP group (profile.Setting.replicated) is emitted as
Megatron-LM's replicated stage (builders.stages.StageRun): each GPU of the group runs its
share of every micro-batch's images, dealt out whole, on the whole unit, its Computes
carrying the load of the busiest GPU's images (loads already are: search.Decision).

Units of different DP meet at brokers: the unit-to-unit hand-off (the models' chain flows,
payload "x") is a route by sample (strategies.builders.bridge) from the upstream unit's last stage
to the downstream unit's first stage. A unit's micro-batch is DP_lm / DP_u sequences, so
with DP_u dividing DP_lm the gcd(DP_a, DP_b) brokers are the leads of the side with fewer
replicas: each gathers its group's rows (fan-in) or scatters them (fan-out) in sample
order. Sends are eager (asynchronous); a receiving replica's lead shares what it got with
its TP peers, and a sending replica replicated over its TP group first all-gathers its GPUs'
shares (each GPU then keeps its own, as every GPU of it reads its micro-batch whole).

Data heterogeneity: a replica of a unit whose micro-batches carry other loads than its
peers' is a rank class of its own, its Computes carrying the load (Work.load) of the
sequences its micro-batches hold, so stragglers and the gaps they leave are simulated
where they occur; replicas alike (the LLM's, every replica under uniform data) share one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from src.batch_layout import BatchLayout
from src.cluster import ClusterSpec
from src.costmodel.memory import element_bytes
from src.mesh import Mesh
from src.models.flows import Flow, flows_of
from src.models.spec import ModelSpec
from src.program import Collective, CollectiveOp, Instruction, Payload, Program, Recv, Send
from src.strategies.builders.bridge import Side, bridge
from src.strategies.builders.layout import axis_group, megatron_mesh
from src.strategies.builders.pipeline import PipelineEmitter, PipelineSettings
from src.strategies.builders.replicas import replica_classes
from src.strategies.builders.stages import Segment
from src.strategies.disttrain.profile import Setting
from src.schedules.chain import Chain, chain_orders


@dataclass(frozen=True)
class UnitLayout:
    """One unit's place in the Program: its degrees, Megatron-LM options, virtual stages'
    layers (pp x vpp, in model order) and micro-batches' loads (loads[replica][microbatch])."""

    unit: str
    dp: int
    pp: int
    micro_batch: int
    setting: Setting
    stages: tuple[tuple[int, int], ...]
    offset: int
    loads: tuple[tuple[float, ...], ...]

    @property
    def tp(self) -> int:
        return self.setting.tp

    @property
    def mesh(self) -> Mesh:
        return megatron_mesh(self.tp, self.dp, self.pp, self.offset)

    @property
    def devices(self) -> int:
        return self.tp * self.dp * self.pp

    def stage_mesh(self, stage: int) -> Mesh:
        """The unit's ranks at one pipeline stage, as a (tp, dp) mesh."""
        return Mesh((("tp", self.tp), ("dp", self.dp)), self.mesh.slice(pp=stage))


def place(units: list[UnitLayout]) -> list[UnitLayout]:
    """Contiguous blocks, widest TP first: every block then starts at a multiple of the
    TP degrees after it (powers of two dividing the node), so no TP group crosses a node."""
    out, offset = [], 0
    for unit in sorted(units, key=lambda u: (-u.tp, -u.devices)):
        out.append(replace(unit, offset=offset))
        offset += unit.devices
    return out


@dataclass(frozen=True)
class Broker:
    """The hand-off between two units: gcd(DP_a, DP_b) brokers on the boundary stages."""

    route: str
    producer: str
    consumer: str
    ranks: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"route": self.route, "count": len(self.ranks), "ranks": list(self.ranks)}


def brokers_of(flow: Flow, src: UnitLayout, dst: UnitLayout) -> Broker:
    """With one DP dividing the other, the gcd brokers are the leads of the side with
    fewer replicas (at its boundary stage): each gathers or scatters its group's rows."""
    if max(src.dp, dst.dp) % min(src.dp, dst.dp):
        raise ValueError(f"{flow.producer} dp={src.dp} and {flow.consumer} dp={dst.dp}: one must divide the other")
    side, stage = (src, src.pp - 1) if src.dp <= dst.dp else (dst, 0)
    mesh = side.stage_mesh(stage)
    count = math.gcd(src.dp, dst.dp)
    return Broker(f"{flow.producer}>{flow.consumer}", flow.producer, flow.consumer, tuple(mesh.rank(dp=d) for d in range(count)))


class _UnitLinks:
    """A unit pipeline's payloads that cross to another unit (the chain's "x" and its
    gradient) go over the broker routes; a receiving replica's lead shares them with
    its TP peers."""

    def __init__(self, builder: "_Builder", unit: UnitLayout) -> None:
        self.builder, self.unit = builder, unit

    def _flow(self, payload: Payload) -> Flow:
        return next(f for f in self.builder.flows if self.unit.unit in (f.producer, f.consumer) and payload.unit == f.producer)

    def _shared(self, op: CollectiveOp, flow: Flow, payload: Payload) -> Collective:
        """The boundary stage's TP group sharing one micro-batch's hand-off."""
        stage = 0 if flow.consumer == self.unit.unit else self.unit.pp - 1
        nbytes = self.unit.micro_batch * flow.elems * self.builder.act_bytes
        return Collective(op, f"{self.unit.unit}.tp.s{stage}", nbytes, "broker", inputs=(payload,), outputs=(payload,))

    def receive(self, payload: Payload) -> list[Instruction]:
        flow = self._flow(payload)
        route = f"{flow.producer}>{flow.consumer}"
        out: list[Instruction] = [Recv(f"{route}.grad" if payload.grad else route, payload)]
        if self.unit.tp > 1:
            out.append(self._shared("broadcast", flow, payload))
        return out

    def send(self, payload: Payload) -> list[Instruction]:
        flow = self._flow(payload)
        route = f"{flow.producer}>{flow.consumer}"
        gathered = [self._shared("all_gather", flow, payload)] if self.unit.setting.replicated else []
        return [*gathered, Send(f"{route}.grad" if payload.grad else route, payload)]


class _Builder:
    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        precision: str,
        global_batch: int,
        microbatches: int,
        units: list[UnitLayout],
        tp_overlap_chunks: int,
    ) -> None:
        self.model, self.cluster, self.precision = model, cluster, precision
        self.batch, self.m = global_batch, microbatches
        self.units = {u.unit: u for u in units}
        self.order = [f.producer for f in flows_of(model)] + [flows_of(model)[-1].consumer]
        self.flows = [f for f in flows_of(model) if f.kind == "chain"]
        self.act_bytes = element_bytes(precision)
        self.chunks = tp_overlap_chunks

    def program(self) -> tuple[Program, list[Broker]]:
        world = sum(u.devices for u in self.units.values())
        program = Program(world_size=world, classes=[])
        brokers = [self._broker_routes(program, flow) for flow in self.flows]
        orders = chain_orders(Chain(tuple((self.units[name].pp, self.units[name].setting.vpp) for name in self.order)), self.m)
        alike = self._alike()
        first = 0
        for name in self.order:
            unit = self.units[name]
            if unit.setting.replicated:  # its hand-offs' group: the emitter splits nothing over it
                axis_group(program, self.cluster, f"{name}.tp.s0", unit.mesh, "tp", unit.mesh.rank(pp=0))
            emitter = PipelineEmitter(
                self.model,
                self.cluster,
                self.precision,
                program,
                unit.mesh,
                [[Segment(name, s)] for s in unit.stages],
                PipelineSettings(
                    unit.micro_batch,
                    unit.setting.recompute,
                    unit.setting.sequence_parallel,
                    unit.setting.zero_stage,
                    tp_overlap_chunks=self.chunks,
                    scatter_gather=unit.setting.scatter_gather,
                    replicate=(name,) if unit.setting.replicated else (),
                ),
                prefix=f"{name}.",
                links=_UnitLinks(self, unit),
            )
            for stage in range(unit.pp):
                built = emitter.stage(stage, orders[first + stage])
                label = unit.unit if unit.pp == 1 else f"{unit.unit} stage {stage}"
                units = tuple(dict.fromkeys(s.unit for s in emitter.segments_of(stage)))
                program.classes += replica_classes(
                    program, unit.mesh, stage, built.instructions(), {unit.unit: unit.loads}, label, units, alike=alike[name]
                )
            first += unit.pp
        return program, brokers

    def _alike(self) -> dict[str, list[tuple]]:
        """Per unit, a key per replica: the loads of every replica of the group of LLM
        replicas it serves that run in step (joined through a shared encoder or generator
        replica). A replica's timing follows the loads of the replicas it waits on, so only
        replicas whose groups carry the same loads are interchangeable."""
        widest = max(u.dp for u in self.units.values())
        shares = {name: widest // u.dp for name, u in self.units.items()}
        width = math.lcm(*shares.values())
        groups = widest // width
        key = [
            tuple(
                tuple(u.loads[d] for d in range(g * width // shares[name], (g + 1) * width // shares[name]))
                for name, u in self.units.items()
            )
            for g in range(groups)
        ]
        return {name: [key[d * shares[name] // width] for d in range(u.dp)] for name, u in self.units.items()}

    def _broker_routes(self, program: Program, flow: Flow) -> Broker:
        src, dst = self.units[flow.producer], self.units[flow.consumer]
        tensor = Payload(flow.producer, flow.source, 0, flow.tensor)
        sender, receiver = (
            Side(unit.stage_mesh(stage), BatchLayout(self.batch, unit.dp, unit.micro_batch, self.m), tensor)
            for unit, stage in ((src, src.pp - 1), (dst, 0))
        )
        for route in bridge(self.cluster, f"{flow.producer}>{flow.consumer}", "broker", sender, receiver, flow.elems * self.act_bytes):
            program.add_route(route)
        return brokers_of(flow, src, dst)


def disttrain_program(
    model: ModelSpec,
    cluster: ClusterSpec,
    precision: str,
    global_batch: int,
    microbatches: int,
    units: list[UnitLayout],
    tp_overlap_chunks: int,
) -> tuple[Program, list[Broker]]:
    return _Builder(model, cluster, precision, global_batch, microbatches, units, tp_overlap_chunks).program()
