"""Peak FLOP/s of one worker, measured: the MFU denominator of a real run.

On CPU there is no datasheet figure for "one worker's share of this machine", so every
worker times square GEMMs in the run's precision at once (sharing the cores as training
does) and the run uses the mean of each worker's best size, measured once a launch and
precision (its first run in that precision; the later ones reuse it). On a GPU the MFU denominator is the
datasheet peak of the cluster preset; the same micro-benchmark is recorded beside it.
"""

from __future__ import annotations

import time

import torch

GEMM_SIZES = {"cpu": (128, 512), "cuda": (4096, 8192)}


def gemm_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 512, min_seconds: float = 0.2) -> float:
    # F.linear, as the model's layers run their GEMMs: on a CPU without bf16 matrix units
    # it takes a faster bf16 kernel than torch.matmul does.
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.nn.functional.linear(a, b)  # warm-up: first call allocates and picks kernels
    reps, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < min_seconds:
        torch.nn.functional.linear(a, b)
        reps += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    return 2.0 * n**3 * reps / elapsed


def peak_gemm_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The best FLOP/s of the device type's GEMM_SIZES (square) in `dtype`."""
    return max(gemm_flops(device, dtype, n, min_seconds=0.1) for n in GEMM_SIZES[device.type])
