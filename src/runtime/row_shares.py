"""A unit replicated over its pipeline's TP group (its mesh's rows axis, src/mesh.py): each
of those ranks holds the whole unit and runs an equal share of every micro-batch's rows.

Its ranks read their share of each micro-batch (rows share i of the TP group's micro-batch,
as data-parallel replica i of the TP group's replica would), hold what they make at those
rows of the micro-batch, so that the pipeline's scattered transfers carry them as they are,
and reduce their gradients over every rank of the unit (its rows x dp ranks).
"""

from __future__ import annotations

from src.mesh import ROWS, Mesh
from src.program import UnitPlan


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
