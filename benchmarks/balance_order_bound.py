"""Benchmark: how much of skew's cost reordering a batch can win back, and what stops it.

A balancing policy permutes a batch's sequences over the replicas' micro-batch positions.
This prices, with the balancing's own cost model (each replica's 1F1B recurrence,
src.data.balance.Balancer), the plan's batches under uniform data (every sequence at the
mean), the data order, `reorder` and `cost`, and then searches further: on `cost`'s order,
random swaps of two micro-batches of its slowest replica, each kept where the replica's
recurrence gets shorter. Where that search finds nothing, no order of the replica's
micro-batches does much better: what is left is the micro-batches' own loads (with one
sequence per micro-batch a permutation cannot even them out), and the bottleneck stage's
idle time says where it goes. Under plain 1F1B with one sequence a micro-batch it also prints
the floor no placement of the batch goes below (src.data.placement_bound) and so the most of
skew's cost any balancing policy could win back.

    python benchmarks/balance_order_bound.py                 # MLLM-72B, Megatron-LM, 1152 A800s
    python benchmarks/balance_order_bound.py model=mllm_9b   # any override of the run

Prints CPU time beside each search (the machine may be shared).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import plain_config  # noqa: E402
from src.data.balance import Balancing  # noqa: E402
from src.data.loads import batch_loads  # noqa: E402
from src.data.placement_bound import placement_bound, why_no_bound  # noqa: E402
from src.errors import ConfigError, PlanError  # noqa: E402
from src.run import compose_config  # noqa: E402
from src.setup import plan_run, validate  # noqa: E402

# The balancing figure's MLLM-72B case and its Megatron-LM series (benchmarks/balance_figure.py).
DEFAULT = [
    "cluster=a800",
    "cluster.nodes=144",
    "train.global_batch=1920",
    "model=mllm_72b",
    "model.images_per_sequence=10",
    "strategy=megatron",
    "strategy.modality_stages=extra",
    "strategy.replicate=[encoder,generator]",
]


def stage_busy(balancer, loads, order, replica: int) -> list[float]:
    """Seconds each pipeline stage computes for one replica's micro-batches."""
    layout = balancer.layout
    busy = [0.0] * len(balancer.stages)
    for j in range(layout.microbatches):
        first = layout.first_sample(replica, j)
        times = balancer.times(order[first : first + layout.micro_batch], loads)
        busy = [b + f + w for b, f, w in zip(busy, times.fwd, times.bwd)]
    return busy


def search(balancer, loads, order: tuple[int, ...], replica: int, swaps: int, seed: int) -> tuple[float, float]:
    """The replica's recurrence after `swaps` random swaps of two of its micro-batches, each
    kept where it shortens the recurrence; and the CPU seconds taken."""
    layout, rng = balancer.layout, random.Random(seed)
    firsts = [layout.first_sample(replica, j) for j in range(layout.microbatches)]
    current = list(order)
    best = balancer.replica_makespans(loads, current, [replica])[0]
    start = time.process_time()
    for _ in range(swaps):
        a, b = rng.sample(firsts, 2)
        width = layout.micro_batch
        current[a : a + width], current[b : b + width] = current[b : b + width], current[a : a + width]
        span = balancer.replica_makespans(loads, current, [replica])[0]
        if span < best:
            best = span
        else:
            current[a : a + width], current[b : b + width] = current[b : b + width], current[a : a + width]
    return best, time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2, help="global batches 0 .. N-1 of the workload's data")
    parser.add_argument("--swaps", type=int, default=2000, help="swaps tried on the slowest replica")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after the default case's")
    args = parser.parse_args(argv)
    try:
        setup = validate(plain_config(compose_config(["logger=none", *DEFAULT, *args.overrides, "train.balance=cost"])))
        plan = plan_run(setup)
    except (ConfigError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not isinstance(plan.balancing, Balancing):
        print(
            "error: the plan has no pipeline balancing to probe (uniform data, no unit that works per image, or "
            "DistTrain's reordering over disaggregated units)",
            file=sys.stderr,
        )
        return 2
    balancer, model, train = plan.balancing.balancer, setup.model, setup.train
    layout = balancer.layout
    print(f"{' '.join(args.overrides or DEFAULT)}: {layout.dp} replicas x {layout.microbatches} micro-batches of {layout.micro_batch}")
    for batch in range(args.batches):
        drawn = batch_loads(model, train.seed, train.global_batch, train.data, None, batch)
        loads = {unit: list(v) for unit, v in balancer.sequence_loads(drawn).items()}
        mean = {unit: [1.0] * len(v) for unit, v in loads.items()}  # uniform data: every sequence the mean one
        identity = tuple(range(layout.global_batch))
        uniform = balancer.makespan(mean, identity)
        spans = {policy: balancer.makespan(loads, balancer.order(policy, loads)) for policy in ("none", "reorder", "cost")}
        order = balancer.order("cost", loads)
        per_replica = balancer.replica_makespans(loads, order)
        slowest = max(range(layout.dp), key=per_replica.__getitem__)
        found, cpu = search(balancer, loads, order, slowest, args.swaps, seed=batch)
        skew = spans["none"] - uniform
        # A share of the skew's cost only where the data order costs something over uniform data.
        shares = [f"{p} {(spans['none'] - spans[p]) / skew:.0%}" for p in ("reorder", "cost")]
        recovered = ", ".join(shares) if skew > 0 else "no skew cost"
        print(f"batch {batch}: uniform {uniform:.2f} s, " + ", ".join(f"{p} {s:.2f}" for p, s in spans.items()))
        print(
            f"  recovered: {recovered}; slowest replica {slowest} "
            f"after {args.swaps} swaps {per_replica[slowest]:.3f} -> {found:.3f} s ({cpu:.1f} s CPU)"
        )
        floor = placement_bound(balancer, loads)
        if floor is None:
            print(f"  no placement floor: {why_no_bound(balancer)}")
        else:
            most = f"at most {(spans['none'] - floor.seconds) / skew:.0%} of skew's cost" if skew > 0 else "no skew cost"
            heavier = sum(g > floor.steady for g in floor.last) / len(floor.last)
            print(f"  no placement goes below {floor.seconds:.2f} s: {most} is recoverable by any balancing policy")
            print(
                f"  ({heavier:.0%} of the sequences cost the last stage more than a step of the stage before it: "
                f"up to {max(floor.last):.2f} s against {floor.steady:.2f})"
            )
        busy, busy_uniform = stage_busy(balancer, loads, order, slowest), stage_busy(balancer, mean, identity, 0)
        neck = max(range(len(busy)), key=busy.__getitem__)
        print(
            f"  bottleneck stage {neck}: computes {busy[neck]:.2f} s (uniform {busy_uniform[neck]:.2f}); idle "
            f"{per_replica[slowest] - busy[neck]:.2f} s under cost's order, {uniform - busy_uniform[neck]:.2f} s on uniform data"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
