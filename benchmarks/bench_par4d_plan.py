"""Benchmark: Par4D planning on 1024 Perlmutter GPUs.

1. Ranking every grid (G_x, G_y, G_z, G_data) of 1024 GPUs for GPT-80B with the
   placement-aware communication model (layouts and validity included). Target <= 50 ms.
2. The whole `strategy=par4d` plan of GPT-80B on 1024 GPUs (ranking, memory search and
   simulating the top 5 grids) from a fresh ModelSpec (no warm caches). Target <= 5 s.
Best of three each.

    python -m benchmarks.bench_par4d_plan
"""

from __future__ import annotations

import time
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import composed
from src.costmodel.memory import element_bytes
from src.setup import plan_run, validate
from src.strategies.par4d.layout import UnitGrid
from src.strategies.par4d.model import rank_grids, valid_grids

OVERRIDES = [
    "model=gpt",
    "model.preset=gpt_80b",
    "cluster=perlmutter",
    "strategy=par4d",
    "logger=none",
    "train.global_batch=2048",
    "strategy.recompute=full",
]
RANK_TARGET_S = 0.050
PLAN_TARGET_S = 5.0


def main() -> None:
    config = composed(OVERRIDES)
    rank_times, plan_times = [], []
    for _ in range(3):
        setup = validate(config)
        cluster, train = setup.cluster, setup.train
        start = time.perf_counter()
        unit = UnitGrid(setup.model.units[0])
        valid, rejected = valid_grids(unit, cluster.devices, train.global_batch)
        ranked = rank_grids(unit, valid, cluster, train.global_batch, element_bytes(train.precision), "aware")
        rank_times.append(time.perf_counter() - start)
        setup = validate(config)
        start = time.perf_counter()
        plan = plan_run(setup)
        plan_times.append(time.perf_counter() - start)
    print(
        f"ranked {len(ranked)} grids ({len(rejected)} rejected) of {cluster.devices} GPUs in "
        f"{min(rank_times) * 1e3:.1f} ms (target <= {RANK_TARGET_S * 1e3:.0f} ms); best {ranked[0].grid.label()}"
    )
    search = plan.details["search"]
    print(
        f"par4d plan of GPT-80B on {plan.devices} GPUs: {min(plan_times):.3f} s (target <= {PLAN_TARGET_S:.1f} s); "
        f"{search['grids_simulated']} grids simulated, chosen {plan.details['grid']}, "
        f"{plan.program.num_instructions} instructions"
    )


if __name__ == "__main__":
    main()
