"""Where every rank sits in every unit it holds: its replica, its TP index, its layers.

A rank's own placement is enough to train a unit alone; moving data between units of
different shapes (DistMM's towers with different replicas, micro-batches and TP) needs
the other side's seats too. They are read off the same Program, for every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from src.program import Plan
from src.runtime.placement import placements


@dataclass(frozen=True)
class Seat:
    rank: int
    replica: int
    tp_index: int
    layers: frozenset[int]


class Roster:
    def __init__(self, plan: Plan) -> None:
        self.seats: dict[str, list[Seat]] = {}
        for rank in range(plan.program.world_size):
            for unit, place in placements(plan, rank).items():
                tp_index = place.tp_ranks.index(rank) if place.tp > 1 else 0
                self.seats.setdefault(unit, []).append(
                    Seat(rank, place.dp_ranks.index(rank), tp_index, frozenset(place.layers)))

    def seat(self, unit: str, rank: int) -> Seat:
        return next(s for s in self.seats[unit] if s.rank == rank)

    def holders(self, unit: str, layer: int, replica: int) -> list[Seat]:
        """The seats (one per TP index) of `replica` that compute `layer` of `unit`."""
        found = sorted((s for s in self.seats.get(unit, []) if layer in s.layers and s.replica == replica),
                       key=lambda s: s.tp_index)
        if not found:
            raise KeyError(f"no rank computes layer {layer} of {unit} for replica {replica}")
        return found
