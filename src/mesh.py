"""Named device meshes and how a layer's tensors are split over them.

A Mesh lays a unit's ranks out as a grid of named axes, innermost first: Megatron-LM's
(tp, dp, pp), Par4D's (x, y, z, dp), DistMM's towers on their own blocks of ranks. It is
built and validated once per unit; process groups, placement and the runtime's parallel
layers all read it.

A Sharding says how one device's share of a layer is cut from the whole, per
tensor-parallel axis. `tp` is Megatron's: each kernel divides the dimension its tp_split
names (column-parallel n, row-parallel k, attention heads). `x`, `y`, `z` are Par4D's 3D
grid: a layer O = I·W runs on (m/z x k/y) @ (k/y x n/x) blocks; a transposed layer (and a
row-parallel kernel, which follows a column-parallel one) swaps x and y. The cost model's
compute and activation terms and the runtime's layers read the same Sharding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

TENSOR_AXES = ("tp", "x", "y", "z")


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

    def gemm_divisors(self, tp_split: str) -> tuple[int, int, int, int]:
        """Divisors of a GEMM's (m, n, k, batch) on one device, for a kernel whose
        Megatron split is `tp_split` (n, k, batch or none)."""
        if not self.grid:
            tp = self.degree("tp")
            return (1, tp if tp_split == "n" else 1, tp if tp_split == "k" else 1, tp if tp_split == "batch" else 1)
        x, y, z = self.degree("x"), self.degree("y"), self.degree("z")
        if self.transposed != (tp_split == "k"):
            x, y = y, x
        if tp_split == "batch":  # attention: heads split like the producing layer's columns
            return (z, 1, 1, x)
        return (z, x, y, 1)

    def memory_divisor(self, tp_split: str) -> int:
        """How many devices share a bandwidth-bound kernel's bytes."""
        if not self.grid:
            split = tp_split != "none" or self.sequence_parallel
            return self.degree("tp") if split else 1
        # Activations are split over rows (z) and columns (x); y holds copies.
        return self.degree("z") * self.degree("x")

    def activation_divisors(self) -> tuple[int, int]:
        """(divisor of the replicated activations, divisor of the split ones)."""
        if not self.grid:
            tp = self.degree("tp")
            return (tp if self.sequence_parallel else 1), tp
        rows = self.degree("z")
        return rows * self.degree("x"), rows * self.degree("x")

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
