"""Rank classes per data-parallel replica where the data makes replicas differ.

A stage's ranks are interchangeable while every replica's micro-batches weigh the same.
Under skewed data (train.data=interleaved, or a run's tar shards) a unit that works per
image (an MLLM's encoder and generator) carries, on each replica's micro-batch, the load of
the sequences it holds: replicas whose loads differ become rank classes of their own, their
Computes carrying the load (Work.load) and their TP collectives moving that many more rows,
so stragglers and the gaps they leave are simulated where they occur. Replicas alike share
one class.

`on_the_data` prices a plan made at the mean load (Megatron-LM's, ZeRO/DDP's: planned as
their users plan, without the data) on the batch's sequences in data order; DistTrain
builds its classes with its own sample order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from src.batch_layout import BatchLayout
from src.cluster import ClusterSpec
from src.data.loads import batch_loads
from src.mesh import Mesh
from src.program import Collective, Compute, Instruction, Plan, Program, RankProgram, compress_ranks
from src.strategies.base import PlanRequest
from src.strategies.builders.layout import make_group, megatron_mesh

Loads = Mapping[str, tuple[tuple[float, ...], ...]]  # unit -> loads[replica][microbatch]


def replica_classes(
    program: Program,
    cluster: ClusterSpec,
    mesh: Mesh,
    stage: int,
    instructions: list[Instruction],
    loads: Loads,
    tp_group: str | None,
    label: str,
    units: tuple[str, ...],
    pipelined: bool = True,
) -> list[RankProgram]:
    """Stage `stage` of the (tp, dp, pp) `mesh` as one rank class per set of replicas whose
    micro-batches carry the same loads of the units in `loads`; each class of several has
    its own TP group (`tp_group`: the stage's)."""
    alike: dict[tuple[tuple[float, ...], ...], list[int]] = {}
    for replica in range(mesh.degree("dp")):
        alike.setdefault(tuple(loads[unit][replica] for unit in loads), []).append(replica)
    out = []
    for key, replicas in alike.items():
        ranks = tuple(r for replica in replicas for r in mesh.slice(pp=stage, dp=replica))
        own = tp_group
        if tp_group is not None and len(alike) > 1:
            own = f"{tp_group}.d{replicas[0]}"
            program.add_group(make_group(cluster, own, mesh.slice(pp=stage, dp=replicas[0]), mesh.family("tp")))
        which = f"replica {replicas[0]}" if len(replicas) == 1 else f"replicas {compress_ranks(tuple(replicas))}"
        out.append(
            RankProgram(
                ranks=ranks,
                instructions=localised(instructions, dict(zip(loads, key)), tp_group, own),
                label=f"{label} {which}",
                units=units,
                pipelined=pipelined,
            )
        )
    return out


def localised(
    instructions: list[Instruction], loads: Mapping[str, tuple[float, ...]], shared: str | None, own: str | None
) -> list[Instruction]:
    """A stage's instructions as one replica runs them: each micro-batch's load on the
    forward and backward of the units in `loads`, on their compute and on the bytes of the
    TP collectives that follow it (a micro-batch of more images moves that many more rows),
    and its own TP group for the TP collectives."""
    out: list[Instruction] = []
    load = 1.0
    for instruction in instructions:
        if isinstance(instruction, Compute):
            work = instruction.work
            load = loads[work.unit][instruction.microbatch] if work.unit in loads and work.phase in ("fwd", "bwd") else 1.0
            if load != 1.0:
                instruction = replace(instruction, work=replace(work, load=load))
        elif isinstance(instruction, Collective):
            if instruction.kind == "tp" and load != 1.0:
                instruction = replace(instruction, bytes=instruction.bytes * load)
            if shared is not None and instruction.group == shared and own != shared:
                assert own is not None, "a class whose stage uses a shared TP group has its own"
                instruction = replace(instruction, group=own)
        out.append(instruction)
    return out


def replica_loads(sequence_loads: tuple[float, ...], batch: BatchLayout) -> tuple[tuple[float, ...], ...]:
    """loads[replica][microbatch] of a pipeline that takes the batch in data order (the
    sequences the real backend gives each micro-batch), each micro-batch the mean load of
    its sequences."""

    def mean_load(replica: int, microbatch: int) -> float:
        first = batch.first_sample(replica, microbatch)
        return sum(sequence_loads[first : first + batch.micro_batch]) / batch.micro_batch

    return tuple(tuple(mean_load(r, j) for j in range(batch.microbatches)) for r in range(batch.dp))


PER_IMAGE = "sequence's images"  # an MLLM's per_sample convention for units that work per image


def on_the_data(plan: Plan, request: PlanRequest) -> Plan:
    """`plan`, whose rank classes are the stages of one (tp, dp, pp) mesh taking the batch in
    data order, with its per-image units' micro-batches at the loads of the sequences they
    hold (the plan itself where every sequence weighs the same)."""
    model, train = request.model, request.train
    per_image = [u for u, sample in model.extras.get("per_sample", {}).items() if sample == PER_IMAGE]
    if not per_image or (train.data == "uniform" and request.sample_images is None):
        return plan
    loads = batch_loads(model, train.seed, train.global_batch, train.data, request.sample_images)
    first = plan.units[0]
    dp = first.mesh.degree("dp")
    batch = BatchLayout(train.global_batch, dp, first.micro_batch)
    # A stage's ranks: tp x dp (a unit replicated over its stage's TP group splits rows there).
    mesh = megatron_mesh(first.mesh.size // (dp * first.mesh.degree("pp")), dp, len(plan.program.classes))
    by_unit = {}
    for unit in per_image:
        sequence_loads = loads.of(unit)
        assert sequence_loads is not None, f"{unit} works per image"
        by_unit[unit] = replica_loads(sequence_loads, batch)
    program = plan.program
    classes = []
    for stage, rank_program in enumerate(program.classes):
        held = {unit: by_unit[unit] for unit in rank_program.units if unit in by_unit}
        if not held:
            classes.append(rank_program)
            continue
        group = f"tp.s{stage}" if f"tp.s{stage}" in program.groups else None
        label, units = rank_program.label, rank_program.units
        classes += replica_classes(
            program, request.cluster, mesh, stage, rank_program.instructions, held, group, label, units, rank_program.pipelined
        )
    program.classes = classes
    plan.sample_content = train.data
    plan.sample_images = loads.images
    plan.details["data"] = train.data
    return plan
