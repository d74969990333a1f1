"""What one rank holds, read off the typed plan: the layers of each unit it computes, and
each unit's TP and DP groups as its mesh places this rank (and, for a unit replicated over
its TP group, which rows of each micro-batch it runs: runtime.row_shares)."""

from __future__ import annotations

from dataclasses import dataclass

from src.mesh import TENSOR_AXES
from src.program import Plan
from src.runtime.row_shares import data_group, share_rows


@dataclass(frozen=True)
class UnitPlacement:
    unit: str
    layers: frozenset[int]
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    rows: range | None = None  # of each micro-batch, where the rank runs a share of its rows

    @property
    def tp(self) -> int:
        return len(self.tp_ranks)

    @property
    def dp(self) -> int:
        return len(self.dp_ranks)


def placements(plan: Plan, rank: int) -> dict[str, UnitPlacement]:
    out = {}
    for unit_plan in plan.units_on(rank):
        mesh = unit_plan.mesh
        out[unit_plan.unit] = UnitPlacement(
            unit_plan.unit,
            frozenset(unit_plan.layers_on(rank)),
            mesh.group("tp", rank),
            data_group(mesh, rank),
            share_rows(unit_plan, rank),
        )
    return out


def tensor_replicas(plan: Plan, unit: str) -> int:
    """How many ranks of a unit compute the same values (its tensor-parallel peers; a
    tensor grid's z splits a micro-batch's rows, so its ranks compute different values)."""
    mesh = plan.unit(unit).mesh
    replicas = 1
    for axis in TENSOR_AXES:
        if axis != "z":
            replicas *= mesh.degree(axis)
    return replicas
