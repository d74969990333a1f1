"""GEMM rates measured by shape on one device (conf/cluster/measured/gemm/<name>.yaml).

A preset's GEMM curve (gemm_max_efficiency, gemm_half_dim) is one smooth form over all
shapes; where a device's library departs from that form, as rocBLAS does on an MI250X (its
rate levels off near 110 TFLOP/s from dimensions of 2048 up, where the form keeps rising),
a table of measured shapes corrects it: the curve's error at each measured shape, in log
rate, weighted by the inverse eighth power of the distance to it in log2 dimensions. On the
MI250X table, leaving each shape out in turn and predicting it from the rest, the inverse
square (Shepard's) errs by 0.116 in log rate on average (0.238 at worst), the eighth power
by 0.117 (0.190), and the eighth overshoots less between measured shapes (6000^3: 102
TFLOP/s against the square's 114, between 4096^3's 101 and 8192^3's 106). Neither is
monotone, nor is the library: 1000^3 runs 17 % slower than 1024^3, 3000 x 2000 x 1500
slower than 2048^3. A measured shape gets its own rate back, a shape between them the
nearer ones' correction. The table is not extrapolated: a dimension past the largest
measured one runs as that one does (the library has levelled off), and one below the
smallest falls off as the curve says from the smallest's corrected rate.
"""

from __future__ import annotations

import functools
import math

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from src.errors import ConfigError
from src.measured_files import measured_file, read_table, table_precisions

# A measured shape weighs 1 / distance^8: its squared distance to the 4th.
INVERSE_POWER_HALF = 4
GEMM_DIR = Path(__file__).resolve().parent.parent / "conf" / "cluster" / "measured" / "gemm"


@dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM: C[m, n] = A[m, k] @ B[k, n] in `seconds`."""

    m: int
    n: int
    k: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class GemmMeasurements:
    """A GEMM library's measured times by shape on one device, at `precisions`."""

    name: str
    library: str
    source: str
    precisions: tuple[str, ...]
    points: tuple[GemmPoint, ...]


class GemmCorrection:
    """A shape's fraction of `peak` by a measured table and a curve: the curve (the
    fraction of peak the preset's smooth form gives a shape) at the shape with each
    dimension capped at the table's largest, times exp(the weighted mean of the curve's log
    errors at the measured shapes, taken at the shape clamped into the table's range).
    `overhead` is the per-kernel time a measured time includes beyond its arithmetic (the
    cost model adds it to every GEMM)."""

    def __init__(self, table: GemmMeasurements, curve: Callable[[float, float, float], float], peak: float, overhead: float):
        self._curve = curve
        dims = [(p.m, p.n, p.k) for p in table.points]
        self._low = tuple(min(d[i] for d in dims) for i in range(3))
        self._high = tuple(max(d[i] for d in dims) for i in range(3))
        self._where = [(math.log2(p.m), math.log2(p.n), math.log2(p.k)) for p in table.points]
        self._errors = []
        for p in table.points:
            arithmetic = p.seconds - overhead
            if arithmetic <= 0:
                raise ConfigError(
                    f"conf/cluster/measured/gemm/{table.name}.yaml: the {p.m}x{p.n}x{p.k} GEMM's {p.seconds * 1e6:.3g} us "
                    f"is no longer than the preset's per-kernel overhead ({overhead * 1e6:.3g} us)"
                )
            self._errors.append(math.log(p.flops / arithmetic / (peak * curve(p.m, p.n, p.k))))

    def efficiency(self, m: float, n: float, k: float) -> float:
        capped = [min(d, high) for d, high in zip((m, n, k), self._high)]
        at = [math.log2(min(max(d, low), high)) for d, low, high in zip((m, n, k), self._low, self._high)]
        return min(1.0, self._curve(*capped) * math.exp(self._error_at(at)))

    def _error_at(self, at: list[float]) -> float:
        total = weights = 0.0
        for where, error in zip(self._where, self._errors):
            distance = sum((a - b) ** 2 for a, b in zip(at, where))
            if distance < 1e-18:
                return error
            weight = distance**-INVERSE_POWER_HALF
            total += error * weight
            weights += weight
        return total / weights


def measured_gemms(name: str, cluster: str = "?") -> GemmMeasurements:
    """The measured GEMM table conf/cluster/measured/gemm/<name>.yaml, checked."""
    path = measured_file(GEMM_DIR, "conf/cluster/measured/gemm", name, "GEMM measurements", cluster)
    return _read(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read(path: Path, mtime_ns: int) -> GemmMeasurements:
    where = f"conf/cluster/measured/gemm/{path.name}"
    data = read_table(path, where, ["name", "library", "source", "precisions", "gemms"], ("library", "source"))
    precisions = table_precisions(data, where, ("fp32", "bf16", "fp16"), "precisions the times")
    rows = data.get("gemms")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{where}: gemms lists [m, n, k, ms] rows, got {rows!r}")
    points: dict[tuple[int, int, int], GemmPoint] = {}
    for row in rows:
        if not isinstance(row, list) or len(row) != 4 or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in row):
            raise ConfigError(f"{where}: a GEMM is [m, n, k, ms], got {row!r}")
        m, n, k, ms = row
        if min(m, n, k) < 1 or int(m) != m or int(n) != n or int(k) != k or ms <= 0:
            raise ConfigError(f"{where}: a GEMM's dimensions are whole and positive and its time positive, got {row!r}")
        shape = (int(m), int(n), int(k))
        if shape in points:
            raise ConfigError(f"{where}: the {m}x{n}x{k} GEMM is measured twice")
        points[shape] = GemmPoint(*shape, seconds=float(ms) / 1e3)
    return GemmMeasurements(
        name=path.stem,
        library=str(data["library"]),
        source=str(data["source"]),
        precisions=precisions,
        points=tuple(points.values()),
    )
