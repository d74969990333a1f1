"""The A100 presets' GEMM curve (gemm_max_efficiency, gemm_half_dim), fitted to public A100 GEMMs.

    python benchmarks/fit_a100_gemm_curve.py

No public table times an A100's GEMM library by shape, so the curve of `dgx_a100`, `a800` and
`perlmutter` is fitted to what two campaigns published: the best shape stas00/ml-engineering's
`mamf-finder.py` found, and the GEMMs of one transformer layer from EleutherAI/cookbook's sizing
benchmark (two of them batched: `torch.bmm` over micro-batch x heads). Each is priced as the
cost model prices it (`ComputeModel.gemm_duration`: a batched kernel's b GEMMs fill the device
as one of b x m rows), and the curve is the grid point of least squared log-time error.
"""

from __future__ import annotations

import math
from dataclasses import replace

from src.costmodel.compute import ComputeModel
from src.setup import preset_cluster

# (b, m, n, k, TFLOP/s): stas00/ml-engineering compute/accelerator/README.md at f0cca2f, the MAMF
# table's A100 SXM; EleutherAI/cookbook benchmarks/sizing/sample_results/transformer.out at
# 0f810f8 (hidden 4096, 16 heads, micro-batch 4, sequence 2048, vocabulary 51200).
PUBLIC = (
    (1, 6912, 2048, 16384, 267.9),  # mamf-finder's best shape
    (1, 8192, 12288, 4096, 241.616),  # qkv_transform
    (64, 2048, 2048, 256, 130.182),  # attention_score: bmm, k = head dimension
    (64, 2048, 256, 2048, 218.952),  # attention_over_value: bmm, n = head dimension
    (1, 8192, 4096, 4096, 234.852),  # attention_linear_projection
    (1, 8192, 16384, 4096, 241.128),  # mlp_h_to_4h
    (1, 8192, 4096, 16384, 252.764),  # mlp_4h_to_h
    (1, 8192, 51200, 4096, 255.380),  # logit_block
)
MAX_EFFICIENCIES = [x / 100 for x in range(70, 100)]
HALF_DIMS = range(40, 251)


def log_errors(max_efficiency: float, half_dim: float) -> list[float]:
    """Each public GEMM's log of its priced time over its published time."""
    cluster = replace(preset_cluster("dgx_a100"), gemm_max_efficiency=max_efficiency, gemm_half_dim=half_dim)
    model = ComputeModel(cluster, "bf16")
    return [math.log(model.gemm_duration(m, n, k, b) * tflops * 1e12 / (2.0 * b * m * n * k)) for b, m, n, k, tflops in PUBLIC]


def fit() -> tuple[float, float, list[float]]:
    """The grid point of least squared log-time error, and its errors."""
    best = min((sum(e * e for e in log_errors(me, h)), me, h) for me in MAX_EFFICIENCIES for h in HALF_DIMS)
    return best[1], best[2], log_errors(best[1], best[2])


def main() -> int:
    max_efficiency, half_dim, errors = fit()
    rms = 100 * math.sqrt(sum(e * e for e in errors) / len(errors))
    print(f"gemm_max_efficiency {max_efficiency}, gemm_half_dim {half_dim}: RMS log-time error {rms:.1f} %")
    for (b, m, n, k, tflops), error in zip(PUBLIC, errors):
        priced = 100 * math.expm1(error)
        print(f"  b {b:3d}  {m:6d} x {n:6d} x {k:6d}  published {tflops:6.1f} TFLOP/s  priced {priced:+6.1f} % in time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
