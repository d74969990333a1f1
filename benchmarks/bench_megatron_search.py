"""Benchmark: the Megatron-LM planner's full search (tp, pp, vpp, micro-batch, sequence
parallelism, recomputation, distributed optimizer), nothing fixed by hand.

- GPT-175B on 1024 dgx_a100 GPUs, global batch 1536. Target: <= 5 s on a 2-core machine.
- Two command lines that once ran past 60 s: an absurd batch, and a space with
  up to 1024 micro-batches per pipeline. Target: a plan or a one-line refusal, <= 60 s.

Prints the search's size (shapes, memory settings tried, fitting candidates, bounds
taken, Programs built and simulated), its wall time and the plan it picked.

    python benchmarks/bench_megatron_search.py
"""

from __future__ import annotations

import time
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import composed
from src.errors import ConfigError, PlanError
from src.setup import plan_run, validate

CASES = {
    "GPT-175B, 1024 GPUs, batch 1536": (
        5.0,
        [
            "model=gpt",
            "model.preset=gpt_175b",
            "cluster=dgx_a100",
            "cluster.nodes=128",
            "train.global_batch=1536",
            "train.seq_len=2048",
        ],
    ),
    "MLLM-15B, 3072 GPUs, batch 10^9 (once past 60 s)": (
        60.0,
        ["model=mllm_15b", "cluster=dgx_a100", "strategy.schedule=interleaved", "train.global_batch=1000000000"],
    ),
    "GPT-175B, 128 H100s, batch 1024, vpp 3, micro-batch 1 (once past 60 s)": (
        60.0,
        [
            "model=gpt",
            "model.preset=gpt_175b",
            "cluster=hopper",
            "cluster.nodes=16",
            "train.global_batch=1024",
            "strategy.schedule=interleaved",
            "strategy.vpp=3",
            "strategy.micro_batch_size=1",
        ],
    ),
}


def main() -> None:
    for name, (target, overrides) in CASES.items():
        config = composed(["strategy=megatron", "logger=none", *overrides])
        setup = validate(config)
        start, start_cpu = time.perf_counter(), time.process_time()
        try:
            plan = plan_run(setup)
        except (ConfigError, PlanError) as err:
            print(f"{name}: refused in {time.perf_counter() - start:.3f} s (target <= {target:g} s): {err}")
            continue
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        s, d = plan.details["search"], plan.details
        print(f"{name}: {plan.devices} GPUs")
        print(f"  shapes (tp, pp, vpp, micro-batch, sp) : {s['shapes']}  (+{s['invalid']} left out by a rule)")
        print(f"  x memory settings                     : {s['space']} points, {s['memory_checks']} checked")
        print(f"  fitting                               : {s['fitting']}")
        print(f"  stage / path bounds taken             : {s['stage_bounds']} / {s['path_bounds']}")
        print(f"  built / simulated                     : {s['built']} / {s['simulated']}")
        print(f"  search wall time                      : {s['wall_time_s']:.3f} s")
        print(
            f"  plan total                            : {wall:.3f} s wall, {cpu:.3f} s CPU  "
            f"(target: <= {target:g} s; wall counts other processes' load)"
        )
        print(
            f"  best: tp {d['tp']} pp {d['pp']} vpp {d['vpp']} dp {d['dp']} micro-batch {d['micro_batch']} "
            f"sp {d['sequence_parallel']} recompute {d['recompute']} zero {d['zero_stage']}: "
            f"{s['ranking'][0]['iteration_time_s']:.3f} s per iteration"
        )


if __name__ == "__main__":
    main()
