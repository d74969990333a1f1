"""What the real backend does for a unit its plan lays out beyond the device mesh's tensor,
data and pipeline axes (UnitPlan.grid), keyed by the layout's type. A unit without one runs
on DeepSpeed's engines (runtime.engines); a unit with one is checked, built and stepped by
its layout's runtime, so the checks, the session and the engines ask this table rather
than which layout a unit has, and a new layout is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol

from torch import nn

from src.config import ContrastiveSpec, DeepSpeedSpec
from src.errors import PlanRefused
from src.models.spec import UnitSpec
from src.program import TensorGrid, UnitPlan
from src.runtime.grid_engine import GridEngine, build_grid
from src.runtime.modules.gpt3d import GRID_LAYERS, grid_layer
from src.runtime.modules.grid3d import Axis, Grid3D, link_prefetches, narrow_cache
from src.runtime.modules.unet3d import UNetOnGrid
from src.runtime.modules.units import LaidOutLayers, llama_style
from src.runtime.own_engine import OwnEngine


class LaidOut(LaidOutLayers, Protocol):
    """A unit's layout as this rank holds it (its groups, made at the run's start): its
    layers, built by index and linked (runtime.modules.units.LaidOutLayers), and its optimizer."""

    def engine(self, module: nn.Module, settings: DeepSpeedSpec, contrastive: ContrastiveSpec, steps: int) -> OwnEngine:
        """The optimizer that steps the unit: the layout's gradients are its own to reduce."""
        ...


class LayoutRuntime(Protocol):
    name: str  # the layout as a message names it
    clips: bool  # whether its optimizer clips gradients (backend.deepspeed.gradient_clipping)

    def check(self, unit: UnitPlan, spec: UnitSpec) -> None:
        """Refuse what the real backend cannot build of the unit (PlanRefused), before any
        worker starts."""
        ...

    def lay_out(self, unit: UnitPlan, spec: UnitSpec) -> LaidOut:
        """The unit's layout on this rank (collective: every rank makes every group)."""
        ...


@dataclass(frozen=True)
class _GridUnit:
    grid: Grid3D
    build: Callable[[int], nn.Module]  # a U-Net's or a GPT's layer on the grid, by index

    def layer(self, index: int) -> nn.Module:
        module = self.build(index)
        narrow_cache(module, index, self.grid)
        return module

    def link(self, layers: nn.ModuleList) -> None:
        link_prefetches(layers, self.grid)

    def engine(self, module: nn.Module, settings: DeepSpeedSpec, contrastive: ContrastiveSpec, steps: int) -> OwnEngine:
        return GridEngine(module, self.grid, settings, contrastive, steps)


class TensorGridRuntime:
    """A unit on a tensor grid (runtime.modules.grid3d): a GPT (runtime.modules.gpt3d) or an
    ADM U-Net (runtime.modules.unet3d), stepped by a GridEngine, which does not clip."""

    name = "tensor grid"
    clips = False

    def check(self, unit: UnitPlan, spec: UnitSpec) -> None:
        """What gpt3d and unet3d build: a GPT whose embedding table and vocabulary the grid
        divides, or an ADM U-Net whose layers it divides (the planner checks the FCs, heads
        and micro-batch)."""
        assert unit.grid is not None, f"unit {unit.unit} lies on no tensor grid"
        x, y, z = (unit.mesh.degree(axis) for axis in ("x", "y", "z"))
        where = f"unit {unit.unit} on the tensor grid {unit.mesh.shape()}"
        if unit.grid.gathers == "lightning" and spec.kind == "unet":
            raise PlanRefused(
                f"{where}: gathers=lightning is AxoNN's Lightning strategy for LitGPT's GPTs; the real backend runs a U-Net's "
                f"grid layers with gathers=paper",
                ("gathers",),
                (unit.unit,),
            )
        if spec.kind == "unet":
            # Built as rank 0 of each axis builds it (no groups: nothing communicates).
            grid = Grid3D(Axis(x), Axis(y), Axis(z), Axis(unit.mesh.degree("dp")), layers=unit.grid.layers)
            unet = UNetOnGrid(spec, grid)
            for index, layer in enumerate(spec.layers):
                try:
                    unet.layer(index)
                except ValueError as error:
                    raise PlanRefused(f"{where}: layer {index} ({layer.name}): {error}", ("mesh",), (unit.unit,)) from None
            return
        other = [layer.name for layer in spec.layers if layer.name not in GRID_LAYERS]
        if other or llama_style(spec) is not None:
            what = f"layer {other[0]}" if other else "Llama blocks"
            raise PlanRefused(
                f"{where}: the real backend's 3D-parallel model is a GPT (embedding, blocks, head) or an ADM U-Net, it has "
                f"no {what} (a Llama on a tensor grid runs in the simulator only)",
                ("mesh",),
                (unit.unit,),
            )
        vocab = spec.arch.vocab
        if (vocab + spec.seq_len) % (x * z):
            raise PlanRefused(
                f"{where}: the embedding's {vocab} token + {spec.seq_len} position rows split over G_x x G_z = {x * z}, "
                f"which does not divide them",
                ("mesh",),
                (unit.unit,),
            )
        if vocab % x:
            raise PlanRefused(
                f"{where}: the head's {vocab}-word vocabulary splits over G_x={x}, which does not divide it", ("mesh",), (unit.unit,)
            )

    def lay_out(self, unit: UnitPlan, spec: UnitSpec) -> LaidOut:
        grid = build_grid(unit)
        if spec.kind == "unet":
            return _GridUnit(grid, UNetOnGrid(spec, grid).layer)
        return _GridUnit(grid, partial(grid_layer, spec, grid=grid, vocab=spec.arch.vocab))


RUNTIMES: dict[type, LayoutRuntime] = {TensorGrid: TensorGridRuntime()}


def layout_runtime(unit: UnitPlan) -> LayoutRuntime | None:
    """The runtime of the unit's layout; None: the unit lies on its mesh's tp, dp and pp
    axes alone (DeepSpeed's engines)."""
    return None if unit.grid is None else RUNTIMES[type(unit.grid)]
