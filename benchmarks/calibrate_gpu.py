"""Measure what a GPU cluster preset states about its device: the GEMM efficiency curve,
the HBM bandwidth and the per-kernel overhead (the `hopper` preset's were fitted with it).

On the one visible CUDA device, with CUDA events, warm-ups and the median of repeats:
- GEMMs in `--dtype` over square and skinny shapes: achieved FLOP/s and the fraction of
  the datasheet peak; the cost model's GEMM time (its curve max_eff · Π_d d/(d + h) over
  (m, n, k), bounded below by the HBM traffic measured here, plus what a GEMM takes beyond
  its arithmetic: `--gemm-overhead-s`, the preset's kernel_overhead_s + gemm_fixed_s, else
  the tiny kernel's time measured here) is fitted to the measured times of the GEMMs slower
  than 100 us (below, timing one kernel alone measures its launch) by a grid search over
  max_eff and h;
- a large device-to-device copy (bytes read + written per second) against the datasheet
  HBM bandwidth;
- the time of a tiny kernel (the fixed cost per launch).
Prints a table and the preset lines; `--out` writes everything as JSON. Only torch and the
standard library: it runs on a bare GPU machine. `--refit FILE` fits a stored run's GEMMs
again (no GPU), as after a change to what a GEMM costs beyond its arithmetic.

    python benchmarks/calibrate_gpu.py [--peak 989e12] [--hbm 3350e9] [--gemm-overhead-s S] [--out results.json]
    python benchmarks/calibrate_gpu.py --refit results.json --gemm-overhead-s S [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: src.out_paths, standard library only
from src.out_paths import output_file, write_file  # noqa: E402

SQUARE = [128, 256, 512, 1024, 2048, 4096, 8192, 12288, 16384]
THIN = [64, 128, 256, 512, 1024, 2048]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FIT_ABOVE_S = 100e-6


def shapes() -> list[tuple[int, int, int]]:
    out = [(n, n, n) for n in SQUARE]
    for t in THIN:  # one dimension thin, the others 8192: small batches, over-split TP
        out += [(t, 8192, 8192), (8192, t, 8192), (8192, 8192, t)]
    return out


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn` over `repeats`, after warm-ups, timed with CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemm(m: int, n: int, k: int, dtype: torch.dtype) -> float:
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    seconds = timed(lambda: a @ b, repeats=10 if m * n * k > 2**36 else 30)
    return 2.0 * m * n * k / seconds


def model_time(
    shape: tuple[int, int, int], max_eff: float, half: float, peak: float, hbm: float, overhead: float, element: int
) -> float:
    """The cost model's GEMM time (src/costmodel/compute.py: gemm_time)."""
    m, n, k = shape
    compute = 2.0 * m * n * k / (peak * max_eff * math.prod(d / (d + half) for d in shape))
    traffic = element * (m * k + k * n + m * n) / hbm
    return max(compute, traffic) + overhead


def fit(
    points: list[tuple[tuple[int, int, int], float]], peak: float, hbm: float, overhead: float, element: int
) -> tuple[float, float, list[float]]:
    """(max_eff, half_dim, relative time errors) minimising the squared log error of the
    cost model's time (with the measured HBM bandwidth and launch overhead) against the
    measured times, over a grid of both."""
    measured = [2.0 * math.prod(shape) / (e * peak) for shape, e in points]
    best: tuple[float, float, float] | None = None
    for half_size in range(0, 2049, 8):
        for efficiency in [x / 1000 for x in range(500, 1001, 5)]:
            error = sum(
                (math.log(model_time(shape, efficiency, half_size, peak, hbm, overhead, element)) - math.log(t)) ** 2
                for (shape, _), t in zip(points, measured)
            )
            if best is None or error < best[0]:
                best = (error, efficiency, float(half_size))
    assert best is not None, "the grid is not empty"
    _, max_eff, half = best
    errors = [abs(model_time(shape, max_eff, half, peak, hbm, overhead, element) / t - 1) for (shape, _), t in zip(points, measured)]
    return max_eff, half, errors


def fit_summary(points: list[tuple[tuple[int, int, int], float]], peak: float, hbm: float, overhead: float, element: int) -> dict:
    """The fit over the points slower than FIT_ABOVE_S, as the result file records it."""
    fitted = [(shape, e) for shape, e in points if 2.0 * math.prod(shape) / (e * peak) > FIT_ABOVE_S]
    max_eff, half, errors = fit(fitted, peak, hbm, overhead, element)
    median, worst = statistics.median(errors), max(errors)
    print(f"fit: max_eff {max_eff:.3f}, half_dim {half:.0f} (time error median {median:.1%}, max {worst:.1%})")
    return {
        "gemm_max_efficiency": max_eff,
        "gemm_half_dim": half,
        "method": "grid search minimising the squared log error of the cost model's GEMM time",
        "gemm_overhead_s": overhead,
        "fitted_shapes": len(fitted),
        "fitted_above_s": FIT_ABOVE_S,
        "median_relative_time_error": median,
        "max_relative_time_error": worst,
    }


def refit(path: str, overhead: float, out: Path | None) -> None:
    """A stored run's GEMMs fitted again, each GEMM costing `overhead` beyond its arithmetic."""
    with open(path) as f:
        result = json.load(f)
    points = [((g["m"], g["n"], g["k"]), g["efficiency"]) for g in result["gemms"]]
    element = torch.tensor([], dtype=DTYPES[result["dtype"]]).element_size()
    result["fit"] = fit_summary(points, result["datasheet_peak"], result["copy_bytes_per_s"], overhead, element)
    result["fit"]["refit"] = f"python benchmarks/calibrate_gpu.py --refit {path} --gemm-overhead-s {overhead:g}"
    if out:
        write_file(out, json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--peak", type=float, default=989e12, help="datasheet dense peak in --dtype (H100 SXM)")
    parser.add_argument("--hbm", type=float, default=3350e9, help="datasheet HBM bandwidth, bytes/s (H100 SXM)")
    parser.add_argument(
        "--gemm-overhead-s",
        type=float,
        help="what a GEMM takes beyond its arithmetic in the preset (kernel_overhead_s + gemm_fixed_s), held by the fit; "
        "default: the tiny kernel's time measured here",
    )
    parser.add_argument("--refit", help="a stored result file: fit its GEMMs again (needs --gemm-overhead-s; no GPU)")
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    if args.refit:
        if args.gemm_overhead_s is None or args.gemm_overhead_s < 0:
            print("error: --refit needs --gemm-overhead-s, a GEMM's time beyond its arithmetic (0 or more seconds)", file=sys.stderr)
            sys.exit(2)
        refit(args.refit, args.gemm_overhead_s, args.out)
        return
    if not torch.cuda.is_available():
        print("error: calibrate_gpu needs a CUDA device, and none is visible", file=sys.stderr)
        sys.exit(2)
    dtype = DTYPES[args.dtype]
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")
    points = []
    print(f"{'m':>6} {'n':>6} {'k':>6} {'TFLOP/s':>9} {'of peak':>8}")
    for m, n, k in shapes():
        flops = gemm(m, n, k, dtype)
        points.append(((m, n, k), flops / args.peak))
        print(f"{m:6d} {n:6d} {k:6d} {flops / 1e12:9.1f} {flops / args.peak:8.3f}", flush=True)
    nbytes = 4 * 2**30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * nbytes / timed(lambda: dst.copy_(src), repeats=10)
    one = torch.zeros(1, device="cuda")
    launches = 1000

    def many() -> None:
        for _ in range(launches):
            one.add_(1)

    overhead = timed(many, repeats=5) / launches
    # Timing one kernel alone has a floor (launch and events, ~36 us on an H100) that a
    # queue of kernels in training does not pay: fit where the GEMM itself dominates.
    gemm_overhead = overhead if args.gemm_overhead_s is None else args.gemm_overhead_s
    summary = fit_summary(points, args.peak, copy, gemm_overhead, torch.tensor([], dtype=dtype).element_size())
    result = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": args.dtype,
        "datasheet_peak": args.peak,
        "datasheet_hbm": args.hbm,
        "gemms": [{"m": m, "n": n, "k": k, "efficiency": e} for (m, n, k), e in points],
        "fit": summary,
        "copy_bytes_per_s": copy,
        "copy_efficiency": copy / args.hbm,
        "kernel_overhead_s": overhead,
    }
    print(f"HBM copy {copy / 1e12:.2f} TB/s = {copy / args.hbm:.3f} of the datasheet; kernel overhead {overhead * 1e6:.1f} us")
    print("preset lines:")
    print(
        f"  gemm_max_efficiency: {summary['gemm_max_efficiency']:.3f}\n  gemm_half_dim: {summary['gemm_half_dim']:.0f}\n"
        f"  copy_efficiency: {copy / args.hbm:.3f}\n"
        f"  kernel_overhead_s: {overhead:.2e}"
    )
    if args.out:
        write_file(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
