"""Named device meshes and how a layer's tensors are split over them.

A Mesh lays a unit's ranks out as a grid of named axes, innermost first: Megatron-LM's
(tp, dp, pp), Par4D's (x, y, z, dp), DistMM's towers on their own blocks of ranks. It is
built and validated once per unit; process groups, placement and the runtime's parallel
layers all read it.

A Sharding says how one device's share of a layer is cut from the whole, per
tensor-parallel axis. `tp` is Megatron's: each kernel divides the dimension its tp_split
names (column-parallel n, row-parallel k, attention heads). `x`, `y`, `z` are Par4D's 3D
grid (Algorithm 1): an FC layer O = I·W runs on (m/z x k/y) @ (k/y x n/x) blocks and its
output O is (m/z x n/x), whole on every rank of its y group. The next FC reads that as its
input, so it is "transposed" (x and y swap roles). Inside a layer this alternation follows
the Megatron split of each weight GEMM: a column-parallel kernel (n) is one orientation, a
row-parallel one (k) the other; `transposed` flips the whole layer (the next layer after
an odd number of FCs, as in a U-Net's chain of convolutions). So a transformer block runs
qkv and fc1 as (x columns, y rows) and proj and fc2 transposed; what lies between them
lives on the layout the last FC left:
- the residual stream and what reads it (layer norms, residual adds; tp_split 'none'):
  rows over z, hidden columns over y ("b", the row axis of the next FC), copies over x;
- an FC's output before the next one (attention heads, the MLP's activation; 'n' and
  'batch'): rows over z, columns over x ("a"), copies over y.
Rows (tokens, pixels) are split over z by whole samples. The cost model's compute,
activation and memory terms and the runtime's layers read the same Sharding.

A unit replicated over its pipeline's TP group (DistTrain §2.1's Megatron-LM: an encoder
too small for TP) has a `rows` mesh axis where the others have tp: each of its ranks holds
the whole unit and runs its share of each micro-batch's rows, and it splits no tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

TENSOR_AXES = ("tp", "x", "y", "z")
# The mesh axis of a unit replicated over its pipeline's TP group: whole copies, each on its
# share of a micro-batch's rows (data parallelism inside the TP group).
ROWS = "rows"


@dataclass(frozen=True, slots=True)
class Sharding:
    axes: tuple[tuple[str, int], ...] = ()
    sequence_parallel: bool = False
    transposed: bool = False

    def __post_init__(self) -> None:
        for name, degree in self.axes:
            if name not in TENSOR_AXES:
                raise ValueError(f"sharding axis {name!r} is not a tensor-parallel axis {TENSOR_AXES}")
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ValueError(f"sharding axis {name} has degree {degree!r}")
        if "tp" in dict(self.axes) and any(name in dict(self.axes) for name in "xyz"):
            raise ValueError("a sharding is Megatron-style (tp) or a 3D grid (x, y, z), not both")

    def degree(self, axis: str) -> int:
        for name, degree in self.axes:
            if name == axis:
                return degree
        return 1

    @property
    def devices(self) -> int:
        return math.prod(degree for _, degree in self.axes)

    @property
    def grid(self) -> bool:
        return any(name in ("x", "y", "z") for name, _ in self.axes)

    def _columns_rows(self) -> tuple[int, int]:
        """(a, b): the degrees of the axes splitting a column-parallel FC's output
        columns and input columns in this layer (x and y, swapped when transposed)."""
        x, y = self.degree("x"), self.degree("y")
        return (y, x) if self.transposed else (x, y)

    def gemm_divisors(self, tp_split: str) -> tuple[int, int, int, int]:
        """Divisors of a GEMM's (m, n, k, batch) on one device, for a kernel whose
        Megatron split is `tp_split` (n, k, batch or none)."""
        if not self.grid:
            tp = self.degree("tp")
            return (1, tp if tp_split == "n" else 1, tp if tp_split == "k" else 1, tp if tp_split == "batch" else 1)
        z = self.degree("z")
        a, b = self._columns_rows()
        if tp_split == "n":  # (m/z x k/b) @ (k/b x n/a)
            return (z, a, b, 1)
        if tp_split == "k":  # transposed: (m/z x k/a) @ (k/a x n/b)
            return (z, b, a, 1)
        if tp_split == "batch":  # attention heads, split like the producing FC's columns
            return (z, 1, 1, a)
        return (z, 1, 1, 1)  # replicated on the grid: only the rows are split

    def memory_divisor(self, tp_split: str) -> int:
        """How many devices share a bandwidth-bound kernel's bytes."""
        if not self.grid:
            split = tp_split != "none" or self.sequence_parallel
            return self.degree("tp") if split else 1
        a, b = self._columns_rows()
        return self.degree("z") * (b if tp_split == "none" else a)

    def activation_divisors(self) -> tuple[int, int]:
        """(divisor of the replicated activations, divisor of the split ones). On the
        grid, Korthikanti's 'replicated' tensors (layer-norm inputs and outputs, dropout
        masks, the inputs of qkv and fc1) lie on the residual layout (z x b); the 'split'
        ones and the attention scores on an FC's output layout (z x a)."""
        if not self.grid:
            tp = self.degree("tp")
            return (tp if self.sequence_parallel else 1), tp
        a, b = self._columns_rows()
        z = self.degree("z")
        return z * b, z * a

    def label(self) -> str:
        return "x".join(f"{name}{degree}" for name, degree in self.axes) or "1"


def tensor_parallel(tp: int, sequence_parallel: bool = False) -> Sharding:
    """Megatron-LM's sharding of degree `tp` (no axis when tp is 1)."""
    return Sharding((("tp", tp),) if tp > 1 else (), sequence_parallel and tp > 1)


@dataclass(frozen=True)
class Mesh:
    """`ranks` laid out as a grid of named `axes`, innermost first: the rank at
    coordinates (c_0, c_1, ...) is ranks[c_0 + d_0·(c_1 + d_1·(c_2 + ...))]."""

    axes: tuple[tuple[str, int], ...]
    ranks: tuple[int, ...]
    _index: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axes {names} repeat a name")
        for name, degree in self.axes:
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ValueError(f"mesh axis {name} has degree {degree!r}")
        size = math.prod(degree for _, degree in self.axes)
        if len(self.ranks) != size:
            raise ValueError(f"mesh {self.shape()} holds {size} ranks, given {len(self.ranks)}")
        self._index.update((rank, i) for i, rank in enumerate(self.ranks))
        if len(self._index) != size:
            raise ValueError(f"mesh {self.shape()} lists a rank twice")

    @classmethod
    def contiguous(cls, axes: tuple[tuple[str, int], ...], offset: int = 0) -> Mesh:
        return cls(axes, tuple(range(offset, offset + math.prod(d for _, d in axes))))

    def shape(self) -> str:
        return "x".join(f"{name}{degree}" for name, degree in self.axes)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    def __iter__(self) -> Iterator[int]:
        return iter(self.ranks)

    def degree(self, axis: str) -> int:
        for name, degree in self.axes:
            if name == axis:
                return degree
        return 1

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for name, degree in self.axes:
            strides[name] = stride
            stride *= degree
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        if rank not in self._index:
            raise KeyError(f"rank {rank} is not in mesh {self.shape()}")
        index, out = self._index[rank], {}
        for name, degree in self.axes:
            index, out[name] = divmod(index, degree)
        return out

    def rank(self, **coords: int) -> int:
        """The rank at these coordinates (axes not given are 0)."""
        strides = self._strides()
        unknown = set(coords) - set(strides)
        if unknown:
            raise KeyError(f"mesh {self.shape()} has no axis {sorted(unknown)}")
        index = 0
        for name, value in coords.items():
            if not 0 <= value < self.degree(name):
                raise IndexError(f"coordinate {name}={value} outside mesh {self.shape()}")
            index += value * strides[name]
        return self.ranks[index]

    def slice(self, **fixed: int) -> tuple[int, ...]:
        """The ranks whose coordinates on the given axes are fixed, in mesh order."""
        strides = self._strides()
        unknown = set(fixed) - set(strides)
        if unknown:
            raise KeyError(f"mesh {self.shape()} has no axis {sorted(unknown)}")
        indices = [sum(value * strides[name] for name, value in fixed.items())]
        for name, degree in self.axes:  # innermost first: it varies fastest
            if name not in fixed:
                indices = [i + v * strides[name] for v in range(degree) for i in indices]
        return tuple(self.ranks[i] for i in indices)

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks along `axis` through `rank` (itself alone if the mesh has no such axis)."""
        if self.degree(axis) == 1:
            return (rank,)
        coords = self.coords(rank)
        return tuple(self.rank(**{**coords, axis: v}) for v in range(self.degree(axis)))

    def family(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis`, in mesh order of their first members."""
        stride = self._strides().get(axis, 1)
        degree = self.degree(axis)
        seen: set[int] = set()
        out = []
        for index, rank in enumerate(self.ranks):
            if rank in seen:
                continue
            members = tuple(self.ranks[index + v * stride] for v in range(degree))
            seen.update(members)
            out.append(members)
        return out
