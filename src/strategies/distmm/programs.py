"""DistMM's placement (§5.3) and the Programs it emits (§5.4).

Separate placement: every tower takes a contiguous block of ranks, widest TP first, so
TP groups stay inside nodes and towers land on different nodes when their device counts
allow; each tower is a pipeline of its own (strategies.builders.pipeline) run in a batch-sync
schedule. Each device of a tower's last stage scores its share of the contrastive batch
(its rows, split over its TP ranks) against the OTHER modality's whole batch (one product
per device, §5.3.2): at each batch-sync one all-to-all over every scorer of both towers
brings each the other modality's whole contrastive batch, and the reverse all-to-all
returns each row's gradient to its scorer, where the gradients are summed
(strategies.builders.contrastive). Each tower reduces gradients over its own replicas only (M_g1 and M_g2 on
disjoint links instead of M_g1 + M_g2 everywhere); the interaction's own parameter is
reduced over all its scorers.

Colocated placement (the baseline's, `strategy.placement=naive`): every device runs
every tower with the tower's own TP degree, and gathers both modalities' features.

A tower whose layers read another tower's output (CoCa's text decoder cross-attends to
the image tokens) receives it per micro-batch from the producer's last stage over a
route, by sample (a consumer micro-batch takes rows of several producer micro-batches,
or part of one), and sends the gradient back ("broker" communication): separate
placement pays for it, colocated placement does not.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from src.cluster import ClusterSpec
from src.costmodel.memory import element_bytes, grad_bytes, weight_bytes
from src.mesh import Mesh, Sharding
from src.models.flows import Flow, feature_boundary, flows_of
from src.models.spec import ModelSpec
from src.program import (
    Collective,
    CollectiveOp,
    CommKind,
    Instruction,
    Message,
    Payload,
    Program,
    RankProgram,
    Recv,
    Send,
    UnitPlan,
    compress_ranks,
)
from src.schedules.distmm_pipe import SyncOp, build_sync_schedule
from src.strategies.builders.bridge import Side, bridge
from src.strategies.builders.colocated import ColocatedEmitter, ColocatedUnit
from src.strategies.builders.contrastive import (
    Holder,
    batch_sync_features,
    batch_sync_gradients,
    interaction_compute,
    interaction_of,
    keys,
    local_queries,
    queries,
    query_gradients,
)
from src.strategies.distmm.towers import TowerPlan
from src.strategies.builders.emit import iteration_tail
from src.strategies.builders.layout import make_group, megatron_mesh, table
from src.strategies.builders.pipeline import PipelineEmitter, PipelineSettings
from src.strategies.builders.stages import Segment

INTERACTION_GROUP = "interaction"
EXCHANGE = "batch_sync"


@dataclass(frozen=True)
class Placed:
    """A tower plan at its ranks: mesh order TP fastest, then replicas, then stages."""

    plan: TowerPlan
    offset: int

    @property
    def mesh(self) -> Mesh:
        return megatron_mesh(self.plan.tp, self.plan.replicas, self.plan.pp, self.offset)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return self.mesh.slice(pp=stage)

    def feature_stage(self, model: ModelSpec) -> int:
        """The stage whose layers make the tower's contrastive feature (it scores its rows)."""
        layer = feature_boundary(model.unit(self.plan.unit)) - 1
        return next(s for s, (a, b) in enumerate(self.plan.stages) if a <= layer < b)


def place(plans: list[TowerPlan]) -> list[Placed]:
    """Contiguous blocks, widest TP first: every block then starts at a multiple of the
    TP degrees after it (powers of two dividing the node), so no TP group crosses a node."""
    placed, offset = [], 0
    for plan in sorted(plans, key=lambda p: (-p.tp, -p.devices)):
        placed.append(Placed(plan, offset))
        offset += plan.devices
    return placed


def nodes_of(cluster: ClusterSpec, ranks: tuple[int, ...]) -> str:
    return compress_ranks(tuple(sorted({cluster.node_of(r) for r in ranks})))


def scorers(model: ModelSpec, placed: list[Placed]) -> tuple[int, ...]:
    """The ranks that score rows of the contrastive batch: each tower's feature stage."""
    return tuple(sorted(r for p in placed for r in p.stage_ranks(p.feature_stage(model))))


def cross_flows(model: ModelSpec, towers: list[str]) -> list[Flow]:
    """Tower-to-tower flows (a consumer cross-attending to a producer's tokens)."""
    return [f for f in flows_of(model) if f.kind == "cross" and f.producer in towers and f.consumer in towers]


class _Separate:
    """Builds the separate-placement Program: one pipeline per tower, linked by routes."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, precision: str, contrastive_batch: int, placed: list[Placed]):
        self.model, self.cluster, self.precision = model, cluster, precision
        self.rbs = contrastive_batch
        self.placed = {p.plan.unit: p for p in placed}
        self.act_bytes = element_bytes(precision)
        self.inter = model.unit(interaction_of(model))
        self.cross = cross_flows(model, list(self.placed))
        first = next(iter(self.placed.values())).plan
        self.groups = first.groups
        self._holders: dict[int, list[Holder]] = {}

    def program(self, world: int) -> Program:
        program = Program(world_size=world, classes=[])
        holders = self.holders()
        program.add_group(make_group(self.cluster, INTERACTION_GROUP, holders, [holders]))
        self._exchange_routes(program)
        for flow in self.cross:
            self._cross_routes(program, flow)
        for placed in self.placed.values():
            plan = placed.plan
            emitter = PipelineEmitter(
                self.model,
                self.cluster,
                self.precision,
                program,
                placed.mesh,
                self._virtual(plan),
                PipelineSettings(plan.micro_batch, plan.recompute, False, plan.zero_stage),
                prefix=f"{plan.unit}.",
                links=_TowerLinks(self, plan),
            )
            scoring = placed.feature_stage(self.model)
            orders = build_sync_schedule(plan.schedule, plan.pp, plan.groups, plan.microbatches, scoring)
            for stage in range(plan.pp):
                built = emitter.stage(stage, orders[stage], other=functools.partial(self._batch_sync, placed))
                if stage == scoring:
                    built.tail += self._interaction_tail()
                label = plan.unit if plan.pp == 1 else f"{plan.unit} stage {stage}"
                program.classes.append(emitter.rank_program(built, label, (self.inter.name,) if stage == scoring else ()))
        used = {r for c in program.classes for r in c.ranks}
        idle = tuple(r for r in range(world) if r not in used)
        if idle:
            program.classes.append(RankProgram(ranks=idle, instructions=[], label="idle"))
        return program

    def holders(self) -> tuple[int, ...]:
        return scorers(self.model, list(self.placed.values()))

    def _virtual(self, plan: TowerPlan) -> list[list[Segment]]:
        """A tower's pipeline stages, each cut where a cross input enters it, so the
        tokens are received right before the layers that read them."""
        out = []
        for start, end in plan.stages:
            cuts = sorted({start, end} | {f.layer for f in self.cross if f.consumer == plan.unit and start < f.layer < end})
            out.append([Segment(plan.unit, (a, b)) for a, b in zip(cuts, cuts[1:])])
        return out

    # ---- the batch-sync ----------------------------------------------------------------------
    def _scorers(self, group: int) -> list[Holder]:
        """Who scores which rows of contrastive batch `group`: replica d of a tower holds
        rows [d·share, (d+1)·share), its TP ranks split them."""
        holders = []
        for tower, placed in self.placed.items():
            plan = placed.plan
            per_rank = math.ceil(plan.share / plan.tp)
            for replica in range(plan.replicas):
                pieces = tuple(
                    (group * plan.microbatches + i, replica * plan.share + i * plan.micro_batch, plan.micro_batch)
                    for i in range(plan.microbatches)
                )
                stage = placed.feature_stage(self.model)
                lead = placed.mesh.rank(dp=replica, pp=stage)
                for t in range(plan.tp):
                    start = min(plan.share, t * per_rank)
                    end = min(plan.share, start + per_rank)
                    rank = placed.mesh.rank(tp=t, dp=replica, pp=stage)
                    holders.append(Holder(rank, tower, replica * plan.share + start, replica * plan.share + end, pieces, lead))
        return holders

    def _exchange_routes(self, program: Program) -> None:
        """The batch-sync's local routes (the collectives do the rest): each scorer copies
        its rows into its queries, and returns their summed gradient to its features on
        itself and its TP peers."""
        forward: list[Message] = []
        backward: list[Message] = []
        for group in range(self.groups):
            holders = self._scorers(group)
            forward += local_queries(self.model, group, holders, self.act_bytes)
            backward += query_gradients(self.model, group, holders, self.act_bytes)
        program.add_route(table(self.cluster, EXCHANGE, "interaction", forward))
        program.add_route(table(self.cluster, f"{EXCHANGE}.grad", "interaction", backward))

    def shared(
        self, unit: str, stage: int, payload: Payload, nbytes: float, kind: CommKind, op: CollectiveOp = "broadcast"
    ) -> list[Instruction]:
        """What one rank of a replica received (or summed), made every TP rank's."""
        if self.placed[unit].plan.tp == 1:
            return []
        return [Collective(op, f"{unit}.tp.s{stage}", nbytes, kind, inputs=(payload,), outputs=(payload,))]

    def _batch_sync(self, placed: Placed, op: SyncOp) -> list[Instruction]:
        """Take this rank's rows into its queries, exchange them for the other towers'
        whole contrastive batches (all-to-all over all scorers), score this rank's rows
        against them, return the key gradients to the rows' scorers (the reverse
        all-to-all) and the rows' gradient to the features (on this rank and its TP peers)."""
        plan = placed.plan
        towers = list(self.placed)
        inter = self.inter.name
        mine = queries(inter, plan.unit, op.group)
        theirs = tuple(keys(inter, t, op.group) for t in towers if t != plan.unit)
        holders = self._holders.get(op.group)
        if holders is None:
            holders = self._holders[op.group] = self._scorers(op.group)
        out: list[Instruction] = [
            Recv(EXCHANGE, mine),
            batch_sync_features(self.model, INTERACTION_GROUP, plan.unit, towers, op.group, holders, self.act_bytes),
            interaction_compute(self.model, (mine, *theirs), op.group, math.ceil(plan.share / plan.tp), self.rbs),
        ]
        scatter = batch_sync_gradients(self.model, INTERACTION_GROUP, plan.unit, towers, op.group, holders, self.act_bytes)
        if scatter is not None:
            out.append(scatter)
        if self.model.needs_backward(plan.unit):
            out.append(Send(f"{EXCHANGE}.grad", mine.gradient()))
        return out

    def _interaction_tail(self) -> list[Instruction]:
        """The interaction's parameter: every scorer holds it, each computed a part of its
        gradient, so it is reduced over all of them before the step."""
        whole = Segment(self.inter.name, (0, self.inter.num_layers))
        holders = len(self.holders())
        return iteration_tail(
            self.model,
            [whole],
            Sharding(),
            INTERACTION_GROUP if holders > 1 else None,
            holders,
            0,
            grad_bytes(self.precision),
            weight_bytes(self.precision, self.cluster.amp),
        )

    # ---- tower-to-tower inputs (CoCa) ---------------------------------------------------------
    def _cross_routes(self, program: Program, flow: Flow) -> None:
        """The producer's last stage sends its tokens to the consumer's cross stage, by
        sample (strategies.builders.bridge); each side's TP ranks share what their lead received."""
        src, dst = self.placed[flow.producer], self.placed[flow.consumer]
        cross_stage = next(s for s, (a, b) in enumerate(dst.plan.stages) if a <= flow.layer < b)
        tokens = Payload(flow.producer, self.model.unit(flow.producer).num_layers, 0, "tokens")
        ends = [
            Side(_stage_mesh(placed, stage), placed.plan.batch_layout(), tokens)
            for placed, stage in ((src, src.plan.pp - 1), (dst, cross_stage))
        ]
        sender, receiver = ends
        for route in bridge(
            self.cluster,
            f"{flow.producer}>{flow.consumer}",
            "broker",
            sender,
            receiver,
            flow.elems * self.act_bytes,
        ):
            program.add_route(route)


def _stage_mesh(placed: Placed, stage: int) -> Mesh:
    """A tower's ranks at one pipeline stage, as a (tp, dp) mesh."""
    plan = placed.plan
    return Mesh((("tp", plan.tp), ("dp", plan.replicas)), placed.stage_ranks(stage))


class _TowerLinks:
    """A tower pipeline's payloads that leave it: its features (to the batch-sync), its
    tokens (to a cross-attending tower) and the tokens it reads, with their gradients.
    One rank of a replica receives; its TP ranks share what it received."""

    def __init__(self, builder: "_Separate", plan: TowerPlan) -> None:
        self.builder, self.plan = builder, plan

    def _route(self, payload: Payload) -> tuple[str, CommKind, int, float]:
        """Route, kind, stage and bytes of a payload (at this tower's micro-batch)."""
        model, plan = self.builder.model, self.plan
        act = self.builder.act_bytes
        if payload.tensor == "feature":
            elems = model.unit(plan.unit).output_elems
            stage = self.builder.placed[plan.unit].feature_stage(model)
            return EXCHANGE, "interaction", stage, plan.micro_batch * elems * act
        flow = next(f for f in self.builder.cross if f.producer == payload.unit)
        stage = plan.pp - 1 if flow.producer == plan.unit else next(s for s, (a, b) in enumerate(plan.stages) if a <= flow.layer < b)
        return f"{flow.producer}>{flow.consumer}", "broker", stage, plan.micro_batch * flow.elems * act

    def receive(self, payload: Payload) -> list[Instruction]:
        route, kind, stage, nbytes = self._route(payload)
        received: list[Instruction] = [Recv(f"{route}.grad" if payload.grad else route, payload)]
        if payload.tensor == "feature":
            return received  # every TP rank receives its features' gradient itself
        return received + self.builder.shared(self.plan.unit, stage, payload, nbytes, kind)

    def send(self, payload: Payload) -> list[Instruction]:
        route, *_ = self._route(payload)
        return [Send(f"{route}.grad" if payload.grad else route, payload)]


def separate_program(model: ModelSpec, cluster: ClusterSpec, precision: str, contrastive_batch: int, placed: list[Placed]) -> Program:
    return _Separate(model, cluster, precision, contrastive_batch, placed).program(cluster.devices)


def colocated_program(
    model: ModelSpec, cluster: ClusterSpec, precision: str, contrastive_batch: int, plans: list[TowerPlan]
) -> Program:
    """Every device runs every tower (each with its own TP degree over all devices, no
    pipeline); the interaction gathers both modalities' features, as the baseline does."""
    program = Program(world_size=cluster.devices, classes=[])
    ranks = tuple(range(cluster.devices))
    program.add_group(make_group(cluster, INTERACTION_GROUP, ranks, [ranks]))
    units = [
        ColocatedUnit(p.unit, _colocated_mesh(p, cluster.devices), p.recompute, p.zero_stage, group_prefix=f"{p.unit}.") for p in plans
    ]
    # The interaction's parameter steps with the last tower's.
    units.append(
        ColocatedUnit(
            interaction_of(model), units[-1].mesh, plans[-1].recompute, plans[-1].zero_stage, group_prefix=f"{plans[-1].unit}."
        )
    )
    emitter = ColocatedEmitter(model, cluster, precision, program, units)
    share = {p.unit: p.share for p in plans}
    emitter.query_routes(plans[0].groups, share, share, with_keys=False)
    rows = sum(math.ceil(p.share / p.tp) for p in plans)
    instructions: list[Instruction] = []
    for g in range(plans[0].groups):
        interaction = emitter.contrastive(g, INTERACTION_GROUP, contrastive_batch, rows, contrastive_batch)
        instructions += emitter.microbatch(g, share, interaction)
    instructions += emitter.tail()
    program.classes.append(emitter.rank_program(instructions))
    return program


def _colocated_mesh(plan: TowerPlan, devices: int) -> Mesh:
    return Mesh.contiguous((("tp", plan.tp), ("dp", devices // plan.tp)))


def unit_plans(
    model: ModelSpec, cluster: ClusterSpec, contrastive_batch: int, placed: list[Placed], colocated: bool
) -> list[UnitPlan]:
    """What the summary reports per unit: degrees, ranks, batches, nodes, settings."""
    out = []
    for p in placed:
        plan = p.plan
        mesh = _colocated_mesh(plan, cluster.devices) if colocated else p.mesh
        out.append(
            UnitPlan(
                unit=plan.unit,
                mesh=mesh,
                micro_batch=plan.micro_batch,
                num_microbatches=plan.groups * plan.microbatches,
                batch_per_replica=plan.batch,
                stage_layers=plan.stages,
                sample_groups=plan.groups,
                recompute=plan.recompute,
                zero_stage=plan.zero_stage,
                details={
                    "nodes": nodes_of(cluster, mesh.ranks),
                    "placement": "colocated" if colocated else "separate",
                    "schedule": plan.schedule if plan.pp > 1 else "batch_sync",
                },
            )
        )
    inter = model.unit(interaction_of(model))
    global_batch = placed[0].plan.batch * placed[0].plan.replicas
    groups = placed[0].plan.groups
    if colocated:
        mesh = out[-1].mesh
    else:
        holders = scorers(model, placed)
        mesh = Mesh((("dp", len(holders)),), holders)
    # Every scorer holds the interaction's parameter: its replicas are its scorers.
    out.append(
        UnitPlan(
            unit=inter.name,
            mesh=mesh,
            micro_batch=contrastive_batch,
            num_microbatches=groups,
            batch_per_replica=global_batch,
            stage_layers=((0, inter.num_layers),),
            sample_groups=groups,
            details={
                "nodes": nodes_of(cluster, mesh.ranks),
                "shards": len(mesh.ranks),
                "placement": "colocated" if colocated else "separate",
            },
        )
    )
    return out
