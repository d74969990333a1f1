"""Rank classes per data-parallel replica where the data makes replicas differ.

A stage's ranks are interchangeable while every replica's micro-batches weigh the same.
Under skewed data (train.data=interleaved, or a run's tar shards) a unit that works per
image (an MLLM's encoder and generator) carries, on each replica's micro-batch, the load of
the sequences it holds: replicas whose loads differ become rank classes of their own, their
Computes carrying the load (Work.load) and their TP collectives moving that many more rows,
so stragglers and the gaps they leave are simulated where they occur. Replicas alike share
one class.

`on_the_data` prices a plan made at the mean load (Megatron-LM's, ZeRO/DDP's: planned as
their users plan, without the data) on the batch's sequences, placed by the workload's
balancing policy (train.balance, src/data/balance.py; by default the data order); DistTrain
builds its classes with its own sample order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Mapping, Sequence

from src.batch_layout import BatchLayout
from src.costmodel.compute import ComputeModel
from src.data.balance import Balancer, Balancing, Dealt, StageCosts
from src.data.loads import BatchLoads, PerImage, batch_loads
from src.mesh import Mesh
from src.program import Collective, Compute, Instruction, Plan, Program, RankProgram, compress_ranks
from src.strategies.base import PlanRequest, on_batch
from src.strategies.builders.layout import megatron_mesh

Loads = Mapping[str, tuple[tuple[float, ...], ...]]  # unit -> loads[replica][microbatch]


def replica_classes(
    program: Program,
    mesh: Mesh,
    stage: int,
    instructions: list[Instruction],
    loads: Loads,
    label: str,
    units: tuple[str, ...],
    pipelined: bool = True,
    alike: Sequence[Hashable] | None = None,
) -> list[RankProgram]:
    """Stage `stage` of the (tp, dp, pp) `mesh` as one rank class per set of replicas that
    run alike: whose micro-batches carry the same loads of the units in `loads`, or, given
    `alike` (a key per replica), whose keys are equal (a stage's timing also follows the
    loads its pipeline neighbours carry: replicas are interchangeable only where their
    whole pipeline is). Each class of several runs its TP collectives on its own TP groups."""
    keys = alike if alike is not None else [tuple(loads[unit][replica] for unit in loads) for replica in range(mesh.degree("dp"))]
    classes: dict[Hashable, list[int]] = {}
    for replica, key in enumerate(keys):
        classes.setdefault(key, []).append(replica)
    out = []
    for replicas in classes.values():
        ranks = tuple(r for replica in replicas for r in mesh.slice(pp=stage, dp=replica))
        held = {unit: per_replica[replicas[0]] for unit, per_replica in loads.items()}
        localised = at_loads(instructions, held)
        out.append(
            RankProgram(
                ranks=ranks,
                instructions=own_tp_groups(program, localised, ranks) if len(classes) > 1 else localised,
                label=f"{label} {replica_names(replicas)}",
                units=units,
                pipelined=pipelined,
            )
        )
    return out


def own_tp_groups(program: Program, instructions: list[Instruction], ranks: tuple[int, ...]) -> list[Instruction]:
    """`instructions` of a class of `ranks` whose collectives on its TP groups (a layer's,
    a scattered transfer's all-gather) run on the TP groups of its own ranks (each group's
    family member through ranks[0], named by its first rank): classes of one group whose
    loads differ move different bytes at different times."""
    tp_groups = {i.group for i in instructions if isinstance(i, Collective) and i.kind == "tp"}
    renamed: dict[str, str] = {}
    out: list[Instruction] = []
    for instruction in instructions:
        if isinstance(instruction, Collective) and instruction.group in tp_groups:
            name = renamed.get(instruction.group)
            if name is None:
                group = program.groups[instruction.group]
                member = next(m for m in group.family if ranks[0] in m) if group.family else group.ranks
                name = instruction.group if member == group.ranks else f"{instruction.group}.r{member[0]}"
                if name not in program.groups:
                    program.add_group(replace(group, name=name, ranks=member))
                renamed[instruction.group] = name
            instruction = replace(instruction, group=name)
        out.append(instruction)
    return out


def replica_names(replicas: Sequence[int]) -> str:
    """How a rank class's label names the data-parallel replicas it runs."""
    return f"replica {replicas[0]}" if len(replicas) == 1 else f"replicas {compress_ranks(tuple(replicas))}"


def at_loads(instructions: list[Instruction], loads: Mapping[str, tuple[float, ...]]) -> list[Instruction]:
    """A stage's instructions as one replica runs them: each micro-batch's load on the
    forward and backward of the units in `loads`, on their compute and on the bytes of the
    TP collectives that follow it (a micro-batch of more images moves that many more rows)."""
    out: list[Instruction] = []
    load = 1.0
    for instruction in instructions:
        if isinstance(instruction, Compute):
            work = instruction.work
            load = loads[work.unit][instruction.microbatch] if work.unit in loads and work.phase in ("fwd", "bwd") else 1.0
            if load != 1.0:
                instruction = replace(instruction, work=replace(work, load=load))
        elif isinstance(instruction, Collective) and instruction.kind == "tp" and load != 1.0:
            beside = tuple(replace(work, load=load) for work in instruction.beside)
            instruction = replace(instruction, bytes=instruction.bytes * load, beside=beside)
        out.append(instruction)
    return out


def replica_loads(sequence_loads: tuple[float, ...], batch: BatchLayout, order: tuple[int, ...]) -> tuple[tuple[float, ...], ...]:
    """loads[replica][microbatch] of a pipeline that takes the batch's sequences in `order`
    (order[p]: the sequence at batch position p; the real backend gives each micro-batch
    those), each micro-batch the mean load of its sequences."""

    def mean_load(replica: int, microbatch: int) -> float:
        first = batch.first_sample(replica, microbatch)
        return sum(sequence_loads[q] for q in order[first : first + batch.micro_batch]) / batch.micro_batch

    return tuple(tuple(mean_load(r, j) for j in range(batch.microbatches)) for r in range(batch.dp))


def dealt_loads(image_loads: PerImage, batch: BatchLayout, order: tuple[int, ...], dealt: Dealt) -> tuple[tuple[float, ...], ...]:
    """loads[replica][microbatch] of a unit replicated over its TP group (`dealt`), which
    deals each micro-batch's images out whole, as evenly as they go by count: the busiest
    rank's images against that rank's at the mean (stages.replicated_rows prices ceil(rows /
    shares) of them). Where the images do not divide evenly a micro-batch of one more image
    can cost its busiest rank nothing or a whole image more, which a load proportional to
    the micro-batch's images does not see."""

    def busiest(replica: int, microbatch: int) -> float:
        first = batch.first_sample(replica, microbatch)
        held = [load for q in order[first : first + batch.micro_batch] for load in image_loads[q]]
        return dealt.load(held, batch.micro_batch)

    return tuple(tuple(busiest(r, j) for j in range(batch.microbatches)) for r in range(batch.dp))


def stage_costs(program: Program, request: PlanRequest, units: list[str]) -> tuple[StageCosts, ...]:
    """Each pipeline stage's seconds for one micro-batch at the mean load (its first, as the
    plan prices every one alike), the per-image `units`' part per unit of load."""
    compute = ComputeModel(request.cluster, request.train.precision)
    out = []
    for rank_program in program.classes:
        fixed = {"fwd": 0.0, "bwd": 0.0}
        per_load: dict[str, dict[str, float]] = {"fwd": {}, "bwd": {}}
        for instruction in rank_program.instructions:
            if not isinstance(instruction, Compute) or instruction.microbatch != 0 or instruction.work.phase not in fixed:
                continue
            work = instruction.work
            seconds = compute.work_time(work, request.model)
            if work.unit in units:
                per_load[work.phase][work.unit] = per_load[work.phase].get(work.unit, 0.0) + seconds
            else:
                fixed[work.phase] += seconds
        out.append(StageCosts(fixed["fwd"], fixed["bwd"], tuple(per_load["fwd"].items()), tuple(per_load["bwd"].items())))
    return tuple(out)


def on_the_data(plan: Plan, request: PlanRequest) -> Plan:
    """`plan`, whose rank classes are the stages of one (tp, dp, pp) mesh, with its per-image
    units' micro-batches at the loads of the sequences they hold, placed by the workload's
    balancing policy (train.balance; none: the data order); the plan itself where every
    sequence weighs the same."""
    model, train = request.model, request.train
    per_image = model.per_image_units()
    if not skewed(request):
        record_unskewed(plan, request)
        return plan
    first = plan.units[0]
    dp = first.mesh.degree("dp")
    batch = BatchLayout(train.global_batch, dp, first.micro_batch)
    program = plan.program
    dealt = {
        unit_plan.unit: Dealt(unit_plan.unit, unit_plan.row_shares, model.unit(unit_plan.unit).arch.images)
        for unit_plan in plan.units
        if unit_plan.unit in per_image and unit_plan.row_shares > 1
    }
    costs = stage_costs(program, request, per_image)
    placed = place_batch(request, batch, costs, tuple(dealt.values()), plan.details.get("extra_warmup", 0))
    by_unit = {
        unit: dealt_loads(placed.loads.per_image(unit), batch, placed.order, dealt[unit])
        if unit in dealt
        else replica_loads(placed.sequence_loads(unit), batch, placed.order)
        for unit in per_image
    }
    # A stage's ranks: tp x dp (a unit replicated over its stage's TP group splits rows there).
    mesh = megatron_mesh(first.mesh.size // (dp * first.mesh.degree("pp")), dp, len(program.classes))
    # Every stage of a replica's pipeline waits on the others: its stages are split alike.
    alike = [tuple(by_unit[unit][replica] for unit in per_image) for replica in range(dp)]
    classes = []
    for stage, rank_program in enumerate(program.classes):
        held = {unit: by_unit[unit] for unit in rank_program.units if unit in by_unit}
        label, units = rank_program.label, rank_program.units
        classes += replica_classes(program, mesh, stage, rank_program.instructions, held, label, units, rank_program.pipelined, alike)
    program.classes = classes
    placed.record(plan)
    return plan


@dataclass(frozen=True)
class PlacedBatch:
    """A skewed global batch placed by the workload's balancing policy: each sequence's
    loads, the order that puts them at the batch's positions, and the policy's Balancing
    (None: the data order), which the plan carries so that the real backend places every
    step's batch alike."""

    data: str
    policy: str
    loads: BatchLoads
    order: tuple[int, ...]
    balancing: Balancing | None

    def sequence_loads(self, unit: str) -> tuple[float, ...]:
        loads = self.loads.of(unit)
        assert loads is not None, f"{unit} works per image"
        return loads

    def record(self, plan: Plan) -> None:
        """The plan's record of the data it is priced on and where its sequences run."""
        plan.sample_content = self.data
        plan.sample_images = self.loads.images
        plan.details["data"] = self.data
        if self.balancing is not None:
            plan.sample_order, plan.balancing = self.order, self.balancing
            plan.details |= {"balance_policy": self.policy, "sample_order": list(self.order)}


def record_unskewed(plan: Plan, request: PlanRequest) -> None:
    """Every sequence alike: the plan records the policy asked, which had nothing to move."""
    if request.train.balance not in (None, "none"):
        plan.details["balance_policy"] = request.train.balance


def place_batch(
    request: PlanRequest, batch: BatchLayout, costs: tuple[StageCosts, ...], dealt: tuple[Dealt, ...] = (), extra_warmup: int = 0
) -> PlacedBatch:
    """The request's global batch (train.data, or the images a run sampled) placed over
    `batch`'s replicas and micro-batches by train.balance (none: the data order), the
    policy reading the pipeline's stage `costs` (`extra_warmup`: its schedule's warm-up
    forwards beyond 1F1B's)."""
    model, train = request.model, request.train
    policy = train.balance or "none"
    loads = batch_loads(model, train.seed, train.global_batch, train.data, request.sample_images, request.batch_index)
    balancing = None if policy == "none" else Balancing(policy, Balancer(batch, costs, dealt, extra_warmup))
    order = tuple(range(train.global_batch)) if balancing is None else balancing.place(loads)
    return PlacedBatch(train.data, policy, loads, order, balancing)


def skewed(request: PlanRequest) -> bool:
    """Whether the workload's sequences weigh differently: a unit works per image and the
    data (or the images a run sampled) is not uniform."""
    train = request.train
    return bool(request.model.per_image_units()) and not (train.data == "uniform" and request.sample_images is None)


def on_batches(plan: Plan, request: PlanRequest, batches: Sequence[int | None]) -> list[Plan]:
    """`plan` (at the mean load, as on_the_data takes it) priced on each of the workload's
    global `batches`: its choices made once, as a run keeps them from step to step. The
    first batch takes the plan itself, each other a copy made before it changes."""
    plans = [plan] + [copy_to_place(plan) for _ in batches[1:]]
    return [on_the_data(each, on_batch(request, batch)) for each, batch in zip(plans, batches)]


def copy_to_place(plan: Plan) -> Plan:
    """A copy of `plan` that on_the_data may change without changing `plan`: it sets the
    plan's fields and details, the program's classes and adds groups; instructions, units
    and routes are read and replaced, never changed, so they are shared."""
    program = replace(plan.program, classes=list(plan.program.classes), groups=dict(plan.program.groups))
    return replace(plan, program=program, details=dict(plan.details))
