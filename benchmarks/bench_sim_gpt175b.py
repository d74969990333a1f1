"""Benchmark: plan and simulate one iteration of GPT-175B on 3072 GPUs of dgx_a100.

Narayanan et al. (2021)'s configuration: TP 8, PP 8 interleaved with 12 virtual chunks
per stage, DP 48, global batch 1536, micro-batch 1, full recomputation. Target: at most
5 s on a 2-core machine for the simulation. Prints wall times and events per second.

    python benchmarks/bench_sim_gpt175b.py
"""
from __future__ import annotations

import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.setup import plan_run, validate
from src.sim.engine import simulate

OVERRIDES = [
    "model=gpt", "model.preset=gpt_175b", "cluster=dgx_a100", "cluster.nodes=384",
    "train.global_batch=1536", "train.seq_len=2048",
    "strategy=megatron", "strategy.tp=8", "strategy.pp=8", "strategy.vpp=12", "strategy.schedule=interleaved",
    "strategy.micro_batch_size=1", "strategy.recompute=full", "strategy.zero_stage=1", "logger=none",
]


def main() -> None:
    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        config = OmegaConf.to_container(compose(config_name="config", overrides=OVERRIDES), resolve=True)
    start = time.perf_counter()
    setup = validate(config)
    plan = plan_run(setup)
    planned = time.perf_counter()
    timeline = simulate(plan.program, setup.model, setup.cluster, setup.train.precision)
    done = time.perf_counter()
    sim_s = done - planned
    print(f"GPT-175B on {plan.devices} GPUs (tp 8, pp 8 x 12 chunks, dp 48, batch 1536, micro-batch 1)")
    print(f"rank classes simulated : {len(plan.program.classes)}")
    print(f"instructions           : {plan.program.num_instructions}")
    print(f"plan (build + memory)  : {planned - start:.3f} s")
    print(f"simulate               : {sim_s:.3f} s  ({timeline.events / sim_s:,.0f} events/s)")
    print(f"total                  : {done - start:.3f} s  (target: <= 5 s)")
    print(f"simulated iteration    : {timeline.iteration_time:.3f} s")


if __name__ == "__main__":
    main()
