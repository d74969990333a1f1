"""A GPU preset's GEMM curve (gemm_max_efficiency, gemm_half_dim), fitted to public GEMMs.

    python benchmarks/fit_gemm_curve.py [PRESET]     # dgx_a100 (the default), p3_16xlarge or frontier

The curve is the grid point of least squared log-time error, each GEMM priced as the cost model
prices it, the curve alone (a preset's measured table, which corrects the curve at its shapes,
left out of the pricing it is fitted to):

- `dgx_a100` (whose curve `a800` and `perlmutter` share): no public table times an A100's GEMM
  library by shape, so it is fitted to what two campaigns published, the best shape
  stas00/ml-engineering's `mamf-finder.py` found and the GEMMs of one transformer layer from
  EleutherAI/cookbook's sizing benchmark (two of them batched: `torch.bmm` over micro-batch x
  heads), each a kernel's duration (`ComputeModel.gemm_duration`: a batched kernel's b GEMMs
  fill the device as one of b x m rows).
- a preset with a measured table (`p3_16xlarge`: conf/cluster/measured/gemm/v100_deepbench.yaml;
  `frontier`: frontier_rocblas.yaml): its GEMMs, each time taken around the call (host-timed
  over back-to-back calls; events around each), so priced with the gap between kernels
  (`ComputeModel.gemm_time`).
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, replace

from src.costmodel.compute import ComputeModel
from src.cluster import ClusterSpec
from src.cluster_profile import preset_file
from src.config import group_options
from src.setup import preset_cluster


@dataclass(frozen=True)
class PublicGemm:
    """b GEMMs of m x n x k in one kernel that took `seconds`; `with_gap`: a host-timed mean of
    back-to-back calls (the gap between kernels in it), else a kernel's own duration."""

    b: int
    m: int
    n: int
    k: int
    seconds: float
    with_gap: bool


def _from_tflops(b: int, m: int, n: int, k: int, tflops: float) -> PublicGemm:
    return PublicGemm(b, m, n, k, 2.0 * b * m * n * k / (tflops * 1e12), with_gap=False)


# stas00/ml-engineering compute/accelerator/README.md at f0cca2f, the MAMF table's A100 SXM;
# EleutherAI/cookbook benchmarks/sizing/sample_results/transformer.out at 0f810f8 (hidden 4096,
# 16 heads, micro-batch 4, sequence 2048, vocabulary 51200).
PUBLIC_A100 = (
    _from_tflops(1, 6912, 2048, 16384, 267.9),  # mamf-finder's best shape
    _from_tflops(1, 8192, 12288, 4096, 241.616),  # qkv_transform
    _from_tflops(64, 2048, 2048, 256, 130.182),  # attention_score: bmm, k = head dimension
    _from_tflops(64, 2048, 256, 2048, 218.952),  # attention_over_value: bmm, n = head dimension
    _from_tflops(1, 8192, 4096, 4096, 234.852),  # attention_linear_projection
    _from_tflops(1, 8192, 16384, 4096, 241.128),  # mlp_h_to_4h
    _from_tflops(1, 8192, 4096, 16384, 252.764),  # mlp_4h_to_h
    _from_tflops(1, 8192, 51200, 4096, 255.380),  # logit_block
)
MAX_EFFICIENCIES = [x / 100 for x in range(50, 100)]
HALF_DIMS = range(16, 513)


@functools.lru_cache(maxsize=4)
def _preset(name: str) -> ClusterSpec:
    return preset_cluster(name)


def fitted_presets() -> list[str]:
    """The presets whose curve this fits: dgx_a100 and those with a measured GEMM table."""
    return [n for n in group_options("cluster") if n == "dgx_a100" or (preset_file(n) or {}).get("gemm_measurements")]


@functools.lru_cache(maxsize=4)
def public_gemms(preset: str) -> tuple[PublicGemm, ...]:
    """The public GEMMs a preset's curve is fitted to."""
    if preset == "dgx_a100":
        return PUBLIC_A100
    table = _preset(preset).gemm_measurements
    assert table is not None, "fitted_presets() holds only presets with a table"
    return tuple(PublicGemm(1, p.m, p.n, p.k, p.seconds, with_gap=True) for p in table.points)


def log_errors(preset: str, max_efficiency: float, half_dim: float) -> list[float]:
    """Each public GEMM's log of its priced time over its published time, the curve alone."""
    cluster = replace(_preset(preset), gemm_max_efficiency=max_efficiency, gemm_half_dim=half_dim, gemm_measurements=None)
    model = ComputeModel(cluster, cluster.default_precision)
    priced = [(model.gemm_time if g.with_gap else model.gemm_duration)(g.m, g.n, g.k, g.b) for g in public_gemms(preset)]
    return [math.log(p / g.seconds) for p, g in zip(priced, public_gemms(preset))]


def fit(preset: str = "dgx_a100") -> tuple[float, float, list[float]]:
    """The grid point of least squared log-time error, and its errors."""
    best = min((sum(e * e for e in log_errors(preset, me, h)), me, h) for me in MAX_EFFICIENCIES for h in HALF_DIMS)
    return best[1], best[2], log_errors(preset, best[1], best[2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", default="dgx_a100", help="one of %(choices)s", choices=fitted_presets())
    preset = parser.parse_args().preset
    max_efficiency, half_dim, errors = fit(preset)
    rms = 100 * math.sqrt(sum(e * e for e in errors) / len(errors))
    print(f"{preset}: gemm_max_efficiency {max_efficiency}, gemm_half_dim {half_dim}: RMS log-time error {rms:.1f} %")
    for g, error in zip(public_gemms(preset), errors):
        tflops, priced = 2.0 * g.b * g.m * g.n * g.k / g.seconds / 1e12, 100 * math.expm1(error)
        print(f"  b {g.b:3d}  {g.m:6d} x {g.n:6d} x {g.k:6d}  published {tflops:6.1f} TFLOP/s  priced {priced:+6.1f} % in time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
