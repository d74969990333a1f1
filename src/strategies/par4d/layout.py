"""Par4D's grid and how a unit's layers lie on it (Algorithm 1, §III of the paper).

G = G_x x G_y x G_z x G_data GPUs, X innermost, then Y, Z, data: rank = i + G_x(j +
G_y(k + G_z d)). Every weight GEMM that tensor parallelism splits (a Megatron column- or
row-parallel kernel: qkv, proj, fc1, fc2, a convolution, the LM head) is one FC layer of
Algorithm 1 over (k x n) weights: forward all-gathers its weight block over z and
all-reduces its partial output over y; backward all-reduces the input gradient over x and
reduce-scatters the weight gradient over z. FCs alternate orientation along the data flow
(a transposed FC swaps x and y), as src/mesh.py's Sharding prices them. Off that chain, a
residual block's skip projection reads the block's input, so it lies like the block's
first FC; when its output's columns lie over the other axis than the block's output, it
is re-split (FC.resplit): a U-Net's channel-changing residual blocks.

A layer runs as kernel ranges, each ending with one FC (so each FC's collectives sit right
after its GEMM); kernels after the layer's last FC join its last range. Layers with
parameters but no FC (an embedding table) keep their weights z-sharded and gathered like
an FC's; those with GEMMs no FC parallelises (a U-Net's timestep embedding) run
replicated on the tensor grid, rows split over z, each FC reading their output taking its
slice (FC.embedding_input). A lone FC at either end of the unit (a stem or an output
projection: the first and the last layer with an FC, holding just one) whose channels the
grid does not divide runs replicated on the tensor grid too: a U-Net's 3-channel stem and
6-channel output convolution, which AxoNN leaves unparallelised (the next FC slices the
stem's whole output, LayerLayout.scatter_output; the output conv's input, split over the
previous FC's output axis, is all-gathered first, LayerLayout.gather_input). Any other
layer the grid does not divide is an error.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from src.errors import ConfigError
from src.mesh import Mesh, Sharding
from src.models.conv import GROUPNORM_GROUPS
from src.models.spec import Kernel, UnitSpec
from src.program import GridLayer

GRID_AXES = ("x", "y", "z", "dp")


@dataclass(frozen=True)
class Grid:
    """(G_x, G_y, G_z, G_data)."""

    x: int
    y: int
    z: int
    dp: int

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        return (self.x, self.y, self.z, self.dp)

    @property
    def devices(self) -> int:
        return math.prod(self.degrees)

    @property
    def tensor(self) -> int:
        return self.x * self.y * self.z

    def mesh(self) -> Mesh:
        return Mesh.contiguous(tuple(zip(GRID_AXES, self.degrees)))

    def sharding(self, transposed: bool = False) -> Sharding:
        return Sharding((("x", self.x), ("y", self.y), ("z", self.z)), transposed=transposed)

    def replicated(self) -> Sharding:
        """A layer replicated on the tensor grid: only its rows split over z."""
        return Sharding((("z", self.z),))

    def label(self) -> str:
        return "(" + ",".join(str(d) for d in self.degrees) + ")"


def grids(devices: int) -> list[Grid]:
    """Every (G_x, G_y, G_z, G_data) whose product is `devices`."""
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    out = []
    for x, y, z in itertools.product(divisors, repeat=3):
        if devices % (x * y * z) == 0:
            out.append(Grid(x, y, z, devices // (x * y * z)))
    return out


@dataclass(frozen=True)
class FC:
    """One FC layer of Algorithm 1: kernel `kernel` of its layer, an (m x k) @ (k x n)
    product per sample; transposed: rows over x and columns over y. resplit: a skip
    projection whose output columns lie over the other axis than the layer's output's, so
    it is all-gathered over its column axis and the layer's slice kept (its gradient
    likewise over the row axis). embedding_input: it slices its input columns from an
    embedding every rank holds whole (a replicated layer's), so the input's gradient is
    all-gathered over its row axis."""

    kernel: int
    m: int
    k: int
    n: int
    transposed: bool
    resplit: bool = False
    embedding_input: bool = False

    def axes(self) -> tuple[str, str]:
        """(a, b): the axes splitting the output columns (n) and the input columns (k)."""
        return ("y", "x") if self.transposed else ("x", "y")


@dataclass(frozen=True)
class LayerLayout:
    """How one layer runs on the grid: its sharding, its kernel ranges (None: the whole
    layer at once) and the FC that ends each range (None: a range without one)."""

    index: int
    sharding: Sharding
    ranges: tuple[tuple[int, int] | None, ...]
    fcs: tuple[FC | None, ...]
    params: int
    gather_input: str | None = None  # a replicated last layer: the axis its split input is all-gathered over
    scatter_output: str | None = None  # a replicated first layer: the axis the next FC reads its output's slice over

    def placement(self) -> GridLayer:
        """What a backend needs to lay the layer out as this does."""
        return GridLayer(
            transposed=self.sharding.transposed,
            replicated=[axis for axis, _ in self.sharding.axes] == ["z"],
            gathers=self.gather_input,
            scatters=self.scatter_output,
            resplit=any(fc is not None and fc.resplit for fc in self.fcs),
        )

    def gathered_params(self, grid: Grid) -> float:
        """Elements of this layer's weights once all-gathered over z on one rank."""
        fcs = [fc for fc in self.fcs if fc is not None]
        if fcs:
            return sum(fc.k * fc.n for fc in fcs) / (grid.x * grid.y)
        return self.params / (self.sharding.devices // self.sharding.degree("z"))


def _is_fc(kernel: Kernel) -> bool:
    return kernel.kind == "gemm" and kernel.has_weight and kernel.tp_split in ("n", "k")


@dataclass(frozen=True)
class _Shape:
    """A layer's place in the orientation chain, independent of the grid's degrees;
    output: the orientation of the FC whose output the layer's output is."""

    transposed: bool
    ranges: tuple[tuple[int, int] | None, ...]
    fcs: tuple[FC, ...]
    heads: int
    output: bool
    group_norms: bool  # normalises channel groups, which must lie whole on a rank


def _problem(grid: Grid, shape: _Shape) -> str | None:
    for fc in shape.fcs:
        (axis_a, axis_b), (a, b) = fc.axes(), ((grid.y, grid.x) if fc.transposed else (grid.x, grid.y))
        if fc.n % a:
            return f"G_{axis_a}={a} does not divide its {fc.n} output columns"
        if fc.k % b:
            return f"G_{axis_b}={b} does not divide its {fc.k} input columns"
    axis, degree = ("y", grid.y) if shape.transposed else ("x", grid.x)
    if shape.heads > 1 and shape.heads % degree:
        return f"G_{axis}={degree} does not divide the {shape.heads} attention heads"
    if shape.group_norms:
        for axis, degree in (("x", grid.x), ("y", grid.y)):
            if GROUPNORM_GROUPS % degree:
                return f"G_{axis}={degree} splits its {GROUPNORM_GROUPS} GroupNorm groups over ranks (statistics are per group)"
    return None


class UnitGrid:
    """A unit's layers on Par4D grids: the orientation chain (computed once; it changes
    only if the first layer runs replicated), validity and layouts per grid."""

    def __init__(self, unit: UnitSpec) -> None:
        self.unit = unit
        self._fc_kernels = [sum(1 for k in layer.kernels if _is_fc(k)) for layer in unit.layers]
        with_fc = [i for i, count in enumerate(self._fc_kernels) if count]
        self._first_last = (with_fc[0], with_fc[-1]) if with_fc else (-1, -1)
        self._checked: dict[Grid, tuple[tuple[_Shape | None, ...], bool]] = {}
        self._chains: dict[bool, tuple[_Shape | None, ...]] = {}
        self._counts: dict[tuple[bool, bool], dict[FC, int]] = {}

    def _ends(self) -> tuple[int, int]:
        """The first and the last layer with an FC."""
        return self._first_last

    def _lone(self, index: int) -> bool:
        return self._fc_kernels[index] == 1

    def _chain(self, replicate_first: bool) -> tuple[_Shape | None, ...]:
        """Per layer its shape (None: no FC), the first FC layer's dropped if replicated."""
        if replicate_first not in self._chains:
            out: list[_Shape | None] = []
            produced: bool | None = None  # orientation of the FC that made the current activations
            shapes: dict[tuple[int, bool | None], tuple[_Shape, bool]] = {}
            first_fc = self._ends()[0]
            for index, layer in enumerate(self.unit.layers):
                fc_kernels = [i for i, k in enumerate(layer.kernels) if _is_fc(k)]
                if not fc_kernels or (index == first_fc and replicate_first):
                    out.append(None)
                    continue
                key = (id(layer), produced)
                if key not in shapes:
                    first = not produced if produced is not None else False
                    transposed = first != (layer.kernels[fc_kernels[0]].tp_split == "k")
                    oriented = {i: transposed != (layer.kernels[i].tp_split == "k") for i in fc_kernels}
                    # The layer's output is its last FC's on the chain (a skip projection
                    # reads the layer's input and is added to that output).
                    output = next(oriented[i] for i in reversed(fc_kernels) if not layer.kernels[i].skip_projection)
                    fcs = tuple(
                        FC(
                            i,
                            layer.kernels[i].m,
                            layer.kernels[i].k,
                            layer.kernels[i].n,
                            oriented[i],
                            resplit=layer.kernels[i].skip_projection and oriented[i] != output,
                            embedding_input=layer.kernels[i].reads_embedding,
                        )
                        for i in fc_kernels
                    )
                    ends = [i + 1 for i in fc_kernels]
                    ends[-1] = len(layer.kernels)
                    ranges = tuple(zip([0] + ends[:-1], ends)) if len(ends) > 1 else (None,)
                    heads = max((k.batch for k in layer.kernels if k.kind == "gemm" and k.tp_split == "batch"), default=1)
                    norms = any(k.name.startswith("groupnorm") for k in layer.kernels)
                    shapes[key] = (_Shape(transposed, ranges, fcs, heads, output, norms), output)
                shape, produced = shapes[key]
                out.append(shape)
            self._chains[replicate_first] = tuple(out)
        return self._chains[replicate_first]

    def check(self, grid: Grid) -> tuple[tuple[_Shape | None, ...], bool]:
        """(the chain on `grid`, whether the last FC layer runs replicated); ConfigError
        naming the first layer the grid does not divide."""
        if grid not in self._checked:
            self._checked[grid] = self._check(grid)
        return self._checked[grid]

    def _check(self, grid: Grid) -> tuple[tuple[_Shape | None, ...], bool]:
        first, last = self._ends()
        first_shape = self._chain(False)[first] if first >= 0 else None
        replicate_first = first_shape is not None and self._lone(first) and _problem(grid, first_shape) is not None
        chain = self._chain(replicate_first)
        replicate_last = False
        seen: dict[int, str | None] = {}
        for index, shape in enumerate(chain):
            if shape is None:
                continue
            if id(shape) not in seen:
                seen[id(shape)] = _problem(grid, shape)
            problem = seen[id(shape)]
            if problem and index == last and self._lone(index):
                replicate_last = True
            elif problem:
                layer = self.unit.layers[index]
                raise ConfigError(f"grid {grid.label()}: layer {index} ({layer.name}) of unit {self.unit.name}: {problem}")
        return chain, replicate_last

    def fc_counts(self, grid: Grid) -> dict[FC, int]:
        """The FC layers the grid parallelises, by shape (m, k, n, orientation)."""
        chain, replicate_last = self.check(grid)
        last = self._ends()[1]
        key = (chain[self._ends()[0]] is None, replicate_last)
        if key not in self._counts:
            counts: dict[FC, int] = {}
            for index, shape in enumerate(chain):
                if shape is None or (replicate_last and index == last):
                    continue
                for fc in shape.fcs:
                    shape_key = FC(0, fc.m, fc.k, fc.n, fc.transposed)
                    counts[shape_key] = counts.get(shape_key, 0) + 1
            self._counts[key] = counts
        return self._counts[key]

    def layout(self, grid: Grid) -> list[LayerLayout]:
        chain, replicate_last = self.check(grid)
        first, last = self._ends()
        out = []
        for index, (layer, shape) in enumerate(zip(self.unit.layers, chain)):
            if index == last and replicate_last:
                before = [s for s in chain[:index] if s is not None]
                axis = ("y" if before[-1].output else "x") if before else None
                gather = axis if axis is not None and getattr(grid, axis) > 1 else None
                out.append(LayerLayout(index, grid.replicated(), (None,), (None,), layer.params, gather_input=gather))
            elif index == first and shape is None:
                after = next((s for s in chain[index + 1 :] if s is not None), None)
                axis = after.fcs[0].axes()[1] if after else None
                scatter = axis if axis is not None and getattr(grid, axis) > 1 else None
                out.append(LayerLayout(index, grid.replicated(), (None,), (None,), layer.params, scatter_output=scatter))
            elif shape is None and any(k.kind == "gemm" and k.has_weight for k in layer.kernels):
                out.append(LayerLayout(index, grid.replicated(), (None,), (None,), layer.params))
            elif shape is None:
                out.append(LayerLayout(index, grid.sharding(), (None,), (None,), layer.params))
            else:
                out.append(LayerLayout(index, grid.sharding(shape.transposed), shape.ranges, shape.fcs, layer.params))
        return out
