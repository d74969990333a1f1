"""A unit replicated over its pipeline's TP group (its mesh's rows axis, src/mesh.py): each
of those ranks holds the whole unit and runs an equal share of every micro-batch.

On samples alike its share is rows: rows share i of the TP group's micro-batch (as
data-parallel replica i of the TP group's replica would read them), and it holds what it
makes at those rows of the micro-batch, so that the pipeline's scattered transfers carry
them as they are. A unit that works per image (an MLLM's encoder and generator) on
sequences of their own images (interleaved data) shares a micro-batch's images instead, as
the plan prices it (data.balance.dealt_images): each rank reads the whole micro-batch, runs
the images dealt to it and holds what it makes at their places in the whole micro-batch;
what travels for share i of a scattered transfer is those images' tokens (runtime.executor).
A unit of its own that hands over through a broker (DistTrain's) moves its micro-batches
whole: its ranks all-gather their shares before the broker sends, and the broker shares
what it receives with them, each reading its share of it. Either way its ranks reduce
their gradients over every rank of the unit (its rows x dp ranks): they ran disjoint parts
of the micro-batch's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from src.mesh import ROWS, Mesh
from src.models.spec import ModelSpec
from src.program import Plan, UnitPlan


@dataclass(frozen=True)
class Share:
    """Share `index` of the `count` ranks a unit's micro-batches are shared over."""

    index: int
    count: int


def data_group(mesh: Mesh, rank: int) -> tuple[int, ...]:
    """The ranks that hold the same parameters as `rank` and split the data: along dp, and
    along rows where the unit has that axis."""
    if mesh.degree(ROWS) == 1:
        return mesh.group("dp", rank)
    coords = mesh.coords(rank)
    return mesh.slice(**{axis: coord for axis, coord in coords.items() if axis not in (ROWS, "dp")})


def first_row(plan: UnitPlan, rank: int) -> int:
    """The first row of each micro-batch that `rank` runs of the unit (0 unless replicated)."""
    shares = plan.row_shares
    return plan.mesh.coords(rank).get(ROWS, 0) * (plan.micro_batch // shares) if shares > 1 else 0


def dealing_units(plan: Plan, model: ModelSpec) -> dict[str, int]:
    """The units that deal each micro-batch's images out over their row shares on
    interleaved data (replicated ones that work per image), and how many shares each has."""
    return {u.unit: u.row_shares for u in plan.units if u.row_shares > 1 and model.unit(u.unit).arch.per_image}


def image_shares(plan: Plan, rank: int, dealing: dict[str, int]) -> dict[str, Share]:
    """`rank`'s share of the images of each dealing unit it runs (`dealing`: dealing_units)."""
    return {unit.unit: Share(unit.mesh.coords(rank)[ROWS], dealing[unit.unit]) for unit in plan.units_on(rank) if unit.unit in dealing}
