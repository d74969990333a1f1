"""Benchmark: how long each balancing policy (train.balance) takes to place one global batch,
for MLLM-9B/15B/72B on 1152 A800s, batch 1920 (DistTrain's Figure 15 sizes). Target: at most
100 ms of CPU per batch, so that a policy could run every iteration.

- Megatron-LM (the balancing figure's: the encoder and generator on stages of their own,
  replicated over the TP group): the plan's own balancer (src/data/balance.py) on the plan's
  pipeline, weighing the batch's 1920 sequences (a replicated unit's by its busiest GPU's
  images) and placing them over its replicas and micro-batches;
- DistTrain (the balancing figure's: its encoder and generator replicated over each TP group): its
  reordering (src/data/disaggregated.py), as its plan carries it, for the orchestration's best choice,
  the policy as DistTrain's reordering.

Each figure is the fastest of five runs by CPU time (time.process_time), wall time beside it:
a loaded machine inflates wall time, not CPU time.

    python benchmarks/bench_balance_plan.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import BALANCE_POLICIES, composed, options_from
from src.data.balance import Balancing
from src.data.loads import batch_loads
from src.setup import LIMITS, Setup, plan_run, validate
from src.strategies.base import PlanRequest
from src.data.disaggregated import BALANCE_REORDERS
from src.strategies.disttrain.orchestration import UNITS, Orchestrator
from src.strategies.disttrain.planner import DistTrainOptions
from src.strategies.disttrain.profile import Profiler
from src.strategies.disttrain.search import Decision

MODELS = ("mllm_9b", "mllm_15b", "mllm_72b")
TARGET_S = 0.100
RUNS = 5


def configure(model: str, *overrides: str) -> Setup:
    base = ["logger=none", f"model={model}", "cluster=a800", "cluster.nodes=144", "train.global_batch=1920"]
    return validate(composed([*base, "model.images_per_sequence=10", *overrides]))


def fastest(work: Callable[[], object]) -> tuple[float, float]:
    """(CPU, wall) seconds of the fastest of RUNS runs by CPU."""
    best = (float("inf"), float("inf"))
    for _ in range(RUNS):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        best = min(best, (time.process_time() - cpu, time.perf_counter() - wall))
    return best


def megatron(model: str) -> dict[str, tuple[float, float]]:
    setup = configure(
        model, "strategy=megatron", "strategy.modality_stages=extra", "strategy.replicate=[encoder,generator]", "train.balance=cost"
    )
    plan = plan_run(setup)
    assert isinstance(plan.balancing, Balancing), "an MLLM on interleaved data is balanced"
    train = setup.train
    loads = batch_loads(setup.model, train.seed, train.global_batch, train.data, None)
    balancer = plan.balancing.balancer
    layout = balancer.layout
    shape = f"dp {layout.dp}, {layout.microbatches} micro-batches of {layout.micro_batch}, {len(balancer.stages)} stages"
    print(f"  megatron {model}: {shape}")
    # As the planner and the real backend place a step's batch: its loads weighed, then ordered.
    return {policy: fastest(lambda: Balancing(policy, balancer).place(loads)) for policy in BALANCE_POLICIES}


def disttrain(model: str) -> dict[str, tuple[float, float]]:
    setup = configure(model, "strategy=disttrain", "strategy.replicate=[encoder,generator]")
    opts = options_from(DistTrainOptions, setup.config["strategy"])
    train = setup.train
    loads = batch_loads(setup.model, train.seed, train.global_batch, train.data, None)
    profiler = Profiler(setup.model, setup.cluster, train.precision, opts.tp_overlap_chunks)
    fixed = {u: opts.fixed(u) for u in UNITS}
    orchestrator = Orchestrator(
        profiler, train.global_batch, setup.cluster.devices, fixed, opts.orchestration, loads.peak, replicate=opts.replicate
    )
    best = orchestrator.solve().best
    request = PlanRequest(setup.model, setup.cluster, train, setup.config["strategy"], None, LIMITS["sim"])
    shapes = (f"{c.unit} dp {c.dp} pp {c.pp}{' replicated' if c.setting.replicated else ''}" for c in best)
    print(f"  disttrain {model}: " + ", ".join(shapes))
    out = {}
    for policy in BALANCE_POLICIES:
        # What the plan carries and every step runs: its stage costs read once, the order per batch.
        reordering = Decision(request, orchestrator, loads, BALANCE_REORDERS[policy], opts.tp_overlap_chunks)._reordering(best)
        out[policy] = fastest(lambda: reordering.place(loads))
    return out


def main() -> None:
    rows = []
    for model in MODELS:
        for strategy, timed in (("megatron", megatron), ("disttrain", disttrain)):
            rows += [(strategy, model, policy, cpu, wall) for policy, (cpu, wall) in timed(model).items()]
    print(f"{'strategy':>9s} {'model':>8s} {'policy':>7s} {'cpu (ms)':>8s} {'wall (ms)':>9s}")
    for strategy, model, policy, cpu, wall in rows:
        print(f"{strategy:>9s} {model:>8s} {policy:>7s} {1e3 * cpu:8.1f} {1e3 * wall:9.1f}")
    slowest = max(rows, key=lambda r: r[3])
    print(
        f"slowest: {slowest[0]} {slowest[1]} {slowest[2]} {1e3 * slowest[3]:.1f} ms CPU "
        f"(target <= {1e3 * TARGET_S:.0f} ms per 1920-sequence batch on 1152 GPUs)"
    )


if __name__ == "__main__":
    main()
