"""Probe: how long a CPU worker's all-reduce takes right after a block of compute, by block.

    python benchmarks/probe_sync_skew.py [--workers 4] [--repeats 10]

Workers (gloo, one thread each, sharing this host's cores) run a block of compute then a
4 MiB all-reduce, over and over; the figure is the slowest worker's seconds per round beyond
its block alone, for three blocks: 8 GEMMs of 256^3 (the block src.calibrate's after-compute
all-reduces follow), 64 of them, and a forward and backward of four of the real backend's
transformer blocks (hidden 128, 8 x 64 tokens: training's pattern); and the all-reduce back to
back, with no compute between. Where more workers than cores time-slice, they leave a long
block at times further apart than a short one, and the all-reduce waits for the slowest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `src` is the repository's package

MESSAGE_ELEMENTS = 2**20  # fp32: 4 MiB


def _blocks() -> dict[str, Callable[[], None]]:
    import torch

    from src.runtime.modules.blocks import Block
    from src.runtime.modules.parallel import TP

    layers = torch.nn.ModuleList(Block(128, 4, TP(), causal=True) for _ in range(4))
    x = torch.randn(8, 64, 128)
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def gemms(count: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(count):
                torch.nn.functional.linear(a, b)

        return run

    def forward_backward() -> None:
        state = {"x": x}
        for layer in layers:
            state = layer(state)
        state["x"].sum().backward()

    return {
        "8 GEMMs of 256^3": gemms(8),
        "64 GEMMs of 256^3": gemms(64),
        "4 blocks, forward+backward": forward_backward,
        "none": lambda: None,
    }


def _worker(rank: int, world: int, port: int, repeats: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tensor = torch.ones(MESSAGE_ELEMENTS)
    out = {}
    try:
        for name, block in _blocks().items():

            def per_round(with_reduce: bool) -> float:
                block()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(repeats):
                    block()
                    if with_reduce:
                        dist.all_reduce(tensor)
                return (time.perf_counter() - start) / repeats

            alone = per_round(False)
            out[name] = (alone, per_round(True) - alone)
    finally:
        dist.destroy_process_group()
    results[rank] = out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.workers < 2 or args.repeats < 1:
        parser.error(f"--workers {args.workers} --repeats {args.repeats}: at least 2 workers and 1 repeat")
    import torch.multiprocessing as mp

    from src.runtime.driver import free_port

    results = mp.get_context("spawn").Manager().dict()
    load = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    mp.start_processes(_worker, args=(args.workers, free_port(), args.repeats, results), nprocs=args.workers, start_method="spawn")
    print(f"{args.workers} gloo workers on {os.cpu_count()} cores, 4 MiB all-reduce, {args.repeats} rounds; load {load:.1f}")
    for name in results[0]:
        block = max(results[r][name][0] for r in results)
        reduce = max(results[r][name][1] for r in results)
        spread = statistics.pstdev(results[r][name][1] for r in results)
        print(f"  after {name:28s} (block {1e3 * block:6.1f} ms): all-reduce {1e3 * reduce:6.2f} ms (spread {1e3 * spread:.2f})")
    print(f"wall {time.perf_counter() - start:.1f} s, this process's CPU {time.process_time() - cpu:.1f} s")


if __name__ == "__main__":
    main()
