"""What each balancing policy buys each strategy on skewed data, judged over many batches.

    python -m src.balance_study --batches 16 model=mllm_9b cluster=a800 cluster.nodes=144 \\
        train.global_batch=1920 model.images_per_sequence=10

Each series (--series LABEL='OVERRIDES', repeatable; by default Megatron-LM and DistTrain at
their config groups' defaults) is planned once per policy (--policies; train.balance) and
that plan is priced on global batches 0 .. N-1 of the workload's data (the strategy
descriptor's `batches`: its choices kept from batch to batch, its sequences placed anew by the
policy on each), and once on uniform data (every sequence at the mean: what skew is
measured against). Per series and policy: the iteration's mean, 95th percentile and worst
over the batches, MFU at the mean iteration, the speed-up over policy none, the share of
the skew's cost (policy none's mean against uniform) the policy wins back, and the policy's
plan priced on uniform data too: a plan chosen for skewed data (DistTrain's, or
strategy.choose_on=data) may be slower there than the plan chosen for uniform data, and that
part of the skew's cost is its shape's, which no placement wins back; the rest (the mean
against that plan on uniform data) is what its placement leaves. Writes balance.json and
balance.md into --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from src.cluster_inputs import presets_fingerprint
from src.config import BALANCE_POLICIES
from src.errors import ConfigError
from src.parallel_work import run_all
from src.out_paths import output_dir

DEFAULT_SERIES = ("megatron=strategy=megatron", "disttrain=strategy=disttrain")
UNIFORM = "uniform"


@dataclass(frozen=True)
class Job:
    series: str
    overrides: tuple[str, ...]
    policy: str  # a balancing policy, or UNIFORM: uniform data, one batch


def price(job: Job, batches: int) -> dict[str, Any]:
    """The job's iteration seconds and MFU on each batch, or the one line that refused it."""
    from src.metrics import summarize
    from src.plan_io import PlannedRun
    from src.config import composed
    from src.setup import LIMITS, validate
    from src.sim.engine import simulate
    from src.strategies.base import PlanRequest
    from src.strategies import strategy_for

    extra = ["train.data=uniform"] if job.policy == UNIFORM else [f"train.balance={job.policy}"]
    try:
        setup = validate(composed([*job.overrides, *extra]))
        strategy = setup.config["strategy"]
        spec = strategy_for(strategy["name"])
        if spec.batches is None:
            raise ConfigError(f"strategy={strategy['name']} prices its plan at the mean load whatever the data: no batch to balance")
        if job.policy != UNIFORM and setup.train.data == "uniform":
            raise ConfigError("train.data=uniform: every sequence weighs the same, no batch to balance (train.data=interleaved)")
        request = PlanRequest(setup.model, setup.cluster, setup.train, strategy, None, LIMITS["sim"])
        # A policy's plan is also priced on uniform data (None: base.on_batch), its choices kept.
        indices: list[int | None] = [0] if job.policy == UNIFORM else [*range(batches), None]
        rows = []
        for plan in spec.batches(request, indices):
            timeline = simulate(plan.program, setup.model, setup.cluster, plan.precision)
            summary = summarize(PlannedRun(setup.model, setup.cluster, setup.train, plan), timeline)
            rows.append(
                {k: summary[k] for k in ("iteration_time_s", "mfu", "model_flops_per_iteration", "devices", "peak_flops_per_device")}
            )
    except ConfigError as err:  # PlanError is one
        return {"series": job.series, "policy": job.policy, "reason": str(err).splitlines()[0]}
    if job.policy == UNIFORM:
        return {"series": job.series, "policy": job.policy, "batches": rows}
    return {"series": job.series, "policy": job.policy, "batches": rows[:-1], "plan_on_uniform": rows[-1]}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile by linear interpolation between order statistics."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def aggregate(outcomes: list[dict[str, Any]], skew_of: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Per series and policy: mean, p95 and worst iteration, MFU at the mean, and the share
    of the skew's cost won back against policy none. `skew_of` maps a series to the series
    whose uniform and none rows measure its skew (a series whose plan itself depends on the
    data is judged against the skew of the plan it replaces; its own none row then too)."""
    rows = []
    skew_of = skew_of or {}
    by_key = {(o["series"], o["policy"]): o for o in outcomes}
    for o in outcomes:
        row: dict[str, Any] = {"series": o["series"], "policy": o["policy"]}
        reference = skew_of.get(o["series"], o["series"])
        if reference != o["series"]:
            row["against"] = reference
        if "reason" in o:
            rows.append(row | {"reason": o["reason"]})
            continue
        times = [b["iteration_time_s"] for b in o["batches"]]
        mean = sum(times) / len(times)
        first = o["batches"][0]
        flops = sum(b["model_flops_per_iteration"] for b in o["batches"]) / len(times)
        row |= {
            "batches": len(times),
            "mean_s": mean,
            "p95_s": percentile(times, 95),
            "max_s": max(times),
            "mfu": flops / (mean * first["devices"] * first["peak_flops_per_device"]),
        }
        if "plan_on_uniform" in o:
            row["plan_uniform_s"] = o["plan_on_uniform"]["iteration_time_s"]
            row["placement_s"] = mean - row["plan_uniform_s"]
        uniform, none = by_key.get((reference, UNIFORM)), by_key.get((reference, "none"))
        judged = o["policy"] != UNIFORM and (o["policy"] != "none" or reference != o["series"])
        if judged and uniform and none and "batches" in uniform and "batches" in none:
            base = uniform["batches"][0]["iteration_time_s"]
            skewed = sum(b["iteration_time_s"] for b in none["batches"]) / len(none["batches"])
            row["gain"] = skewed / mean
            if skewed > base:
                row["recovered"] = (skewed - mean) / (skewed - base)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], title: str) -> str:
    out = [
        f"# {title}",
        "",
        "| series | policy | batches | mean iteration (s) | p95 (s) | worst (s) | MFU at the mean | speed-up over none "
        "| skew's cost recovered | its plan on uniform data (s) | left to placement (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "reason" in r:
            out.append(f"| {r['series']} | {r['policy']} | refused: {r['reason']} | | | | | | | | |")
            continue
        recovered = f"{100 * r['recovered']:.0f} %" if "recovered" in r else ""
        gain = f"{r['gain']:.3f}x" if "gain" in r else ""
        series = f"{r['series']} (skew of {r['against']})" if "against" in r else r["series"]
        on_uniform = f"{r['plan_uniform_s']:.3f} | {r['placement_s']:.3f}" if "plan_uniform_s" in r else " |"
        out.append(
            f"| {series} | {r['policy']} | {r['batches']} | {r['mean_s']:.3f} | {r['p95_s']:.3f} | "
            f"{r['max_s']:.3f} | {100 * r['mfu']:.1f} % | {gain} | {recovered} | {on_uniform} |"
        )
    return "\n".join(out) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16, help="global batches each plan is priced on (default 16)")
    parser.add_argument("--policies", default=",".join(BALANCE_POLICIES), help="comma-separated train.balance policies")
    parser.add_argument("--series", action="append", help="LABEL='OVERRIDES' (repeatable); default: megatron, disttrain")
    parser.add_argument(
        "--skew-of",
        action="append",
        default=[],
        help="LABEL=REFERENCE (repeatable): series LABEL's skew and speed-ups measured against REFERENCE's uniform and none rows",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="jobs priced at once")
    parser.add_argument("--out", type=output_dir, default=Path("outputs/balance_study"), help="where balance.json and balance.md go")
    parser.add_argument("--title", default="Balancing policies on skewed data")
    parser.add_argument("overrides", nargs="*", help="the front door's overrides every series shares (model=..., cluster=...)")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.jobs < 1:
        raise ConfigError(f"--batches {args.batches} and --jobs {args.jobs} must be positive")
    policies = args.policies.split(",")
    for policy in policies:
        if policy not in BALANCE_POLICIES:
            raise ConfigError(f"--policies: {policy!r}; choose from {list(BALANCE_POLICIES)}")
    args.policies = policies
    series = []
    for item in args.series or DEFAULT_SERIES:
        label, sep, overrides = item.partition("=")
        if not sep or not label or not overrides:
            raise ConfigError(f"--series {item!r}: write LABEL='OVERRIDES', e.g. megatron='strategy=megatron strategy.pp=3'")
        series.append((label, tuple(shlex.split(overrides))))
    args.series = series
    labels = [label for label, _ in series]
    skew_of = {}
    for item in args.skew_of:
        label, sep, reference = item.partition("=")
        if not sep or label not in labels or reference not in labels:
            raise ConfigError(f"--skew-of {item!r}: write LABEL=REFERENCE, two of the series {labels}")
        skew_of[label] = reference
    args.skew_of = skew_of
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        from joblib import delayed

        jobs = [
            Job(label, (*args.overrides, *overrides), policy)
            for label, overrides in args.series
            for policy in (UNIFORM, *args.policies)
        ]
        task = f"pricing {len(jobs)} series and policies on {args.batches} batches"
        outcomes = run_all(task, [delayed(price)(job, args.batches) for job in jobs], args.jobs)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = aggregate(outcomes, args.skew_of)
    text = table(rows, args.title)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "title": args.title,
        "overrides": args.overrides,
        "series": {label: list(overrides) for label, overrides in args.series},
        "presets": presets_fingerprint(job.overrides for job in jobs),
        "batches": args.batches,
        "skew_of": args.skew_of,
        "rows": rows,
        "outcomes": outcomes,
    }
    (args.out / "balance.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "balance.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
