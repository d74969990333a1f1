"""Measure what conf/cluster/local.yaml states about this machine's CPU workers.

Starts `--workers` gloo processes, the way the real backend does, and measures together
(sharing the cores as training does):
- each worker's best GEMM rate in fp32 and bf16 (the same micro-benchmark as the runtime's MFU
  peak in each precision);
- ring all-reduce times over message sizes, fitted to the cost model's ring formula
  t = 2(g-1)·latency + 2(g-1)/g · bytes / bandwidth (least squares).
Prints the fitted numbers as preset lines; the preset states them with efficiency 1.0,
since they are achieved figures.

    python benchmarks/calibrate_local.py [--workers 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.runtime.driver import free_port
from src.runtime.peak import peak_gemm_flops

SIZES = [2 ** k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB of fp32
REPEATS = 15


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        flops = {name: peak_gemm_flops(torch.device("cpu"), dtype)
                 for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        times = {}
        for nbytes in SIZES:
            tensor = torch.ones(nbytes // 4)
            dist.all_reduce(tensor)  # warm-up
            samples = []
            for _ in range(REPEATS):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                samples.append(time.perf_counter() - start)
            times[nbytes] = statistics.median(samples)
        results[rank] = (flops, times)
    finally:
        dist.destroy_process_group()


def fit(times: dict[int, float], world: int) -> tuple[float, float]:
    """Least-squares latency and bandwidth of t = a·x + b·y with x = 2(g-1), y = 2(g-1)/g·S."""
    xs = [2 * (world - 1)] * len(times)
    ys = [2 * (world - 1) / world * s for s in times]
    ts = list(times.values())
    sxx, syy = sum(x * x for x in xs), sum(y * y for y in ys)
    sxy, sxt, syt = sum(x * y for x, y in zip(xs, ys)), sum(x * t for x, t in zip(xs, ts)), sum(y * t for y, t in zip(ys, ts))
    det = sxx * syy - sxy * sxy
    latency = (sxt * syy - syt * sxy) / det
    per_byte = (sxx * syt - sxy * sxt) / det
    return latency, 1.0 / per_byte


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(args.workers, free_port(), results), nprocs=args.workers, start_method="spawn")
    flops = {name: statistics.mean(results[r][0][name] for r in range(args.workers)) for name in ("fp32", "bf16")}
    slowest = {s: max(results[r][1][s] for r in range(args.workers)) for s in SIZES}
    latency, bandwidth = fit(slowest, args.workers)
    print(f"{args.workers} gloo workers on {os.cpu_count()} cores")
    for nbytes, seconds in slowest.items():
        print(f"  all_reduce {nbytes / 2 ** 10:8.0f} KiB: {seconds * 1e3:8.3f} ms")
    print("preset lines (conf/cluster/local.yaml):")
    for name, value in flops.items():
        print(f"  peak_flops.{name}: {value:.3e}")
    print(f"  intra_latency: {latency:.3e}")
    print(f"  intra_bandwidth: {bandwidth:.3e}")


if __name__ == "__main__":
    main()
