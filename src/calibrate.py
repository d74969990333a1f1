"""Measure this machine for the `local` cluster preset, and write its profile.

    python -m src.calibrate [--workers 4]

Real-backend workers are CPU processes with one thread each, sharing the host's cores,
talking over gloo. This measures what the simulator needs to price them, the way training
runs them (spawned processes, gloo, F.linear):
- GEMM throughput of one worker alone, by shape (square and thin, as the models' layers
  and small micro-batches make them) and dtype: the peak and the efficiency curve;
- oversubscription: the per-worker rate of a large GEMM when 1, 2, ... workers compute at
  once (past the core count each gets a share of a core);
- gloo all-reduce time by message size and group size, and point-to-point ping-pong time
  by size: latency and bandwidth fits of the cost model's formulas; all-gather and
  reduce-scatter times by size, as the fraction of the fitted ring's rate they achieve
  (gloo's reduce-scatter falls far short of it).

The profile (raw measurements and the fitted preset figures) is written to
conf/cluster/profiles/local-<cpu model>.yaml; `cluster=local` takes its figures on a host
of that CPU model, the preset's own elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from src.cluster_profile import PROFILE_DIR, host_cpu_model, profile_path

SQUARES = (64, 128, 256, 512, 1024)
THIN = ((16, 512, 512), (64, 2048, 512), (256, 128, 1024), (2048, 64, 64))  # (m, n, k): small batches, narrow heads
OVERSUBSCRIBED_N = 512
MESSAGE_BYTES = tuple(4**k for k in range(5, 13))  # 1 KiB .. 16 MiB
REPEATS = 11
DTYPES = ("fp32", "bf16", "fp16")


def _rate(m: int, n: int, k: int, dtype_name: str, min_seconds: float = 0.15) -> float:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    torch.nn.functional.linear(a, b)  # the first call allocates and picks a kernel
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        torch.nn.functional.linear(a, b)
        reps += 1
    return 2.0 * m * n * k * reps / elapsed


def _timed(op, repeats: int = REPEATS) -> float:
    import torch.distributed as dist

    op()  # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _worker(rank: int, world: int, port: int, task: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if task == "gemm_shapes":
            shapes = [(n, n, n) for n in SQUARES] + list(THIN)
            results[rank] = [(m, n, k, d, _rate(m, n, k, d)) for d in DTYPES for m, n, k in shapes]
        elif task == "gemm_concurrent":
            dist.barrier()  # all start together: the rates are shares of the cores
            results[rank] = {d: _rate(OVERSUBSCRIBED_N, OVERSUBSCRIBED_N, OVERSUBSCRIBED_N, d, 0.5) for d in DTYPES}
        else:
            results[rank] = _links(rank, world)
    finally:
        dist.destroy_process_group()


def _links(rank: int, world: int) -> dict[str, list]:
    """All-reduce times over the pair (0, 1) and over every worker, ping-pong times between
    0 and 1. Every rank runs the same barriers (inside _timed), idle where it takes no part."""
    import torch
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    in_pair = rank <= 1
    measured: dict[str, list] = {"all_reduce": [], "p2p": [], "all_gather": [], "reduce_scatter": []}
    for nbytes in MESSAGE_BYTES:
        tensor = torch.ones(nbytes // 4 // world * world)
        shard = torch.empty(tensor.numel() // world)

        def ping_pong() -> None:
            peer = 1 - rank
            first, second = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
            first(tensor, peer, group=pair)
            second(tensor, peer, group=pair)

        if world > 2:
            seconds = _timed(lambda: dist.all_reduce(tensor, group=pair) if in_pair else None)
            if in_pair:
                measured["all_reduce"].append((2, nbytes, seconds))
        measured["all_reduce"].append((world, nbytes, _timed(lambda: dist.all_reduce(tensor))))
        measured["all_gather"].append((world, nbytes, _timed(lambda: dist.all_gather_into_tensor(tensor, shard))))
        measured["reduce_scatter"].append((world, nbytes, _timed(lambda: dist.reduce_scatter_tensor(shard, tensor))))
        seconds = _timed(ping_pong if in_pair else lambda: None)
        if in_pair:
            measured["p2p"].append((nbytes, seconds / 2))
    return measured


def _spawn(task: str, workers: int) -> dict[int, Any]:
    import torch.multiprocessing as mp

    from src.runtime.driver import free_port

    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(workers, free_port(), task, results), nprocs=workers, start_method="spawn")
    return dict(results)


# ---- fits ----------------------------------------------------------------------------------
def fit_gemm_curve(points: list[tuple[int, int, int, float]]) -> tuple[float, float, float]:
    """Peak, max efficiency and half dimension of rate = peak * E * prod d/(d + h): least
    squares in log space (E in closed form for each h of a geometric grid)."""
    peak = max(rate for *_, rate in points)
    best: tuple[float, float, float] | None = None
    for step in range(0, 121):
        half = 2.0 ** (step / 10)  # 1 .. 4096
        logs = [math.log(rate / peak) - sum(math.log(d / (d + half)) for d in (m, n, k)) for m, n, k, rate in points]
        log_e = statistics.fmean(logs)
        err = sum((x - log_e) ** 2 for x in logs)
        if best is None or err < best[0]:
            best = (err, math.exp(log_e), half)
    assert best is not None
    return peak, min(best[1], 1.0), best[2]


def fit_ring(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Latency per step and bandwidth of t = 2(g-1)·latency + 2(g-1)/g·bytes/bandwidth,
    least squares over every (group size g, bytes, seconds)."""
    xs = [2.0 * (g - 1) for g, _, _ in points]
    ys = [2.0 * (g - 1) / g * nbytes for g, nbytes, _ in points]
    return _least_squares(xs, ys, [t for *_, t in points])


def fit_efficiency(points: list[tuple[int, int, float]], latency: float, bandwidth: float) -> float:
    """The fraction of the ring's data rate a one-pass collective (all-gather,
    reduce-scatter: (g-1) steps, (g-1)/g of the bytes) achieves, from its largest messages,
    where the data term dominates."""
    largest = sorted(points, key=lambda p: p[1])[-3:]
    ratios = [((g - 1) / g * n / bandwidth) / max(t - (g - 1) * latency, 1e-12) for g, n, t in largest]
    return min(1.0, statistics.median(ratios))


def fit_p2p(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Latency and bandwidth of t = latency + bytes/bandwidth."""
    return _least_squares([1.0] * len(points), [float(n) for n, _ in points], [t for _, t in points])


def _least_squares(xs: list[float], ys: list[float], ts: list[float]) -> tuple[float, float]:
    sxx, syy = sum(x * x for x in xs), sum(y * y for y in ys)
    sxy = sum(x * y for x, y in zip(xs, ys))
    sxt, syt = sum(x * t for x, t in zip(xs, ts)), sum(y * t for y, t in zip(ys, ts))
    det = sxx * syy - sxy * sxy
    latency = max((sxt * syy - syt * sxy) / det, 0.0)
    per_byte = (sxx * syt - sxy * sxt) / det
    if per_byte <= 0:
        raise RuntimeError(
            f"the link fit found no bandwidth term (seconds per byte {per_byte:.3g}): measurements too noisy; rerun on an idle machine"
        )
    return latency, 1.0 / per_byte


def calibrate(workers: int) -> dict[str, Any]:
    shapes = _spawn("gemm_shapes", 1)[0]
    concurrent = {k: _spawn("gemm_concurrent", k) for k in range(1, workers + 1)}
    links = _spawn("links", workers)
    alone = {d: statistics.fmean(concurrent[1][r][d] for r in concurrent[1]) for d in DTYPES}
    preset: dict[str, Any] = {"peak_flops": {}, "oversubscription": {}}
    curves = {}
    for d in DTYPES:
        peak, efficiency, half = fit_gemm_curve([(m, n, k, rate) for m, n, k, dt, rate in shapes if dt == d])
        preset["peak_flops"][d] = float(f"{peak:.4g}")
        curves[d] = (efficiency, half)
    # One efficiency curve per preset: the default precision's.
    preset["gemm_max_efficiency"] = round(curves["fp32"][0], 3)
    preset["gemm_half_dim"] = round(curves["fp32"][1], 1)
    for k, rates in concurrent.items():
        preset["oversubscription"][k] = round(statistics.fmean(rates[r]["fp32"] for r in rates) / alone["fp32"], 3)
    slowest: dict[tuple[int, int], float] = {}  # every rank of a collective waits for the slowest
    for r in links:
        for size, nbytes, seconds in links[r]["all_reduce"]:
            slowest[(size, nbytes)] = max(slowest.get((size, nbytes), 0.0), seconds)
    latency, bandwidth = fit_ring([(g, n, t) for (g, n), t in slowest.items()])
    p2p_latency, p2p_bandwidth = fit_p2p(links[0]["p2p"])
    preset.update(intra_latency=float(f"{latency:.4g}"), intra_bandwidth=float(f"{bandwidth:.4g}"))
    one_pass = {
        op: [max((links[r][op][i] for r in links), key=lambda p: p[2]) for i in range(len(MESSAGE_BYTES))]
        for op in ("all_gather", "reduce_scatter")
    }
    preset["collective_efficiency"] = {op: round(fit_efficiency(points, latency, bandwidth), 3) for op, points in one_pass.items()}
    import torch

    return {
        "host": {
            "cpu_model": host_cpu_model(),
            "cores": os.cpu_count(),
            "torch": str(torch.__version__),
            "date": datetime.date.today().isoformat(),
            "workers": workers,
        },
        "preset": preset,
        "fits": {
            "gemm": {d: {"max_efficiency": curves[d][0], "half_dim": curves[d][1]} for d in DTYPES},
            "p2p": {"latency": p2p_latency, "bandwidth": p2p_bandwidth},
        },
        "measured": {
            "gemm_alone": [{"m": m, "n": n, "k": k, "dtype": d, "flops": rate} for m, n, k, d, rate in shapes],
            "gemm_concurrent": {k: {d: [rates[r][d] for r in sorted(rates)] for d in DTYPES} for k, rates in concurrent.items()},
            "all_reduce": [{"group": g, "bytes": n, "seconds": t} for (g, n), t in sorted(slowest.items())],
            "p2p": [{"bytes": n, "seconds": t} for n, t in links[0]["p2p"]],
            **{op: [{"group": g, "bytes": n, "seconds": t} for g, n, t in points] for op, points in one_pass.items()},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="the most workers runs will start (backend.workers)")
    parser.add_argument("--out", type=Path, default=None, help=f"profile file (default: {PROFILE_DIR}/local-<cpu>.yaml)")
    args = parser.parse_args()
    if args.workers < 2:
        parser.error(f"--workers {args.workers}: links need at least 2 workers")
    profile = calibrate(args.workers)
    path = args.out or profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# `local` preset profile, measured by `python -m src.calibrate --workers {args.workers}` on "
        f"{profile['host']['cpu_model']} ({profile['host']['cores']} cores).\n"
    )
    path.write_text(header + yaml.safe_dump(profile, sort_keys=False))
    print(f"wrote {path}")
    print(yaml.safe_dump({"preset": profile["preset"], "fits": profile["fits"]}, sort_keys=False))


if __name__ == "__main__":
    main()
