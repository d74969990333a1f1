"""An Optimus plan on the workload's data: scheduled at the mean load, run on the batch's.

Optimus's bubble scheduler places the encoders' kernels by their profiled times (§4.1,
offline profiling), one schedule that every LLM replica runs. On skewed data
(train.data=interleaved) a replica's micro-batches carry their own sequences' images: the
same schedule runs with each encoder kernel at its micro-batch's load, so a kernel that its
load makes longer than the bubble it was placed in delays the LLM operation after it, and
the simulator prices that where it happens. The LLM's sequences are all 2048 tokens: its
work does not move. Replicas whose micro-batches carry different loads become rank classes
of their own, with their own TP groups, as Megatron-LM's stages do (builders.replicas).
The plan is chosen, and checked against memory, at the mean load, as a user plans it.

Which sequences each replica's micro-batches hold follows train.balance (none: the data
order). The policies read one stage's costs, the encoders' whole forward and backward per
micro-batch per unit of load: every device holds an encoder stage beside its LLM stage,
so a replica's encoder work is what its devices must fit beside the LLM, and `reorder` and
`cost` balance it over the replicas and their micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from src.batch_layout import BatchLayout
from src.data.balance import StageCosts
from src.program import Plan, Program, RankProgram
from src.strategies.base import PlanRequest, on_batch
from src.strategies.builders.pipeline import Stage
from src.strategies.builders.replicas import (
    PlacedBatch,
    copy_to_place,
    own_tp_groups,
    place_batch,
    record_unskewed,
    replica_loads,
    replica_names,
    skewed,
)
from src.strategies.optimus.encoder import EncoderCosts, StageWork
from src.strategies.optimus.programs import ClassEmitter, ReplicaLoads, class_label, class_program
from src.strategies.optimus.scheduler import Placed


def encoder_stage_costs(costs: EncoderCosts, encoders: list[str]) -> StageCosts:
    """The encoders' forward and backward seconds of one micro-batch at the mean load,
    every stage's kernels and all-reduces, as seconds per unit of load."""
    fwd = {u: sum(StageWork.seconds([i for i in stage.forward if i.unit == u]) for stage in costs.stages) for u in encoders}
    bwd = {u: sum(StageWork.seconds([i for i in stage.backward if i.unit == u]) for stage in costs.stages) for u in encoders}
    return StageCosts(0.0, 0.0, tuple(fwd.items()), tuple(bwd.items()))


def replica_classes(request: PlanRequest, emitter: ClassEmitter) -> tuple[list[ReplicaLoads], PlacedBatch] | None:
    """The LLM replicas grouped by the encoder loads their micro-batches carry on the
    request's batch, placed by the balancing policy; None where every sequence weighs the
    same."""
    if not skewed(request):
        return None
    replicas = emitter.layout.llm.degree("dp")
    batch = BatchLayout(request.train.global_batch, replicas, emitter.samples)
    placed = place_batch(request, batch, (encoder_stage_costs(emitter.costs, emitter.encoders),))
    by_unit = {u: replica_loads(placed.sequence_loads(u), batch, placed.order) for u in emitter.encoders}
    groups: dict[tuple, list[int]] = {}
    for replica in range(replicas):
        groups.setdefault(tuple(by_unit[u][replica] for u in emitter.encoders), []).append(replica)
    classes = [ReplicaLoads(tuple(members), {u: by_unit[u][members[0]] for u in emitter.encoders}) for members in groups.values()]
    return classes, placed


@dataclass(frozen=True)
class Emission:
    """What emitted a plan's rank classes at the mean load (the class emitter, the LLM's
    stages, the items each class runs in the LLM's bubbles), to emit them again per replica."""

    emitter: ClassEmitter
    stages: list[Stage]
    items: list[list[Placed]]

    def classes(self, program: Program, replicas: list[ReplicaLoads]) -> list[RankProgram]:
        layout = self.emitter.layout
        out = []
        for g in range(layout.classes):
            stage = self.stages[layout.position(g)[0]]
            for held in replicas:
                label = f"{class_label(layout, g)} {replica_names(held.replicas)}"
                rank_program = class_program(self.emitter, g, stage, self.items[g], label, held)
                out.append(replace(rank_program, instructions=own_tp_groups(program, rank_program.instructions, rank_program.ranks)))
        return out


def on_batches(plan: Plan, request: PlanRequest, batches: Sequence[int | None], emission: Emission) -> list[Plan]:
    """`plan` (at the mean load) on each of the workload's global `batches`: its schedule
    kept, each replica's classes at its micro-batches' loads (the first batch takes the plan
    itself, each other a copy made before it changes)."""
    plans = [plan] + [copy_to_place(plan) for _ in batches[1:]]
    for each, batch in zip(plans, batches):
        on_data = replica_classes(on_batch(request, batch), emission.emitter)
        if on_data is None:
            record_unskewed(each, request)
            continue
        classes, placed = on_data
        each.program.classes = emission.classes(each.program, classes)
        placed.record(each)
    return plans
