"""What one rank holds, read off its instruction list: the layers of each unit it
computes, and each unit's TP and DP groups as this rank sees them.

The groups come from the Program's own collectives: a unit's TP group is the group of the
tp collectives that follow its compute; its DP group is the group of the dp collective
that precedes its optimizer step (a unit with dp=1 has none: its DP group is the rank;
a frozen unit has none either: its replicas are those of its class).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from src.errors import ConfigError
from src.program import BatchSync, Collective, Compute, Plan


@dataclass
class UnitPlacement:
    unit: str
    layers: set[int] = field(default_factory=set)
    tp: int = 1
    tp_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()


def placements(plan: Plan, rank: int) -> dict[str, UnitPlacement]:
    program = plan.program
    out: dict[str, UnitPlacement] = {}
    last_unit: str | None = None
    last_dp: tuple[int, ...] | None = None
    for instruction in program.instructions_for(rank):
        if isinstance(instruction, BatchSync):
            instruction = Compute(instruction.work)
        if isinstance(instruction, Compute):
            work = instruction.work
            place = out.setdefault(work.unit, UnitPlacement(work.unit))
            place.layers.update(range(*work.layers))
            if work.phase in ("fwd", "bwd"):  # the optimizer's Work carries its ranks' tp, layers or not
                place.tp = max(place.tp, work.tp)
            last_unit = work.unit
            if work.phase == "optimizer" and last_dp is not None:
                place.dp_ranks = last_dp
        elif isinstance(instruction, Collective):
            ranks = program.group_for(instruction.group, rank)
            if instruction.kind == "tp" and last_unit is not None:
                out[last_unit].tp_ranks = ranks
            elif instruction.kind == "dp":
                last_dp = ranks
    for place in out.values():
        if not place.dp_ranks:
            place.dp_ranks = _dp_without_optimizer(plan, place.unit, rank)
        if place.tp > 1 and len(place.tp_ranks) != place.tp:
            raise ConfigError(f"unit {place.unit} runs with tp={place.tp} on rank {rank} but its tp collectives "
                              f"are over {len(place.tp_ranks)} ranks")
    return out


def _dp_without_optimizer(plan: Plan, unit: str, rank: int) -> tuple[int, ...]:
    """A unit with no dp collective before an optimizer step (dp=1, or frozen: LiT's
    tower): its replicas are read off the rank's class, which lists the ranks of one
    pipeline stage TP-fastest, then by replica (the order Program.peer_for relies on)."""
    unit_plan = plan.unit(unit)
    if unit_plan.dp == 1:
        return (rank,)
    ranks = plan.program.class_of(rank).ranks
    replicas = ranks[ranks.index(rank) % unit_plan.tp::unit_plan.tp]
    if len(replicas) != unit_plan.dp:
        raise ConfigError(f"unit {unit} has dp={unit_plan.dp} but rank {rank}'s class holds {len(replicas)} "
                          f"replicas of it and its Program names no dp group for it")
    return replicas
