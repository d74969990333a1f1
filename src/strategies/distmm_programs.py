"""DistMM's placement (§5.3) and the Programs it emits (§5.4).

Separate placement: every tower takes a contiguous block of ranks, widest TP first, so
TP groups stay inside nodes and towers land on different nodes when their device counts
allow; each device holds one tower's partition plus a shard of the interaction (its
local samples' rows of the similarity matrix). At each batch-sync the towers' last
stages all-gather the OPPOSITE modality's features (one product per device, §5.3.2)
and reduce-scatter their gradients back. Each tower reduces gradients over its own
replicas only (M_g1 and M_g2 on disjoint links instead of M_g1 + M_g2 everywhere).

Colocated placement (the baseline's, `strategy.placement=naive`): every device runs
every tower with the tower's own TP degree, and gathers both modalities' features.

A tower whose layers read another tower's output (CoCa's text decoder cross-attends to
the image tokens) receives it per micro-batch from the producer's last stage and sends
the gradient back ("broker" communication): separate placement pays for it, colocated
placement does not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from src.cluster import ClusterSpec, family_sharing
from src.costmodel.memory import element_bytes, grad_bytes
from src.models.spec import ModelSpec
from src.program import (BatchSync, Collective, Instruction, Program, RankProgram, Recv, Send, UnitPlan, Work,
                         compress_ranks)
from src.schedules.distmm_pipe import SyncOp, build_sync_schedule
from src.strategies.distmm_towers import TowerPlan
from src.strategies.emit import TPConfig, iteration_tail, segment_pass
from src.strategies.layout import Grid, make_group
from src.strategies.stages import Segment, boundary_elems

INTERACTION_GROUP = "interaction"


@dataclass(frozen=True)
class Placed:
    """A tower plan at its ranks: grid order TP fastest, then replicas, then stages."""

    plan: TowerPlan
    offset: int

    @property
    def grid(self) -> Grid:
        return Grid(self.plan.tp, self.plan.replicas, self.plan.pp, self.offset)

    def last_stage_rank(self) -> int:
        return self.grid.rank(0, 0, self.plan.pp - 1)


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


@dataclass(frozen=True)
class CrossInput:
    """`consumer`'s layers from `layer` on read `producer`'s final hidden states
    (`elems` per sample)."""

    producer: str
    consumer: str
    layer: int
    elems: int


def cross_inputs(model: ModelSpec, towers: list[str]) -> list[CrossInput]:
    """Tower-to-tower flows; the consumer's first cross-attention layer is where it needs
    the producer's tokens (kernels named xattn_* by models.layers)."""
    out = []
    for producer, consumer in model.flows:
        if producer in towers and consumer in towers:
            unit, source = model.unit(consumer), model.unit(producer)
            layer = next((i for i, lay in enumerate(unit.layers) if any(k.name.startswith("xattn_")
                                                                          for k in lay.kernels)), 0)
            out.append(CrossInput(producer, consumer, layer, source.seq_len * source.hidden))
    return out


def _needed(index: int, mine: int, theirs: int) -> int:
    """The other tower's micro-batch (within the group) whose completion covers my
    micro-batch `index` of `mine`, when the other splits the same samples into `theirs`."""
    return math.ceil((index + 1) * theirs / mine) - 1


class _Emitter:
    """Builds the separate-placement Program, one RankProgram per (tower, stage)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, precision: str, contrastive_batch: int,
                 placed: list[Placed]):
        self.model, self.cluster, self.precision = model, cluster, precision
        self.rbs = contrastive_batch
        self.placed = {p.plan.unit: p for p in placed}
        self.act_bytes = element_bytes(precision)
        self.inter = model.unit(model.interaction)
        towers = list(self.placed)
        self.cross = cross_inputs(model, towers)
        # Each device gathers the features of the towers it does not hold.
        widest = max(sum(model.unit(o).output_elems for o in towers if o != t) for t in towers)
        self.gather_bytes = self.rbs * widest * self.act_bytes

    def program(self, world: int) -> Program:
        program = Program(world_size=world, classes=[])
        holders = tuple(sorted(r for p in self.placed.values() for r in p.grid.stage_ranks(p.plan.pp - 1)))
        program.add_group(make_group(self.cluster, INTERACTION_GROUP, holders, [holders]))
        for placed in self.placed.values():
            for stage in range(placed.plan.pp):
                program.classes.append(self._stage(program, placed, stage))
        used = {r for c in program.classes for r in c.ranks}
        idle = tuple(r for r in range(world) if r not in used)
        if idle:
            program.classes.append(RankProgram(ranks=idle, instructions=[], label="idle"))
        return program

    # ---- one (tower, stage) ---------------------------------------------------------------
    def _stage(self, program: Program, placed: Placed, stage: int) -> RankProgram:
        plan, grid = placed.plan, placed.grid
        unit = self.model.unit(plan.unit)
        tp_name = dp_name = None
        if plan.tp > 1:
            tp_name = f"{unit.name}.tp.s{stage}"
            program.add_group(make_group(self.cluster, tp_name, grid.tp_group(0, stage), grid.tp_family()))
        if plan.replicas > 1:
            dp_name = f"{unit.name}.dp.s{stage}"
            program.add_group(make_group(self.cluster, dp_name, grid.dp_group(0, stage), grid.dp_family()))
        tpc = TPConfig(plan.tp, tp_name, False, plan.recompute, self.act_bytes)
        last = stage == plan.pp - 1
        instructions: list[Instruction] = []
        for op in build_sync_schedule(plan.schedule, plan.pp, plan.groups, plan.microbatches)[stage]:
            if op.kind == "F":
                instructions += self._forward(placed, stage, op, tpc)
            elif op.kind == "S":
                instructions += self._batch_sync(plan, op)
            elif self.model.needs_backward(unit.name):
                instructions += self._backward(placed, stage, op, tpc)
        segments = [Segment(unit.name, plan.stages[stage])]
        if last:
            segments.append(Segment(self.inter.name, (0, self.inter.num_layers)))
        instructions += iteration_tail(self.model, segments, plan.tp, dp_name, plan.replicas, plan.zero_stage,
                                       grad_bytes(self.precision), self.act_bytes)
        units = (unit.name, self.inter.name) if last else (unit.name,)
        label = unit.name if plan.pp == 1 else f"{unit.name} stage {stage}"
        return RankProgram(ranks=grid.stage_ranks(stage), instructions=instructions, label=label, units=units,
                           pipelined=plan.pp > 1)

    def _segments(self, plan: TowerPlan, stage: int) -> tuple[list[Segment], CrossInput | None]:
        """The stage's layers, cut where a cross input enters (if it enters here)."""
        start, end = plan.stages[stage]
        for cross in self.cross:
            if cross.consumer == plan.unit and start <= cross.layer < end:
                cut = [Segment(plan.unit, r) for r in ((start, cross.layer), (cross.layer, end)) if r[0] < r[1]]
                return cut, cross
        return [Segment(plan.unit, (start, end))], None

    def _hop(self, placed: Placed, stage: int, micro_batch: int) -> tuple[float, int]:
        unit = self.model.unit(placed.plan.unit)
        elems = boundary_elems(unit, placed.plan.stages[stage][1])
        return elems * micro_batch * self.act_bytes, family_sharing(self.cluster, placed.grid.pp_pairs())

    def _forward(self, placed: Placed, stage: int, op: SyncOp, tpc: TPConfig) -> list[Instruction]:
        plan, grid = placed.plan, placed.grid
        mb, name = plan.micro_batch, plan.unit
        out: list[Instruction] = []
        if stage > 0:
            nbytes, _ = self._hop(placed, stage - 1, mb)
            out.append(Recv(grid.rank(0, 0, stage - 1), f"{name}.act.s{stage}.mb{op.microbatch}", nbytes, "pp"))
        segments, cross = self._segments(plan, stage)
        for segment in segments:
            if cross is not None and segment.layers[0] == cross.layer:
                out += self._recv_tokens(cross, op)
            out += segment_pass(self.model, segment, "fwd", mb, op.microbatch, tpc)
        if stage < plan.pp - 1:
            nbytes, sharing = self._hop(placed, stage, mb)
            out.append(Send(grid.rank(0, 0, stage + 1), f"{name}.act.s{stage + 1}.mb{op.microbatch}", nbytes, "pp",
                            sharing=sharing))
        else:
            out += self._send_tokens(name, op)
        return out

    def _backward(self, placed: Placed, stage: int, op: SyncOp, tpc: TPConfig) -> list[Instruction]:
        plan, grid = placed.plan, placed.grid
        mb, name = plan.micro_batch, plan.unit
        out: list[Instruction] = []
        if stage == plan.pp - 1:
            out += self._recv_grads(name, op)
        else:
            nbytes, _ = self._hop(placed, stage, mb)
            out.append(Recv(grid.rank(0, 0, stage + 1), f"{name}.grad.s{stage}.mb{op.microbatch}", nbytes, "pp"))
        segments, cross = self._segments(plan, stage)
        for segment in reversed(segments):
            out += segment_pass(self.model, segment, "bwd", mb, op.microbatch, tpc)
            if cross is not None and segment.layers[0] == cross.layer:
                out += self._send_grads(cross, op)
        if stage > 0:
            nbytes, sharing = self._hop(placed, stage - 1, mb)
            out.append(Send(grid.rank(0, 0, stage - 1), f"{name}.grad.s{stage - 1}.mb{op.microbatch}", nbytes, "pp",
                            sharing=sharing))
        return out

    def _batch_sync(self, plan: TowerPlan, op: SyncOp) -> list[Instruction]:
        """Gather the group's features of the other modality, run the interaction's
        forward and backward once on this device's rows (its samples, split over its TP
        ranks) against the whole contrastive batch, reduce-scatter the gradients back."""
        k = plan.microbatches
        rows = math.ceil(plan.share / plan.tp)
        work = Work(self.inter.name, "interaction", rows, (0, self.inter.num_layers), contrastive_batch=self.rbs)
        gather = Collective("all_gather", INTERACTION_GROUP, self.gather_bytes, "interaction")
        return [BatchSync(tuple(range(op.group * k, (op.group + 1) * k)), work, gather),
                Collective("reduce_scatter", INTERACTION_GROUP, self.gather_bytes, "interaction")]

    # ---- tower-to-tower inputs (CoCa) -----------------------------------------------------
    def _transfer(self, cross: CrossInput, backward: bool) -> tuple[Placed, Placed, float, int]:
        """Producer, consumer, bytes of one message, and how many such messages cross the
        busier node's network links at once. Forward, every producer replica sends one
        micro-batch's output and each consumer replica takes in those of r_p/r_c
        producers (fan-in); backward, every consumer replica returns one micro-batch's
        gradients and each producer replica takes in its own samples' share."""
        src, dst = self.placed[cross.producer], self.placed[cross.consumer]
        node = self.cluster.devices_per_node
        # One rank per TP group moves the data; its peers share it over NVLink.
        src_node = max(1, min(src.plan.replicas, node // src.plan.tp))
        dst_node = max(1, min(dst.plan.replicas, node // dst.plan.tp))
        src_mb, dst_mb = src.plan.micro_batch, dst.plan.micro_batch
        if backward:
            sharing = max(dst_node, math.ceil(src_node * src_mb / dst_mb))
            return src, dst, cross.elems * dst_mb * self.act_bytes, sharing
        sharing = max(src_node, math.ceil(dst_node * src.plan.replicas / dst.plan.replicas))
        return src, dst, cross.elems * src_mb * self.act_bytes, sharing

    def _cross_rank(self, placed: Placed, unit_layer: int) -> int:
        stage = next(s for s, (a, b) in enumerate(placed.plan.stages) if a <= unit_layer < b)
        return placed.grid.rank(0, 0, stage)

    def _send_tokens(self, unit: str, op: SyncOp) -> list[Instruction]:
        """A producer's last stage, after a forward, sends its output to each consumer."""
        out: list[Instruction] = []
        for cross in (c for c in self.cross if c.producer == unit):
            _, dst, nbytes, sharing = self._transfer(cross, backward=False)
            out.append(Send(self._cross_rank(dst, cross.layer), f"{cross.producer}>{cross.consumer}.x.mb{op.microbatch}",
                            nbytes, "broker", sharing=sharing))
        return out

    def _send_grads(self, cross: CrossInput, op: SyncOp) -> list[Instruction]:
        """The consumer's cross stage, after a backward, returns the input's gradient."""
        if not self.model.needs_backward(cross.producer):
            return []
        src, _, nbytes, sharing = self._transfer(cross, backward=True)
        return [Send(src.last_stage_rank(), f"{cross.producer}>{cross.consumer}.g.mb{op.microbatch}", nbytes,
                     "broker", sharing=sharing)]

    def _recv_tokens(self, cross: CrossInput, op: SyncOp) -> list[Instruction]:
        """Before a consumer micro-batch, receive every producer micro-batch of the group
        that it is the first to need."""
        src, dst, nbytes, _ = self._transfer(cross, backward=False)
        return [Recv(src.last_stage_rank(), f"{cross.producer}>{cross.consumer}.x.mb{index}", nbytes, "broker")
                for index in self._newly_needed(op, dst.plan.microbatches, src.plan.microbatches)]

    def _recv_grads(self, unit: str, op: SyncOp) -> list[Instruction]:
        """Before a producer backward, receive every consumer gradient message of the group
        that it is the first to need."""
        out: list[Instruction] = []
        for cross in (c for c in self.cross if c.producer == unit and self.model.needs_backward(unit)):
            src, dst, nbytes, _ = self._transfer(cross, backward=True)
            out += [Recv(self._cross_rank(dst, cross.layer), f"{cross.producer}>{cross.consumer}.g.mb{index}", nbytes,
                         "broker")
                    for index in self._newly_needed(op, src.plan.microbatches, dst.plan.microbatches)]
        return out

    @staticmethod
    def _newly_needed(op: SyncOp, mine: int, theirs: int) -> range:
        """The other tower's micro-batches (global indices) that my micro-batch `op` needs
        and my previous micro-batch of the group did not; the last of the group takes any
        remainder, so every message is received once."""
        local = op.microbatch - op.group * mine
        first = 0 if local == 0 else _needed(local - 1, mine, theirs) + 1
        last = theirs - 1 if local == mine - 1 else _needed(local, mine, theirs)
        return range(op.group * theirs + first, op.group * theirs + last + 1)


def separate_program(model: ModelSpec, cluster: ClusterSpec, precision: str, contrastive_batch: int,
                     placed: list[Placed]) -> Program:
    return _Emitter(model, cluster, precision, contrastive_batch, placed).program(cluster.devices)


def colocated_program(model: ModelSpec, cluster: ClusterSpec, precision: str, contrastive_batch: int,
                      plans: list[TowerPlan]) -> Program:
    """Every device runs every tower (each with its own TP degree over all devices, no
    pipeline); the interaction gathers both modalities' features, as the baseline does."""
    act_bytes = element_bytes(precision)
    inter = model.unit(model.interaction)
    program = Program(world_size=cluster.devices, classes=[])
    ranks = tuple(range(cluster.devices))
    program.add_group(make_group(cluster, INTERACTION_GROUP, ranks, [ranks]))
    tpcs, dps = {}, {}
    for plan in plans:
        grid = Grid(plan.tp, plan.replicas, 1)
        tp_name = f"{plan.unit}.tp" if plan.tp > 1 else None
        dps[plan.unit] = f"{plan.unit}.dp" if plan.replicas > 1 else None
        if tp_name:
            program.add_group(make_group(cluster, tp_name, grid.tp_group(0, 0), grid.tp_family()))
        if dps[plan.unit]:
            program.add_group(make_group(cluster, dps[plan.unit], grid.dp_group(0, 0), grid.dp_family()))
        tpcs[plan.unit] = TPConfig(plan.tp, tp_name, False, plan.recompute, act_bytes)
    gather_bytes = contrastive_batch * sum(model.unit(p.unit).output_elems for p in plans) * act_bytes
    rows = sum(math.ceil(p.share / p.tp) for p in plans)
    instructions: list[Instruction] = []
    for g in range(plans[0].groups):
        for plan in plans:
            instructions += segment_pass(model, Segment(plan.unit, (0, model.unit(plan.unit).num_layers)), "fwd",
                                         plan.share, g, tpcs[plan.unit])
        work = Work(inter.name, "interaction", rows, (0, inter.num_layers), contrastive_batch=contrastive_batch)
        instructions += [BatchSync((g,), work, Collective("all_gather", INTERACTION_GROUP, gather_bytes, "interaction")),
                         Collective("reduce_scatter", INTERACTION_GROUP, gather_bytes, "interaction")]
        for plan in reversed(plans):
            if model.needs_backward(plan.unit):
                instructions += segment_pass(model, Segment(plan.unit, (0, model.unit(plan.unit).num_layers)), "bwd",
                                             plan.share, g, tpcs[plan.unit])
    for plan in plans:
        segments = [Segment(plan.unit, (0, model.unit(plan.unit).num_layers))]
        if plan is plans[-1]:
            segments.append(Segment(inter.name, (0, inter.num_layers)))
        instructions += iteration_tail(model, segments, plan.tp, dps[plan.unit], plan.replicas, plan.zero_stage,
                                       grad_bytes(precision), act_bytes)
    program.classes.append(RankProgram(ranks=ranks, instructions=instructions, label="all ranks",
                                       units=tuple(p.unit for p in plans) + (inter.name,)))
    return program


def unit_plans(model: ModelSpec, cluster: ClusterSpec, contrastive_batch: int, placed: list[Placed],
               colocated: bool) -> list[UnitPlan]:
    """What the summary reports per unit: degrees, ranks, batches, nodes, settings."""
    out = []
    for p in placed:
        plan = p.plan
        ranks = tuple(range(cluster.devices)) if colocated else p.grid.ranks
        out.append(UnitPlan(unit=plan.unit, dp=plan.replicas, tp=plan.tp, pp=plan.pp, ranks=ranks,
                            micro_batch=plan.micro_batch, num_microbatches=plan.groups * plan.microbatches,
                            batch_per_replica=plan.batch, stage_layers=plan.stages,
                            details={"nodes": nodes_of(cluster, ranks), "placement": "colocated" if colocated
                                     else "separate", "batch_sync_groups": plan.groups,
                                     "schedule": plan.schedule if plan.pp > 1 else "batch_sync",
                                     "recompute": plan.recompute, "zero_stage": plan.zero_stage}))
    inter = model.unit(model.interaction)
    holders = tuple(sorted({r for u in out for r in u.ranks} if colocated else
                           {r for p in placed for r in p.grid.stage_ranks(p.plan.pp - 1)}))
    global_batch = placed[0].plan.batch * placed[0].plan.replicas
    # The interaction's model FLOPs are those of one similarity matrix over the global
    # batch (metrics counts dp x batch_per_replica samples): one "replica" of it.
    out.append(UnitPlan(unit=inter.name, dp=1, tp=1, pp=1, ranks=holders, micro_batch=contrastive_batch,
                        num_microbatches=placed[0].plan.groups, batch_per_replica=global_batch,
                        stage_layers=((0, inter.num_layers),),
                        details={"nodes": nodes_of(cluster, holders), "shards": len(holders),
                                 "placement": "colocated" if colocated else "separate"}))
    return out
