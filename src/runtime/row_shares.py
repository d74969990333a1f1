"""A unit replicated over its pipeline's TP group (its mesh's rows axis, src/mesh.py): each
of those ranks holds the whole unit and runs a share of every micro-batch, dealt out as
the plan prices it (data.balance.dealt_images: contiguous blocks as even as they go, the
first ranks one more; a rank past the end runs none).

Every rank of the group reads the group's whole micro-batch and runs its share of it. On
samples alike (uniform data, one image a sequence) its share is rows, and it holds what it
makes at those rows of the micro-batch, so that the pipeline's scattered transfers carry
them as they are (a part of a micro-batch whose rows the group does not divide is a block
of them, and an all-gather of such parts pads them to the largest: runtime.executor). A
unit that works per image (an MLLM's encoder and generator) on sequences of their own
images (interleaved data) shares a micro-batch's images instead: each rank runs the images
dealt to it and holds what it makes at their places in the whole micro-batch; what travels
for share i of a scattered transfer is those images' tokens (runtime.executor). A unit of
its own that hands over through a broker (DistTrain's) moves its micro-batches whole: its
ranks all-gather their shares before the broker sends, and the broker shares what it
receives with them, each reading its share of it. Either way its ranks reduce their
gradients over every rank of the unit (its rows x dp ranks): they ran disjoint parts of
the micro-batch's work, each loss its part of the micro-batch's.
"""

from __future__ import annotations

from dataclasses import dataclass

from src.data.balance import dealt_images
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


def share_rows(plan: UnitPlan, rank: int) -> range | None:
    """The rows of each micro-batch that `rank` runs of the unit (None: all of them, as a
    unit that is not replicated, or one that deals images out, runs them)."""
    shares = plan.row_shares
    return dealt_images(plan.micro_batch, shares)[plan.mesh.coords(rank)[ROWS]] if shares > 1 else None


def sharing_units(plan: Plan) -> dict[str, int]:
    """The units replicated over their TP group, and how many shares each has."""
    return {u.unit: u.row_shares for u in plan.units if u.row_shares > 1}


def dealing_units(plan: Plan, model: ModelSpec) -> dict[str, int]:
    """The units that deal each micro-batch's images out over their row shares on
    interleaved data (replicated ones that work per image), and how many shares each has."""
    return {u.unit: u.row_shares for u in plan.units if u.row_shares > 1 and model.unit(u.unit).arch.per_image}


def rank_shares(plan: Plan, rank: int) -> dict[str, Share]:
    """`rank`'s share of each replicated unit it runs (of its rows, or of its images where
    it deals them out: dealing_units)."""
    sharing = sharing_units(plan)
    return {unit.unit: Share(unit.mesh.coords(rank)[ROWS], sharing[unit.unit]) for unit in plan.units_on(rank) if unit.unit in sharing}
