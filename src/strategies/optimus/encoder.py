"""Optimus's encoders colocated with the LLM (Optimus §3.1, §4.1, §4.4): where each encoder
pipeline sits on the LLM's devices, and what its work costs, kernel by kernel.

Layout. The LLM is Megatron's (tp, dp, pp) mesh. An encoder plan (PP_enc | PP_llm,
TP_enc | TP_llm) cuts every LLM pipeline into m = (PP_llm/PP_enc)·(TP_llm/TP_enc) encoder
pipelines: block k holds LLM stages [k·PP_enc, (k+1)·PP_enc), encoder stage e on LLM stage
k·PP_enc + e; column c holds TP ranks [c·TP_enc, (c+1)·TP_enc) of each of them (Optimus
Fig. 5). Every device holds one stage of one encoder pipeline (of every encoder: with two
encoders each is cut into the same PP_enc stages, §4.4) and one LLM stage. The devices of
LLM stage s and column c, over all LLM replicas, run one instruction list: rank class
(s, c).

Costs. An encoder stage's forward (backward) for one micro-batch is a list of items in
execution order: kernels (their times as the cost model prices a Work of that kernel
range) and TP all-reduces (after each row-parallel kernel in forward; after the first
column-parallel kernel of each parallel region in backward, Megatron's f/g operators).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from src.cluster import ClusterSpec, family_sharing
from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import element_bytes
from src.mesh import Mesh, Sharding, tensor_parallel
from src.models.spec import LayerSpec, ModelSpec, UnitSpec
from src.program import Phase, Work
from src.strategies.builders.stages import block_cuts, boundary_elems


@dataclass(frozen=True)
class EncoderPlan:
    pp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """Encoder pipelines on the LLM's devices. Pipeline j = k·columns + c of every LLM
    replica; rank class g = s·columns + c."""

    llm: Mesh
    plan: EncoderPlan

    # Cached: the bubble scheduler reads them in its inner loops, and a mesh's degree is a search.
    @cached_property
    def blocks(self) -> int:
        return self.llm.degree("pp") // self.plan.pp

    @cached_property
    def columns(self) -> int:
        return self.llm.degree("tp") // self.plan.tp

    @cached_property
    def pipelines(self) -> int:
        return self.blocks * self.columns

    @cached_property
    def classes(self) -> int:
        return self.llm.degree("pp") * self.columns

    def klass(self, pipeline: int, stage: int) -> int:
        k, c = divmod(pipeline, self.columns)
        return (k * self.plan.pp + stage) * self.columns + c

    def position(self, klass: int) -> tuple[int, int, int]:
        """(LLM stage, encoder pipeline, encoder stage) of a rank class."""
        s, c = divmod(klass, self.columns)
        k, e = divmod(s, self.plan.pp)
        return s, k * self.columns + c, e

    def rank(self, t: int, c: int, r: int, k: int, e: int) -> int:
        return self.llm.rank(tp=c * self.plan.tp + t, dp=r, pp=k * self.plan.pp + e)

    def class_ranks(self, klass: int, replicas: Sequence[int] | None = None) -> tuple[int, ...]:
        """The ranks of rank class `klass` in every LLM replica, or in `replicas` only."""
        s, c = divmod(klass, self.columns)
        k, e = divmod(s, self.plan.pp)
        held = range(self.llm.degree("dp")) if replicas is None else replicas
        return tuple(self.rank(t, c, r, k, e) for r in held for t in range(self.plan.tp))

    @cached_property
    def _encoder_mesh(self) -> Mesh:
        """(tp, dp, pp) over the encoder's replicas: replica d = c + columns·(r + dp_llm·k)."""
        dp_llm = self.llm.degree("dp")
        replicas = self.columns * dp_llm * self.blocks
        ranks = []
        for e in range(self.plan.pp):
            for d in range(replicas):
                c, rest = d % self.columns, d // self.columns
                r, k = rest % dp_llm, rest // dp_llm
                ranks += [self.rank(t, c, r, k, e) for t in range(self.plan.tp)]
        return Mesh((("tp", self.plan.tp), ("dp", replicas), ("pp", self.plan.pp)), tuple(ranks))

    def encoder_mesh(self) -> Mesh:
        return self._encoder_mesh


@dataclass(frozen=True)
class Item:
    """One step of an encoder stage's work for one micro-batch: a kernel of `layer`
    (kernel index `kernel`) or, with kernel == -1, a TP all-reduce after the previous one."""

    unit: str
    layer: int
    kernel: int
    seconds: float
    nbytes: float = 0.0

    @property
    def is_comm(self) -> bool:
        return self.kernel < 0


def allreduce_points(layer: LayerSpec, backward: bool) -> list[int]:
    """Kernels after which a TP all-reduce runs (forward order indices)."""
    kernels = layer.kernels
    if backward:
        points = [i for i, k in enumerate(kernels) if k.tp_split == "n" and (i == 0 or kernels[i - 1].tp_split == "none")]
    else:
        points = [i for i, k in enumerate(kernels) if k.tp_split == "k"]
    if len(points) != layer.tp_allreduces:
        # A layer of another shape: its all-reduces after its last kernel, priced the same.
        points = [0 if backward else len(kernels) - 1] * layer.tp_allreduces
    return points


@dataclass
class StageWork:
    """One encoder stage's work per micro-batch: items in execution order (forward,
    backward), their compute and all-reduce seconds."""

    forward: list[Item]
    backward: list[Item]

    @staticmethod
    def seconds(items: list[Item], comm: bool | None = None) -> float:
        return sum(i.seconds for i in items if comm is None or i.is_comm == comm)


@dataclass
class EncoderCosts:
    """Per encoder stage: the work of one micro-batch, the hop to the next stage, and the
    hand-off of the last stage's output to the LLM's first stage."""

    layers: dict[str, list[tuple[int, int]]]  # per encoder unit: its stages' layer ranges
    stages: list[StageWork]
    hops: list[float]
    to_llm: float


def encoder_costs(
    model: ModelSpec,
    encoders: list[str],
    cluster: ClusterSpec,
    precision: str,
    layout: Layout,
    samples: int,
    compute: ComputeModel,
    comm: CommModel,
) -> EncoderCosts:
    plan = layout.plan
    sharding = tensor_parallel(plan.tp)
    act = element_bytes(precision)
    mesh = layout.encoder_mesh()
    tp_ranks = mesh.group("tp", mesh.ranks[0])
    tp_sharing = family_sharing(cluster, mesh.family("tp")) if plan.tp > 1 else 1
    layers = {u: encoder_stages(model.unit(u), plan.pp) for u in encoders}
    stages = []
    for e in range(plan.pp):
        forward, backward = [], []
        for unit_name in encoders:
            unit = model.unit(unit_name)
            start, end = layers[unit_name][e]
            for index in range(start, end):
                layer = unit.layers[index]
                ar_bytes = layer.tp_comm_elems * samples * act
                ar = comm.collective_time("all_reduce", tp_ranks, ar_bytes, tp_sharing) if plan.tp > 1 else 0.0
                forward += _items(model, unit_name, index, layer, "fwd", samples, sharding, compute, ar, ar_bytes)
            if model.needs_backward(unit_name):
                for index in reversed(range(start, end)):
                    layer = unit.layers[index]
                    ar_bytes = layer.tp_comm_elems * samples * act
                    ar = comm.collective_time("all_reduce", tp_ranks, ar_bytes, tp_sharing) if plan.tp > 1 else 0.0
                    backward += _items(model, unit_name, index, layer, "bwd", samples, sharding, compute, ar, ar_bytes)
        stages.append(StageWork(forward, backward))
    hops = []
    for e in range(plan.pp - 1):
        pairs = list(zip(mesh.slice(pp=e), mesh.slice(pp=e + 1)))
        sharing = family_sharing(cluster, pairs)
        seconds = 0.0
        for unit_name in encoders:
            nbytes = boundary_elems(model.unit(unit_name), layers[unit_name][e][1]) * samples * act
            seconds += max(comm.p2p_time(a, b, nbytes, sharing) for a, b in pairs)
        hops.append(seconds)
    to_llm = 0.0
    for unit_name in encoders:
        nbytes = model.unit(unit_name).output_elems * samples * act
        # A last-stage rank sends the whole output to each LLM first-stage rank it feeds.
        sender = layout.rank(0, layout.columns - 1, 0, layout.blocks - 1, plan.pp - 1)
        receivers = [layout.llm.rank(tp=u, dp=0, pp=0) for u in range(0, layout.llm.degree("tp"), plan.tp)]
        to_llm += sum(comm.p2p_time(sender, dst, nbytes) for dst in receivers)
    return EncoderCosts(layers, stages, hops, to_llm)


def encoder_stages(unit: UnitSpec, pp: int) -> list[tuple[int, int]]:
    """An encoder's layers cut into pp stages of equal block counts, give or take one (a
    ViT's projector counts as a block: 49 of them for Table 8's 48-layer ViTs)."""
    return block_cuts(unit, pp, True, "the encoder's pp")


def _items(
    model: ModelSpec,
    unit: str,
    index: int,
    layer: LayerSpec,
    phase: Phase,
    samples: int,
    sharding: Sharding,
    compute: ComputeModel,
    allreduce: float,
    allreduce_bytes: float,
) -> list[Item]:
    backward = phase == "bwd"
    points = allreduce_points(layer, backward) if allreduce > 0 else []
    order = reversed(range(len(layer.kernels))) if backward else range(len(layer.kernels))
    out = []
    for k in order:
        work = Work(unit, phase, samples, (index, index + 1), sharding=sharding, kernels=(k, k + 1))
        out.append(Item(unit, index, k, compute.work_time(work, model)))
        out += [Item(unit, index, -1, allreduce, allreduce_bytes)] * points.count(k)
    return out
