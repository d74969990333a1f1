"""Where Optimus's speed-up over Megatron-LM comes from in this simulator: the host's time
per kernel on Megatron-LM's first stage (Optimus Fig. 15, models A-D on H100s).

Megatron-LM, as Optimus states its baseline, runs the vision encoder in the LLM's first
pipeline stage at the LLM's TP (8): each of its kernels works on one micro-batch's few
hundred image tokens split eight ways, a few microseconds of GPU time, while eager
PyTorch spends `cluster.host_forward_kernel_s` / `host_backward_kernel_s` of host time to
issue each one (the `hopper` preset's, measured on an H100 host for a transformer block).
Megatron-LM balanced cuts the layers by their FLOPs (Appendix B), which leaves nearly all
those kernels in one virtual stage at the same TP (models A-C); Optimus gives the encoder its
own, smaller TP. This script prices
each figure job of sweeps/optimus_fig15_weak_scaling.yaml (Megatron-LM's paper plan,
Megatron-LM balanced, Optimus) twice: with the framework issuing each kernel (the preset's
eager launch) and with each layer's passes replayed from CUDA graphs (cluster.host_launch=
graphed: one launch per layer and pass), and prints the speed-ups and the first stage's
encoder time. Prints a markdown table and writes it with --out.

    python benchmarks/optimus_host_time.py [--out benchmarks/results/optimus_host_time.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.cluster_inputs import priced_on
from src.config import composed
from src.out_paths import output_file, write_file
from src.setup import plan_run, validate
from src.sim.engine import simulate
from src.sweep import figure_jobs, load_sweep

SWEEP = Path(__file__).resolve().parent.parent / "sweeps" / "optimus_fig15_weak_scaling.yaml"
SERIES = ("megatron", "balanced", "optimus")
LAUNCHES = {"eager": [], "graphed": ["cluster.host_launch=graphed"]}
PAPER_LARGEST = {"over Megatron-LM": 1.22, "over balanced": 1.18}  # Optimus §5.2.1 line 304: reference only


def priced(overrides: list[str]) -> tuple[float, float]:
    """The iteration time and the encoder's compute on rank 0 (Megatron-LM's first stage)."""
    setup = validate(composed(overrides))
    plan = plan_run(setup)
    timeline = simulate(plan.program, setup.model, setup.cluster, setup.train.precision)
    first = next(t for t in timeline.ranks if 0 in t.ranks)
    encoder = sum(s.end - s.start for s in first.spans if s.category == "compute" and " encoder" in s.name)
    return timeline.iteration_time, encoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_file, default=None, help="also write the table here")
    args = parser.parse_args()
    wall, cpu = time.perf_counter(), time.process_time()
    jobs = [job for job in figure_jobs(load_sweep(SWEEP)) if job.series in SERIES]
    groups = list(dict.fromkeys(job.group for job in jobs))
    results: dict[tuple[str, str, str], tuple[float, float]] = {}
    for job in jobs:
        for launch, extra in LAUNCHES.items():
            results[(job.group, job.series, launch)] = priced([*job.overrides, *extra])
            print(f"{job.group} / {job.series} / {launch}: {results[(job.group, job.series, launch)][0]:.3f} s", flush=True)
    lines = [
        "# Optimus Fig. 15: the speed-ups with kernels issued one by one, and from CUDA graphs",
        "",
        "Written by `python benchmarks/optimus_host_time.py` (the simulator, preset `hopper`; the figure's jobs). "
        "'eager': each kernel issued at the host time per kernel `hopper` states (measured for eager PyTorch); "
        "'graphed': each layer's forward and backward replayed from a CUDA graph (`cluster.host_launch=graphed`). "
        "The paper's largest speed-ups, for reference: "
        + ", ".join(f"{value}x {what}" for what, value in PAPER_LARGEST.items())
        + " (§5.2.1, line 304).",
        "",
        "| model | kernels issued | Megatron-LM (s) | its first stage's encoder (s) | balanced (s) | Optimus (s) "
        "| Optimus over Megatron-LM | Optimus over balanced |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for group in groups:
        for launch in LAUNCHES:
            (megatron, encoder), (balanced, _), (optimus, _) = (results[(group, series, launch)] for series in SERIES)
            lines.append(
                f"| {group} | {launch} | {megatron:.3f} | {encoder:.3f} | {balanced:.3f} | {optimus:.3f} "
                f"| {megatron / optimus:.2f} | {balanced / optimus:.2f} |"
            )
    lines += ["", priced_on(job.overrides for job in jobs)]
    text = "\n".join(lines) + "\n"
    print(text)
    print(f"({time.perf_counter() - wall:.0f} s wall, {time.process_time() - cpu:.0f} s CPU)")
    if args.out:
        write_file(args.out, text)


if __name__ == "__main__":
    main()
