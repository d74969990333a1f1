"""Programs of the Megatron-LM baseline for one fixed choice of degrees.

Two shapes, as the papers describe Megatron-LM on multimodal models:
- a pipeline (GPT/LLM units; MLLMs with the encoder and generator as extra stages or
  merged into the first/last stage), TP inside every stage, DP over replicas;
- colocated towers (CLIP/CoCa/LiT): every device runs both towers with the same TP and DP,
  and the contrastive loss all-gathers both modalities' features over DP (DistMM §7.1).
"""
from __future__ import annotations

from dataclasses import dataclass

from src.cluster import ClusterSpec, family_sharing
from src.costmodel.memory import element_bytes, grad_bytes
from src.models.spec import ModelSpec
from src.program import (BatchSync, Collective, Instruction, Program, RankProgram, Recv, Send, UnitPlan,
                         Work)
from src.schedules.pipeline import PipeOp, build_schedule
from src.strategies.emit import TPConfig, iteration_tail, segment_pass
from src.strategies.layout import Grid, make_group
from src.strategies.stages import Segment, boundary_elems, pipeline_segments, unit_order



@dataclass(frozen=True)
class Degrees:
    tp: int
    pp: int
    dp: int
    vpp: int
    micro_batch: int


@dataclass(frozen=True)
class MegatronSettings:
    schedule: str
    recompute: str
    sequence_parallel: bool
    zero_stage: int
    overlap_grad_reduce: bool
    modality_stages: str
    uneven_pp: bool


def pipeline_program(model: ModelSpec, cluster: ClusterSpec, global_batch: int, precision: str,
                     deg: Degrees, cfg: MegatronSettings) -> tuple[Program, list[UnitPlan], list[list[Segment]]]:
    virtual = pipeline_segments(model, deg.pp, deg.vpp, cfg.modality_stages, cfg.uneven_pp)
    pp, vpp = deg.pp, deg.vpp
    grid = Grid(deg.tp, deg.dp, pp)
    batch_per_replica = global_batch // deg.dp
    microbatches = batch_per_replica // deg.micro_batch
    orders = build_schedule(cfg.schedule, pp, microbatches, vpp)
    program = Program(world_size=grid.size, classes=[])
    pairs = grid.pp_pairs()
    p2p_sharing = family_sharing(cluster, pairs) if pairs else 1
    tp_family, dp_family = grid.tp_family(), grid.dp_family()
    for stage in range(pp):
        tp_name = f"tp.s{stage}" if deg.tp > 1 else None
        dp_name = f"dp.s{stage}" if deg.dp > 1 else None
        if tp_name:
            program.add_group(make_group(cluster, tp_name, grid.tp_group(0, stage), tp_family))
        if dp_name:
            program.add_group(make_group(cluster, dp_name, grid.dp_group(0, stage), dp_family))
        emitter = _StageEmitter(model, virtual, deg, cfg, precision, stage, grid, tp_name, dp_name, p2p_sharing)
        program.classes.append(emitter.rank_program(orders[stage]))

    unit_plans = []
    for name in unit_order(model):
        stages = sorted({v % pp for v, segs in enumerate(virtual) for s in segs if s.unit == name})
        ranges = tuple(s.layers for segs in virtual for s in segs if s.unit == name)
        ranks = tuple(r for st in stages for r in grid.stage_ranks(st))
        unit_plans.append(UnitPlan(unit=name, dp=deg.dp, tp=deg.tp, pp=len(stages), vpp=vpp, ranks=ranks,
                                   micro_batch=deg.micro_batch, num_microbatches=microbatches,
                                   batch_per_replica=batch_per_replica, stage_layers=ranges,
                                   details={"pipeline_stages": stages, "zero_stage": cfg.zero_stage,
                                            "recompute": cfg.recompute}))
    return program, unit_plans, virtual


class _StageEmitter:
    """Turns one pipeline stage's schedule order into its instruction list: receive,
    compute with TP collectives, send, per (chunk, micro-batch); then the iteration's end."""

    def __init__(self, model: ModelSpec, virtual: list[list[Segment]], deg: Degrees, cfg: MegatronSettings,
                 precision: str, stage: int, grid: Grid, tp_group: str | None, dp_group: str | None, sharing: int):
        self.model, self.virtual, self.deg, self.cfg = model, virtual, deg, cfg
        self.stage, self.grid, self.dp_group, self.sharing = stage, grid, dp_group, sharing
        self.act_bytes = element_bytes(precision)
        self.grad_bytes = grad_bytes(precision)
        self.tpc = TPConfig(deg.tp, tp_group, cfg.sequence_parallel, cfg.recompute, self.act_bytes)
        self.prev_rank = grid.rank(0, 0, (stage - 1) % deg.pp)
        self.next_rank = grid.rank(0, 0, (stage + 1) % deg.pp)
        self.needs_bwd = [any(model.needs_backward(seg.unit) for seg in segs) for segs in virtual]
        self.pending: list[str] = []

    def rank_program(self, order: list[PipeOp]) -> RankProgram:
        pp = self.deg.pp
        last_backward = {op.chunk: i for i, op in enumerate(order) if op.kind == "B"}
        instructions: list[Instruction] = []
        for index, op in enumerate(order):
            v = op.chunk * pp + self.stage
            if op.kind == "F":
                instructions += self._forward(v, op)
            elif self.needs_bwd[v]:
                final = index == last_backward[op.chunk]
                overlap = self.cfg.overlap_grad_reduce and self.dp_group is not None and final
                instructions += self._backward(v, op, overlap)
        own = [seg for c in range(self.deg.vpp) for seg in self.virtual[c * pp + self.stage]]
        instructions += iteration_tail(self.model, own, self.deg.tp, self.dp_group, self.deg.dp, self.cfg.zero_stage,
                                       self.grad_bytes, self.act_bytes, self.pending)
        return RankProgram(ranks=self.grid.stage_ranks(self.stage), instructions=instructions,
                           label=f"stage {self.stage}", units=tuple(dict.fromkeys(seg.unit for seg in own)),
                           pipelined=pp > 1)

    def _boundary_bytes(self, v: int) -> float:
        """Bytes of one micro-batch leaving virtual stage v."""
        last = self.virtual[v][-1]
        return boundary_elems(self.model.unit(last.unit), last.layers[1]) * self.deg.micro_batch * self.act_bytes

    def _forward(self, v: int, op: PipeOp) -> list[Instruction]:
        out: list[Instruction] = []
        if v > 0:
            out.append(Recv(self.prev_rank, f"act.v{v}.mb{op.microbatch}", self._boundary_bytes(v - 1), "pp"))
        for segment in self.virtual[v]:
            out += segment_pass(self.model, segment, "fwd", self.deg.micro_batch, op.microbatch, self.tpc, chunk=op.chunk)
        if v < len(self.virtual) - 1:
            out.append(Send(self.next_rank, f"act.v{v + 1}.mb{op.microbatch}", self._boundary_bytes(v), "pp",
                            sharing=self.sharing))
        return out

    def _backward(self, v: int, op: PipeOp, overlap: bool) -> list[Instruction]:
        out: list[Instruction] = []
        mb = self.deg.micro_batch
        if v < len(self.virtual) - 1 and self.needs_bwd[v + 1]:
            out.append(Recv(self.next_rank, f"grad.v{v}.mb{op.microbatch}", self._boundary_bytes(v), "pp"))
        for segment in reversed(self.virtual[v]):
            if not self.model.needs_backward(segment.unit):
                continue
            if not overlap:
                out += segment_pass(self.model, segment, "bwd", mb, op.microbatch, self.tpc, chunk=op.chunk)
                continue
            # The last micro-batch's backward finishes each layer's gradient: reduce it at
            # once on the DP stream while the earlier layers' backward runs (Megatron's
            # --overlap-grad-reduce, one bucket per layer).
            unit = self.model.unit(segment.unit)
            for layer in reversed(range(*segment.layers)):
                out += segment_pass(self.model, Segment(segment.unit, (layer, layer + 1)), "bwd", mb, op.microbatch,
                                    self.tpc, chunk=op.chunk)
                params = unit.trainable_params(layer, layer + 1) / self.deg.tp
                if params:
                    handle = f"grad.{segment.unit}.{layer}"
                    op_name = "reduce_scatter" if self.cfg.zero_stage >= 1 else "all_reduce"
                    out.append(Collective(op_name, self.dp_group, params * self.grad_bytes, "dp", stream="dp",
                                          blocking=False, handle=handle))
                    self.pending.append(handle)
        if v > 0 and self.needs_bwd[v - 1]:
            out.append(Send(self.prev_rank, f"grad.v{v - 1}.mb{op.microbatch}", self._boundary_bytes(v - 1), "pp",
                            sharing=self.sharing))
        return out


def colocated_program(model: ModelSpec, cluster: ClusterSpec, global_batch: int, precision: str,
                      deg: Degrees, cfg: MegatronSettings) -> tuple[Program, list[UnitPlan], list[list[Segment]]]:
    """Both towers on every device, same TP and DP; the contrastive loss sees the features
    of all DP replicas (all-gather over DP, reduce-scatter of their gradients back)."""
    grid = Grid(deg.tp, deg.dp, 1)
    act_bytes = element_bytes(precision)
    batch_per_replica = global_batch // deg.dp
    microbatches = batch_per_replica // deg.micro_batch
    mb = deg.micro_batch
    program = Program(world_size=grid.size, classes=[])
    tp_name = "tp" if deg.tp > 1 else None
    dp_name = "dp" if deg.dp > 1 else None
    if tp_name:
        program.add_group(make_group(cluster, tp_name, grid.tp_group(0, 0), grid.tp_family()))
    if dp_name:
        program.add_group(make_group(cluster, dp_name, grid.dp_group(0, 0), grid.dp_family()))
    tpc = TPConfig(deg.tp, tp_name, cfg.sequence_parallel, cfg.recompute, act_bytes)
    interaction = model.unit(model.interaction)
    towers = [name for name in unit_order(model) if name != model.interaction]
    segments = [Segment(name, (0, model.unit(name).num_layers)) for name in towers]
    feature_elems = sum(model.unit(name).output_elems for name in towers)
    instructions: list[Instruction] = []
    for j in range(microbatches):
        for segment in segments:
            instructions += segment_pass(model, segment, "fwd", mb, j, tpc)
        # Each device scores its local samples of BOTH modalities against the gathered
        # other modality: two similarity products, hence 2·mb rows.
        work = Work(interaction.name, "interaction", len(towers) * mb, (0, interaction.num_layers),
                    contrastive_batch=mb * deg.dp)
        gather = (Collective("all_gather", dp_name, feature_elems * mb * deg.dp * act_bytes, "interaction")
                  if dp_name else None)
        instructions.append(BatchSync((j,), work, gather))
        if dp_name:
            instructions.append(Collective("reduce_scatter", dp_name, feature_elems * mb * deg.dp * act_bytes,
                                           "interaction"))
        for segment in reversed(segments):
            if model.needs_backward(segment.unit):
                instructions += segment_pass(model, segment, "bwd", mb, j, tpc)
    everything = segments + [Segment(interaction.name, (0, interaction.num_layers))]
    instructions += iteration_tail(model, everything, deg.tp, dp_name, deg.dp, cfg.zero_stage, grad_bytes(precision),
                                   act_bytes)
    program.classes.append(RankProgram(ranks=grid.ranks, instructions=instructions, label="all ranks",
                                       units=tuple(towers) + (interaction.name,), pipelined=False))
    unit_plans = [UnitPlan(unit=s.unit, dp=deg.dp, tp=deg.tp, pp=1, ranks=grid.ranks, micro_batch=mb,
                           num_microbatches=microbatches, batch_per_replica=batch_per_replica,
                           stage_layers=(s.layers,), details={"zero_stage": cfg.zero_stage, "recompute": cfg.recompute,
                                                              "placement": "colocated"})
                  for s in everything]
    return program, unit_plans, [everything]

