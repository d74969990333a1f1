"""torch.distributed process groups for a Program, made once and looked up by ranks.

torch requires every rank to create every group, in the same order, members or not; so
every rank walks the Program's groups (each with its whole family) in name order.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from src.program import Program


class ProcessGroups:
    def __init__(self, program: Program, timeout_s: float, singletons: bool) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        timeout = timedelta(seconds=timeout_s)
        families = [program.groups[name].family or (program.groups[name].ranks,) for name in sorted(program.groups)]
        if singletons:
            # Units with dp=1 still hand DeepSpeed a data-parallel group: their own rank.
            families.append(tuple((r,) for r in range(program.world_size)))
        for family in families:
            for members in family:
                members = tuple(members)
                if members not in self._groups:
                    self._groups[members] = dist.new_group(list(members), timeout=timeout)

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        try:
            return self._groups[tuple(ranks)]
        except KeyError:
            raise KeyError(f"no process group was made for ranks {ranks}") from None
