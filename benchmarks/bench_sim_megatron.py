"""Benchmark: plan and simulate one iteration of Megatron-LM's largest published runs.

- GPT-175B on 3072 dgx_a100 GPUs (Narayanan et al. 2021): TP 8, PP 8 interleaved with 12
  virtual chunks per stage, DP 48, global batch 1536, micro-batch 1, full recomputation.
  Target: plan + simulate <= 1 s on a 2-core machine.
- MegaScale's largest Megatron-LM run (Jiang et al. 2024): 175B (96 layers, hidden 12288,
  128 heads, vocabulary 64000, sequence 2048) on 12288 GPUs, TP 8, PP 8 interleaved with 6
  virtual stages, micro-batch 1, global batch 6144. Target: <= 2 s.

Prints wall and CPU times (on a shared machine the wall time counts others' load) and
events per second.

    python benchmarks/bench_sim_megatron.py
"""

from __future__ import annotations

import time
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import composed
from src.setup import plan_run, validate
from src.sim.engine import simulate

MEGATRON = [
    "strategy=megatron",
    "strategy.tp=8",
    "strategy.pp=8",
    "strategy.schedule=interleaved",
    "strategy.micro_batch_size=1",
    "strategy.recompute=full",
    "strategy.zero_stage=1",
    "logger=none",
    "cluster=dgx_a100",
    "train.seq_len=2048",
]
CASES = {
    # Sequence parallelism came after this run (Korthikanti et al. 2022); MegaScale uses it.
    "GPT-175B, 3072 GPUs, vpp 12, batch 1536": (
        1.0,
        MEGATRON
        + [
            "model=gpt",
            "model.preset=gpt_175b",
            "cluster.nodes=384",
            "train.global_batch=1536",
            "strategy.vpp=12",
            "strategy.sequence_parallel=false",
        ],
    ),
    "MegaScale 175B, 12288 GPUs, vpp 6, batch 6144": (
        2.0,
        MEGATRON
        + [
            "model=gpt",
            "model.preset=null",
            "model.layers=96",
            "model.hidden=12288",
            "model.heads=128",
            "model.vocab=64000",
            "cluster.nodes=1536",
            "train.global_batch=6144",
            "strategy.vpp=6",
            "strategy.sequence_parallel=true",
        ],
    ),
}


def main() -> None:
    for name, (target, overrides) in CASES.items():
        config = composed(overrides)
        start, start_cpu = time.perf_counter(), time.process_time()
        setup = validate(config)
        plan = plan_run(setup)
        planned = time.perf_counter()
        timeline = simulate(plan.program, setup.model, setup.cluster, setup.train.precision)
        done, cpu = time.perf_counter(), time.process_time() - start_cpu
        sim_s = done - planned
        llm = plan.unit("llm")
        print(f"{name}: {plan.devices} GPUs, tp {llm.tp}, pp {llm.pp} x {llm.vpp} chunks, dp {llm.dp}")
        print(f"  rank classes simulated : {len(plan.program.classes)}")
        print(f"  instructions           : {plan.program.num_instructions}")
        print(f"  plan (build + memory)  : {planned - start:.3f} s")
        print(f"  simulate               : {sim_s:.3f} s  ({timeline.events / sim_s:,.0f} events/s)")
        print(f"  total                  : {done - start:.3f} s wall, {cpu:.3f} s CPU  (target: <= {target:g} s)")
        print(f"  simulated iteration    : {timeline.iteration_time:.3f} s")


if __name__ == "__main__":
    main()
