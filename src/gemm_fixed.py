"""A GEMM kernel's fixed device time (cluster.gemm_fixed_s), fitted to a device's measured GEMMs.

    python -m src.gemm_fixed [conf/cluster/measured/gemm_fixed/hopper_xla_batched.yaml]

A GEMM does not run in proportion to its FLOPs when it is small: before its first multiply
its tiles wait on their operands from memory, after its last its epilogue stores the output,
and the kernel takes that time whatever its size. The preset's curve (gemm_max_efficiency,
gemm_half_dim) prices the arithmetic; this fits the one time more every GEMM kernel takes,
the curve held, by least squares in log time over the file's GEMMs (a batched row is one
kernel of b GEMMs, as the cost model prices one). A file states how its times were taken:
`timing: kernel`, a profiler's kernel durations, which hold no gap between kernels (the
model's per-kernel gap, kernel_overhead_s, is left out of the comparison), or `stream`,
kernels timed back to back, which do. The fit is the preset's input; the preset's check is
elsewhere (src.heldout, on GEMMs the file leaves out).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from src.errors import ConfigError, reject_unknown
from src.measured_files import read_yaml

if TYPE_CHECKING:
    from src.cluster import ClusterSpec

CLUSTERS = Path(__file__).resolve().parent.parent / "conf" / "cluster"
DEFAULT = CLUSTERS / "measured" / "gemm_fixed" / "hopper_xla_batched.yaml"
STEP_S = 1e-8  # the fit's resolution: a hundredth of a microsecond
TIMINGS = ("kernel", "stream")


@dataclass(frozen=True)
class BatchedGemm:
    """`b` GEMMs of C[m, n] = A[m, k] @ B[k, n] in one kernel, measured at `flop_per_s`."""

    b: int
    m: int
    n: int
    k: int
    flop_per_s: float

    @property
    def seconds(self) -> float:
        return 2.0 * self.b * self.m * self.n * self.k / self.flop_per_s


@dataclass(frozen=True)
class GemmFile:
    path: Path
    source: str
    cluster: str
    precision: str
    timing: str  # "kernel" or "stream"
    gemms: tuple[BatchedGemm, ...]


def load(path: Path) -> GemmFile:
    """The file's GEMMs, or one line naming what is wrong with it."""
    where = str(path)
    if not path.is_file():
        raise ConfigError(f"{where}: no such file")
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must map name, source, cluster, precision, timing and gemms")
    reject_unknown(data, ["name", "source", "cluster", "precision", "timing", "gemms"], f"key(s) of {where}")
    for key in ("source", "cluster", "precision"):
        if not str(data.get(key) or "").strip():
            raise ConfigError(f"{where} must say its {key}")
    presets = sorted(p.stem for p in CLUSTERS.glob("*.yaml"))
    if data["cluster"] not in presets:
        raise ConfigError(f"{where}: cluster {data['cluster']!r} is not a preset ({presets})")
    if data.get("timing") not in TIMINGS:
        raise ConfigError(f"{where}: timing is one of {list(TIMINGS)} (how its times were taken), got {data.get('timing')!r}")
    rows = data.get("gemms")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{where}: gemms lists [b, m, n, k, flop_per_s] rows, got {rows!r}")
    gemms = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 5 or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in row):
            raise ConfigError(f"{where}: a GEMM is [b, m, n, k, flop_per_s], got {row!r}")
        if min(row) <= 0 or any(int(v) != v for v in row[:4]):
            raise ConfigError(f"{where}: a GEMM's b, m, n, k are whole and positive and its rate positive, got {row!r}")
        b, m, n, k = (int(v) for v in row[:4])
        gemms.append(BatchedGemm(b, m, n, k, float(row[4])))
    return GemmFile(path, str(data["source"]), str(data["cluster"]), str(data["precision"]), data["timing"], tuple(gemms))


def model_seconds(cluster: ClusterSpec, data: GemmFile, gemms: Sequence[BatchedGemm], fixed_s: float) -> list[float]:
    """Each GEMM's time in the cost model with the cluster's gemm_fixed_s set to `fixed_s`, as
    the file timed it (a kernel's duration: without the gap between kernels)."""
    from src.costmodel.compute import ComputeModel

    compute = ComputeModel(replace(cluster, gemm_fixed_s=fixed_s), data.precision)
    timed = compute.gemm_duration if data.timing == "kernel" else compute.gemm_time
    return [timed(g.m, g.n, g.k, g.b) for g in gemms]


def fit(cluster: ClusterSpec, data: GemmFile) -> float:
    """The fixed time (to STEP_S, from 0 to the shortest measured time) whose model times
    err least in squared log time over the file's GEMMs."""
    measured = [g.seconds for g in data.gemms]

    def error(fixed_s: float) -> float:
        return sum(math.log(t / m) ** 2 for t, m in zip(model_seconds(cluster, data, data.gemms, fixed_s), measured))

    steps = int(min(measured) / STEP_S)
    return min((i * STEP_S for i in range(steps + 1)), key=error)


def main(argv: list[str] | None = None) -> int:
    from src.setup import preset_cluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", type=Path, default=DEFAULT)
    args = parser.parse_args(argv)
    try:
        data = load(args.file)
        cluster = preset_cluster(data.cluster)
        fixed = fit(cluster, data)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    before = model_seconds(cluster, data, data.gemms, 0.0)
    after = model_seconds(cluster, data, data.gemms, fixed)
    print(f"{data.path.name} ({data.source})")
    print(f"cluster {data.cluster}: gemm_fixed_s fitted {fixed * 1e6:.2f} us (preset states {cluster.gemm_fixed_s * 1e6:.2f} us)")
    print(f"times as the file took them ({data.timing}); the model's without a fixed time and with the fitted one:")
    print(f"{'b':>2} {'m':>5} {'n':>5} {'k':>5} {'measured us':>12} {'model, none':>12} {'model, fitted':>14}")
    for g, t0, t1 in zip(data.gemms, before, after):
        print(f"{g.b:>2} {g.m:>5} {g.n:>5} {g.k:>5} {g.seconds * 1e6:>12.2f} {t0 * 1e6:>12.2f} {t1 * 1e6:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
