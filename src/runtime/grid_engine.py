"""The optimizer of a unit on a tensor grid, in a DeepSpeed engine's place.

Its layers reduce their own weight gradients over z (runtime.modules.grid3d); at the step
the grid sums the z-replicated parameters' gradients over z and every gradient over data
parallelism, and the engine averages the latter as DeepSpeed does (the executor runs each
backward on its data-parallel degree times its part of the loss). Its optimizer and
learning-rate schedule are a DeepSpeed engine's (runtime.optimizer); gradient clipping is
refused on a grid (runtime.clipping). Its checkpoint is each rank's own
(runtime.own_engine).
"""

from __future__ import annotations

import torch
from torch import nn

from src.config import ContrastiveSpec, DeepSpeedSpec
from src.program import TENSOR_GRID_AXES, UnitPlan
from src.runtime.modules.grid3d import Grid3D
from src.runtime.optimizer import build_optimizer, build_scheduler
from src.runtime.own_engine import OwnEngine


GRID_AXES = (*TENSOR_GRID_AXES, "dp")  # X innermost


def build_grid(unit: UnitPlan) -> Grid3D:
    """The unit's grid, its groups made by every rank, with the plan's overlaps, cached layers and gather order."""
    assert unit.grid is not None, f"unit {unit.unit} lies on no tensor grid"
    degrees = tuple(unit.mesh.degree(axis) for axis in GRID_AXES)
    layout = unit.grid
    return Grid3D.build(degrees, frozenset(layout.overlaps), frozenset(layout.cached_layers), layout.layers, layout.gathers)  # type: ignore[arg-type]


class GridEngine(OwnEngine):
    def __init__(self, module: nn.Module, grid: Grid3D, settings: DeepSpeedSpec, contrastive: ContrastiveSpec, steps: int) -> None:
        self.module, self.grid = module, grid
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(module, settings, contrastive)
        self.lr_scheduler = build_scheduler(self.optimizer, settings.scheduler, steps)

    def step(self) -> None:
        self.grid.finish_backward([self.module])
        if self.grid.dp.size > 1:
            torch._foreach_div_([p.grad for p in self.params if p.grad is not None], self.grid.dp.size)
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.zero_grad()
