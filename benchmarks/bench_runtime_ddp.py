"""Benchmark: the harness's ddp step against a plain DeepSpeed loop, tiny CLIP, 2 CPU workers.

    python benchmarks/bench_runtime_ddp.py [--rounds 6] [--steps 60] [hydra overrides]

Rounds alternate the two, so that drift of the (shared, noisy) machine hits both alike:
  harness  the front door as a user runs it (`python -m src.run backend=torch ...`: driver,
           workers, executor of the ddp Program, DeepSpeed engine, sinks);
  plain    two processes of this script running a loop written directly against DeepSpeed:
           the same modules (src/runtime/modules), weights, samples, batch, optimizer and
           ZeRO stage and precision (autocast, as the harness runs bf16), read from the
           harness run's resolved.yaml; `engine(batch)`,
           `engine.backward(loss)`, `engine.step()` with DeepSpeed's default (managed)
           accumulation; the features all-gathered as the harness's ddp Program gathers them
           (all-gather forward, all-reduce backward, as gloo has no reduce-scatter), so that the
           comparison isolates what the harness adds (Program walk, split backward per
           unit, timers, per-unit batches), not a choice of collective.
Both time a step alike: all ranks leave a barrier, each times its step to the end of the
optimizer update, the step's time is the slowest rank's. The first WARMUP steps of every
run are dropped. Each round gives the ratio of the two runs' median step times; the figure
is the median ratio over rounds (a burst of load from another process hits one run of one
round, not the median), with the 90 % interval a bootstrap over the rounds gives it;
rank 0's process (CPU) time per step (its instructions only, in both loops: what the
machine's load stretches least, so the harness's own work shows) likewise. The pooled
medians, the loop period (the arrival of rank 0's step lines, everything
done per step included: batch, logging, loss reduction) and the load average are printed
beside it. Target: harness / plain <= 1.05, in fp32 and in bf16
(`train.precision=bf16`).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `src` is the repository's package

from src.out_paths import output_dir  # noqa: E402
from src.runtime.driver import free_port, stop, worker_env  # noqa: E402
from src.setup import validate  # noqa: E402

RUN = ["backend=torch", "cluster=local", "cluster.devices_per_node=2", "logger=none", "model=clip", "model.scale=tiny", "strategy=ddp"]
WARMUP = 10
TARGET = 1.05
STEP_LINE = re.compile(r"^step (\d+) \| loss ([0-9.eE+-]+) \| ([0-9.]+) s(?: \| batch ([0-9.]+) s \| cpu ([0-9.]+) s)?")


@dataclass
class Measured:
    times: list[float]  # step times (s), slowest rank
    losses: list[float]
    period: float  # mean seconds between rank 0's step lines after the warm-up
    cpu_s: list[float]  # rank 0's process (CPU) seconds per step
    batch_s: list[float] = field(default_factory=list)  # plain loop only: making the step's batch


class Lines:
    """A process's stdout lines, each with its arrival time; the rest of stdout is kept
    for an error message."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.steps: list[tuple[re.Match, float]] = []  # (step line, arrival)
        self.text: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None, "the harness's stdout is piped"
        for line in proc.stdout:
            match = STEP_LINE.match(line)
            if match:
                self.steps.append((match, time.perf_counter()))
            self.text.append(line)

    def join(self) -> None:
        self._thread.join()

    def period(self) -> float:
        """Mean seconds between step lines after the warm-up."""
        kept = [t for match, t in self.steps if int(match[1]) >= WARMUP]
        return (kept[-1] - kept[0]) / (len(kept) - 1)


def _wait(procs: list[subprocess.Popen], lines: Lines, what: str) -> None:
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        stop(procs)
    lines.join()
    if any(codes):
        raise SystemExit(f"{what} failed with exit codes {codes}:\n{''.join(lines.text[-20:])}")


def run_harness(run_dir: Path, overrides: list[str], steps: int) -> Measured:
    """One run through the front door; its figures from its own summary."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "src.run", *RUN, *overrides, f"train.steps={steps}", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = Lines(proc)
    _wait([proc], lines, "the harness run")
    summary = yaml.safe_load((run_dir / "summary.json").read_text())  # JSON is YAML
    measured = summary["measured"]
    return Measured(measured["step_time_s"], measured["loss"], lines.period(), measured["rank0_process_time_s"])


def run_plain(run_dir: Path) -> Measured:
    """The plain loop on the harness run's own resolved config, 2 processes."""
    config = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    backend = validate(config).backend  # the harness run's typed settings, as its workers had them
    assert backend is not None, "the harness run was a real one"
    world, port = int(config["cluster"]["devices_per_node"]), free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--plain", str(run_dir)],
            cwd=REPO,
            env=worker_env(rank, world, port, backend),
            start_new_session=True,
            stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if rank == 0 else subprocess.DEVNULL,
            text=True,
        )
        for rank in range(world)
    ]
    lines = Lines(procs[0])
    _wait(procs, lines, "the plain DeepSpeed loop")
    matches = [match for match, _ in lines.steps]
    return Measured(
        [float(m[3]) for m in matches],
        [float(m[2]) for m in matches],
        lines.period(),
        [float(m[5]) for m in matches],
        [float(m[4]) for m in matches],
    )


# ---- the plain loop (in each of its worker processes) ------------------------------------
def plain_worker(run_dir: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from src.runtime.op_build import prebuild_ops

    prebuild_ops()  # DeepSpeed's CPU op from the project's cache, as the harness's workers load it
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    from src.data.synthetic import collate

    from src.runtime.device import computing
    from src.runtime.inputs import dataset_for, unit_fields
    from src.runtime.modules.units import build_units

    config = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    setup = validate(config)
    backend = setup.backend
    assert backend is not None, "the harness run was a real one"
    model, seed, global_batch = setup.model, setup.train.seed, setup.train.global_batch
    torch.set_num_threads(backend.threads_per_worker)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = global_batch // world

    class GatherRows(torch.autograd.Function):
        """Every rank's rows, in rank order; backward all-reduces and keeps this rank's rows."""

        @staticmethod
        def forward(ctx, rows: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(rows) for _ in range(world)]
            dist.all_gather(parts, rows.contiguous())
            return torch.cat(parts)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            grad = grad.contiguous()
            dist.all_reduce(grad)
            return grad[rank * local : (rank + 1) * local]

    class Clip(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.units = build_units(model, seed, {}, {u.name: set(range(u.num_layers)) for u in model.units})

        def tower(self, name: str, batch: dict) -> torch.Tensor:
            state = dict(unit_fields(model, name, batch))
            for layer in cast(nn.ModuleList, self.units[name]):
                state = layer(state)
            return state["feature"]

        def forward(self, batch: dict) -> torch.Tensor:
            image, text = self.tower("vision", batch), self.tower("text", batch)
            everyone = [GatherRows.apply(t) for t in (image, text)]
            # The module sums over this rank's rows; DeepSpeed averages the gradients over ranks.
            offset = rank * local
            return cast(nn.ModuleList, self.units["interaction"])[0]((offset, image), (offset, text), *everyone) / local

    try:
        clip = Clip()
        zero = int(config["strategy"]["zero_stage"])
        ds_config = {
            "train_micro_batch_size_per_gpu": local,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": zero,
                **({"stage3_param_persistence_threshold": 0} if zero == 3 else {}),
            },  # as the harness: every param
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
            "steps_per_print": 2**31,
        }
        optimizer = torch.optim.AdamW(clip.parameters(), **backend.deepspeed.optimizer.params())
        engine, *_ = deepspeed.initialize(model=clip, optimizer=optimizer, config=ds_config)
        data = dataset_for(model, seed, "synthetic")
        for step in range(setup.train.steps):
            first, start = step * global_batch + rank * local, time.perf_counter()
            batch = collate([data[i] for i in range(first, first + local)])
            batch_s = time.perf_counter() - start
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            with computing(torch.device("cpu"), setup.train.precision):  # the run's precision, as the harness
                loss = engine(batch)
            engine.backward(loss)
            engine.step()
            stats = torch.tensor([time.perf_counter() - start, float(loss.detach())], dtype=torch.float64)
            cpu = time.process_time() - cpu
            slowest, total = stats[:1].clone(), stats[1:].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(total)
            if rank == 0:
                line = (
                    f"step {step} | loss {float(total) / world:.6f} | {float(slowest):.6f} s | batch {batch_s:.6f} s | cpu {cpu:.6f} s"
                )
                print(line, flush=True)
        # gloo aborts a process whose peer tears down while its last sends are in flight.
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- side by side --------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60, help=f"steps per run (the first {WARMUP} are dropped)")
    parser.add_argument("--out", type=output_dir, default=REPO / "outputs" / "bench_runtime_ddp")
    parser.add_argument("--plain", type=Path, help=argparse.SUPPRESS)  # a worker of the plain loop
    args, overrides = parser.parse_known_args()
    if args.plain:
        plain_worker(args.plain)
        # Every step is measured and the group is gone: leave without the interpreter's
        # teardown, where a thread DeepSpeed's engine left behind sometimes aborts the
        # process ("terminate called without an active exception", exit -6).
        sys.stdout.flush()
        os._exit(0)
    if args.steps <= WARMUP + 1 or args.rounds < 1:
        raise SystemExit(f"error: --steps must exceed {WARMUP + 1} and --rounds be positive")
    runs: dict[str, list[Measured]] = {"harness": [], "plain": []}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        run_dir = args.out / f"round{r}"
        runs["harness"].append(run_harness(run_dir, overrides, args.steps))
        runs["plain"].append(run_plain(run_dir))
        h, p = (statistics.median(runs[n][-1].times[WARMUP:]) for n in ("harness", "plain"))
        print(f"round {r}: median step harness {h * 1e3:6.2f} ms, plain {p * 1e3:6.2f} ms, ratio {h / p:.3f}", flush=True)
    report(runs, args, overrides, (load, os.getloadavg()[0]))


def report(runs: dict[str, list[Measured]], args: argparse.Namespace, overrides: list[str], load: tuple[float, float]) -> None:
    config = yaml.safe_load((args.out / "round0" / "resolved.yaml").read_text())
    batch = yaml.safe_load((args.out / "round0" / "summary.json").read_text())["global_batch"]
    step = {n: statistics.median(t for m in ms for t in m.times[WARMUP:]) for n, ms in runs.items()}
    pairs = list(zip(runs["harness"], runs["plain"]))
    ratios = [statistics.median(h.times[WARMUP:]) / statistics.median(p.times[WARMUP:]) for h, p in pairs]
    cpu_ratios = [statistics.median(h.cpu_s[WARMUP:]) / statistics.median(p.cpu_s[WARMUP:]) for h, p in pairs]
    ratio = statistics.median(ratios)
    period = {n: statistics.median(m.period for m in ms) for n, ms in runs.items()}
    first = {n: ms[0].losses for n, ms in runs.items()}
    worst = max(abs(a - b) / abs(b) for a, b in zip(first["harness"], first["plain"]))
    print(
        f"\ntiny CLIP, ddp ZeRO-{config['strategy']['zero_stage']}, 2 CPU workers (gloo), global batch {batch}"
        f"{' ' + ' '.join(overrides) if overrides else ''}; {args.rounds} rounds x {args.steps} steps, "
        f"first {WARMUP} of each run dropped; load average {load[0]:.1f} before, {load[1]:.1f} after "
        f"({os.cpu_count()} cores)"
    )
    print(f"{'':34s} {'harness':>9s} {'plain DS':>9s} {'ratio':>6s}")
    cpu = {n: statistics.median(t for m in ms for t in m.cpu_s[WARMUP:]) for n, ms in runs.items()}
    for label, figure in (
        ("step time, median of all (ms)", step),
        ("rank 0 process time per step (ms)", cpu),
        ("loop period, median of runs (ms)", period),
    ):
        print(f"{label:34s} {figure['harness'] * 1e3:9.2f} {figure['plain'] * 1e3:9.2f} {figure['harness'] / figure['plain']:6.3f}")
    batch_s = statistics.median(t for m in runs["plain"] for t in m.batch_s[WARMUP:])
    print(f"making one step's batch (both loops, before their timed step): {batch_s * 1e3:.2f} ms")
    print(f"losses of the two loops: max relative difference {worst:.1e} over {len(first['plain'])} steps")
    low, high = spread(ratios)
    cpu_low, cpu_high = spread(cpu_ratios)
    cpu_ratio = statistics.median(cpu_ratios)
    print(f"process-time ratio, median over rounds: {cpu_ratio:.3f} (90 % interval {cpu_low:.3f} to {cpu_high:.3f})")
    print(
        f"step-time ratio, median over rounds: {ratio:.3f} (90 % interval {low:.3f} to {high:.3f}): "
        f"{'within' if ratio <= TARGET else 'OVER'} the {TARGET:.2f}x target"
    )


def spread(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median over rounds, rounds drawn again with
    replacement (a bootstrap): how far another run of as many rounds could land."""
    generator = random.Random(0)
    medians = sorted(statistics.median(generator.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


if __name__ == "__main__":
    main()
