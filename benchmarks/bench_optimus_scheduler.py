"""Benchmark: Optimus's planner and bubble scheduler on Table 7's three settings.

ViT-22B + GPT-175B, global batch 1536, micro-batch 2, the LLM's plan as Table 12 gives
Megatron-LM's (TP 8, PP 8, DP 24/32/48 on 1536/2048/3072 H100s: 32/24/16 micro-batches per
pipeline). Every encoder plan is scheduled (coarse, then fine), every micro-batch split
evaluated. Target: the 1536-GPU setting (32 micro-batches) in at most 10 s on one core
with Eff_fine at least the paper's 57.5 % (its scheduler takes 322 s).

Prints the planner's wall time (LLM timeline, every encoder plan's schedule and the
emitted Program), the scheduler's share of it, and both efficiencies, beside Table 7's.

    python benchmarks/bench_optimus_scheduler.py
"""

from __future__ import annotations

import time
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import composed
from src.setup import plan_run, validate

BASE = [
    "model=optimus",
    "strategy=optimus",
    "cluster=hopper",
    "logger=none",
    "train.global_batch=1536",
    "strategy.llm.tp=8",
    "strategy.llm.pp=8",
    "strategy.llm.micro_batch_size=2",
]
# GPUs -> (LLM DP, micro-batches per pipeline, Table 7: Eff_coarse, Eff_fine, runtime s)
SETTINGS = {1536: (24, 32, 0.343, 0.575, 322.2), 2048: (32, 24, 0.458, 0.693, 89.6), 3072: (48, 16, 0.687, 0.850, 15.1)}
TARGET_S, TARGET_EFF = 10.0, 0.575


def main() -> None:
    print(
        f"{'GPUs':>5s} {'#mb':>4s} {'plan (s)':>9s} {'sched (s)':>9s} {'Eff_coarse':>10s} {'Eff_fine':>9s}  "
        f"{'paper coarse/fine/runtime':>26s}  encoder plan, partition"
    )
    verdict = None
    for gpus, (dp, mbs, p_coarse, p_fine, p_runtime) in SETTINGS.items():
        overrides = BASE + [f"cluster.nodes={gpus // 8}", f"strategy.llm.dp={dp}"]
        config = composed(overrides)
        setup = validate(config)
        start = time.perf_counter()
        plan = plan_run(setup)
        wall = time.perf_counter() - start
        d = plan.details
        enc = d["encoder"]
        print(
            f"{gpus:5d} {mbs:4d} {wall:9.2f} {d['scheduler_s']:9.2f} {d['eff_coarse']:10.1%} {d['eff_fine']:9.1%}  "
            f"{p_coarse:8.1%} {p_fine:6.1%} {p_runtime:7.1f} s   pp={enc['pp']} tp={enc['tp']} "
            f"x{enc['pipelines']}, {d['partition']}"
        )
        if gpus == 1536:
            verdict = wall <= TARGET_S and d["eff_fine"] >= TARGET_EFF
    print(f"1536-GPU target (<= {TARGET_S:.0f} s, Eff_fine >= {TARGET_EFF:.1%}): {'met' if verdict else 'NOT met'}")


if __name__ == "__main__":
    main()
