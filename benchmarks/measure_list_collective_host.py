"""The host's time per rank of a collective on a list of tensors, as DeepSpeed's ZeRO-3 before
0.6.0 issued them (CPU only: torch + stdlib).

Before 0.6.0 DeepSpeed fetched a partitioned parameter through PyTorch's list all_gather and
reduce-scattered each gradient through the list reduce_scatter (deepspeed/runtime/zero/
partition_parameters.py, _allgather_param and _reduce_scatter_gradient of v0.3.15). Per rank
of the group the host then does, besides the collective itself:

- DeepSpeed's Python loop building the list: a narrow() of the flat buffer per rank (and, in
  the all-gather's, a torch.distributed.get_rank(group) per rank);
- c10d's loop over the list (ProcessGroupNCCL::allgather and ::reduce_scatter of PyTorch 1.8):
  an indexing of the flat buffer per rank and a copy between it and the list's tensor.

This measures both on this host's CPU with tiny CPU tensors, where a copy's bytes cost
nothing: the Python loops as DeepSpeed wrote them, and c10d's C++ loop as ATen's own C++ loop
of selects and copies (unbind, then _foreach_copy_, whose CPU kernel copies tensor by tensor).
Without a GPU the figures leave out a GPU copy's launch (cudaMemcpyAsync and the caching
allocator's recordStream per entry) and are a lower bound of a GPU host's. With `--cuda` (a
GPU) it also measures what an entry adds on the GPU's host: the same loop of copies between
tiny tensors on the GPU less on the CPU (the copy's launch beyond its dispatch), and a loop of
recordStream calls.

    python benchmarks/measure_list_collective_host.py [--ranks 1536] [--cuda] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: src.out_paths, standard library only
from src.out_paths import output_file, write_file  # noqa: E402

REPEATS = 15


def timed(run: Callable[[], object], ranks: int) -> dict[str, float]:
    """The least wall and CPU seconds per rank over REPEATS runs (after one warm-up)."""
    run()
    walls, cpus = [], []
    for _ in range(REPEATS):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"wall_s_per_rank": min(walls) / ranks, "cpu_s_per_rank": min(cpus) / ranks}


def gpu_entry(ranks: int, part: int) -> dict[str, dict[str, float]]:
    """Per entry, what a list collective's copy adds on a GPU: a copy between tiny GPU
    tensors launched from a loop, less the same loop on CPU tensors; and recordStream."""
    stream = torch.cuda.current_stream()
    figures = {}
    for device in ("cpu", "cuda"):
        flat = torch.zeros(ranks * part, dtype=torch.float16, device=device)
        outputs = [torch.empty(part, dtype=torch.float16, device=device) for _ in range(ranks)]
        rows = flat.view(ranks, part).unbind(0)

        def copies() -> None:
            for out, row in zip(outputs, rows):
                out.copy_(row, non_blocking=True)
            torch.cuda.synchronize()  # on both devices: the loops differ by the copies alone

        figures[device] = timed(copies, ranks)
    records = [torch.empty(part, dtype=torch.float16, device="cuda") for _ in range(ranks)]

    def record() -> None:
        for tensor in records:
            tensor.record_stream(stream)

    launch = {k: figures["cuda"][k] - figures["cpu"][k] for k in figures["cpu"]}
    return {"gpu_copy_launch": launch, "record_stream": timed(record, ranks), "cpu_copy_loop": figures["cpu"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1536, help="the group's size: the list's length (default 1536)")
    parser.add_argument("--cuda", action="store_true", help="also measure a GPU copy's launch per entry (needs a GPU)")
    parser.add_argument("--out", type=output_file, default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    problem = f"--ranks must be at least 2, got {args.ranks}" if args.ranks < 2 else None
    if args.cuda and not torch.cuda.is_available():
        problem = "--cuda needs a CUDA GPU, and torch sees none on this machine"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        group = dist.new_group([0])
        ranks, part = args.ranks, 4
        flat = torch.zeros(ranks * part, dtype=torch.float16)
        shard = torch.zeros(part, dtype=torch.float16)
        outputs = [torch.empty(part, dtype=torch.float16) for _ in range(ranks)]

        def gather_list() -> list[torch.Tensor]:  # _allgather_param's loop
            partitions = []
            for i in range(ranks):
                partitions.append(flat.narrow(0, part * i, part))
                if i == dist.get_rank(group=group):
                    partitions[i].data.copy_(shard.data, non_blocking=True)
            return partitions

        def scatter_list() -> list[torch.Tensor]:  # _reduce_scatter_gradient's loop
            inputs = []
            for i in range(ranks):
                start, end = i * part, i * part + part
                if start < flat.numel() and end <= flat.numel():
                    inputs.append(flat.view(-1).narrow(0, start, part))
            return inputs

        def c10d_entries() -> None:  # the per-entry select and copy, in a C++ loop
            torch._foreach_copy_(outputs, flat.view(ranks, part).unbind(0))

        figures = {
            "deepspeed_gather_list": timed(gather_list, ranks),
            "deepspeed_scatter_list": timed(scatter_list, ranks),
            "c10d_entry_without_launch": timed(c10d_entries, ranks),
        }
        dist.destroy_process_group()
    if args.cuda:
        figures.update(gpu_entry(ranks, part))
    result = {
        "what": f"{__file__.rsplit('/', 1)[-1]} on {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}: host seconds per rank of a list collective's list "
        f"({ranks} ranks; least of {REPEATS} runs)"
        + (
            f", and on {torch.cuda.get_device_name(0)} what an entry's copy launch and recordStream add"
            if args.cuda
            else ", without a GPU copy's launch"
        ),
        **figures,
    }
    for name, figure in figures.items():
        print(f"{name}: {figure['wall_s_per_rank'] * 1e6:.2f} us wall, {figure['cpu_s_per_rank'] * 1e6:.2f} us CPU per rank")
    gather = figures["deepspeed_gather_list"]["wall_s_per_rank"] + figures["c10d_entry_without_launch"]["wall_s_per_rank"]
    scatter = figures["deepspeed_scatter_list"]["wall_s_per_rank"] + figures["c10d_entry_without_launch"]["wall_s_per_rank"]
    print(f"per rank, a list all-gather: {gather * 1e6:.2f} us; a list reduce-scatter: {scatter * 1e6:.2f} us (no launch)")
    if args.out:
        write_file(args.out, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
