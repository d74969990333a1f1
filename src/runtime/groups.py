"""torch.distributed process groups for a plan, made once and looked up by ranks.

torch requires every rank to create every group, in the same order, members or not; so
every rank walks the same list: the Program's groups (each with its whole family) in name
order, every unit mesh's TP and DP families (the engines' groups; and PP, where the engines
reduce their norm over a pipeline's stages), then one group per
route over the ranks it connects. A route's messages travel in its own group: NCCL
matches the point-to-point messages between two ranks by order only, and each route
keeps its order (runtime.checks), while two routes between the same ranks need not.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from src.mesh import Mesh
from src.program import Hop, Plan, Route


def route_pairs(route: Route) -> list[tuple[int, int]]:
    """The (sender, receiver) pairs a route's messages connect."""
    if isinstance(route, Hop):
        return list(zip(route.a, route.b))
    return [(m.src, m.dst) for m in route.messages()]


class ProcessGroups:
    def __init__(self, plan: Plan, timeout_s: float, pipeline: Mesh | None = None) -> None:
        """`pipeline`: also its PP family (the engines' norm reduced over its stages:
        runtime.clipping)."""
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        timeout = timedelta(seconds=timeout_s)
        program = plan.program
        families: list[Sequence[tuple[int, ...]]] = [
            program.groups[name].family or (program.groups[name].ranks,) for name in sorted(program.groups)
        ]
        for unit_plan in plan.units:
            families += [unit_plan.mesh.family("tp"), unit_plan.mesh.family("dp")]
        families += [pipeline.family("pp")] if pipeline is not None else []
        for family in families:
            for members in family:
                members = tuple(members)
                if members not in self._groups:
                    self._groups[members] = dist.new_group(list(members), timeout=timeout)
        self._routes: dict[str, dist.ProcessGroup] = {}
        for name in sorted(program.routes):
            ranks = sorted({r for m in route_pairs(program.routes[name]) for r in m})
            self._routes[name] = dist.new_group(ranks, timeout=timeout)

    def route(self, name: str) -> dist.ProcessGroup:
        return self._routes[name]

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        try:
            return self._groups[tuple(ranks)]
        except KeyError:
            raise KeyError(f"no process group was made for ranks {ranks}") from None
