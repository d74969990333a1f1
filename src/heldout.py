"""The simulator against public runs it was never tuned to (a check, never an input).

    python -m src.heldout [--runs benchmarks/heldout/runs.yaml] [--out benchmarks/results] [--only k22]

Each run of the data file (Megatron-LM's and ZeRO-3's published runs on DGX A100 clusters,
with the configuration and the source each states) is planned with that configuration on
the `dgx_a100` preset (nodes = GPUs / 8, the run's era's attention kernel and precision) and
simulated; the published iteration time is the source's, or, where the source gives achieved
teraFLOP/s per GPU, its own FLOP count (Narayanan et al. 2021, Eq. 3) over that rate. Writes
heldout.json and heldout.md under --out: per run the published and simulated seconds and the
error (negative: the simulator is faster), per source the mean absolute error and how many
runs fall on each side. No constant is set from these numbers: a gap is reported with what
we believe causes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from src.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "benchmarks" / "heldout" / "runs.yaml"
OUT = REPO / "benchmarks" / "results"
GPUS_PER_NODE = 8  # dgx_a100


@dataclass(frozen=True)
class Run:
    id: str
    source: str
    where: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    global_batch: int
    strategy: dict[str, Any]
    published: dict[str, float]
    config: str = ""
    assumed: str = ""


def load(path: Path) -> tuple[dict[str, Any], list[Run]]:
    """The data file's sources and common settings, and its runs."""
    data = yaml.safe_load(path.read_text())
    runs = [Run(**row) for row in data["runs"]]
    unknown = sorted({r.source for r in runs} - set(data["sources"]))
    if unknown:
        raise ConfigError(f"{path}: runs cite sources {unknown} that `sources` does not list")
    return data, runs


def narayanan_flops(run: Run, seq_len: int, vocab: int) -> float:
    """FLOPs of one iteration as Narayanan et al. 2021 count them (Eq. 3, with the
    recomputed forward): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    b, s, l, h = run.global_batch, seq_len, run.layers, run.hidden
    return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + vocab / (16.0 * l * h))


def published_seconds(run: Run, seq_len: int, vocab: int) -> float:
    if "iteration_s" in run.published:
        return float(run.published["iteration_s"])
    if "tflops_per_gpu" in run.published:
        return narayanan_flops(run, seq_len, vocab) / (run.published["tflops_per_gpu"] * 1e12 * run.gpus)
    raise ConfigError(f"run {run.id}: published needs iteration_s or tflops_per_gpu, got {sorted(run.published)}")


def overrides(run: Run, common: dict[str, Any]) -> list[str]:
    """The front door's overrides for the run's stated configuration."""
    if run.gpus % GPUS_PER_NODE:
        raise ConfigError(f"run {run.id}: {run.gpus} GPUs is not a whole number of {GPUS_PER_NODE}-GPU DGX A100 nodes")
    model = common["model"]
    out = [
        "model=gpt",
        "model.preset=null",
        f"model.layers={run.layers}",
        f"model.hidden={run.hidden}",
        f"model.heads={run.heads}",
        f"model.vocab={model['vocab']}",
        f"model.attention={model['attention']}",
        f"model.dropout={_value(model['dropout'])}",
        f"train.seq_len={model['seq_len']}",
        f"train.global_batch={run.global_batch}",
        f"train.precision={common['precision']}",
        "cluster=dgx_a100",
        f"cluster.nodes={run.gpus // GPUS_PER_NODE}",
        "logger=none",
    ]
    strategy = dict(run.strategy)
    name = strategy.pop("name")
    out.append(f"strategy={name}")
    if name == "megatron":
        # The 2021-2022 runs: no distributed optimizer; sequence parallelism only where stated.
        strategy.setdefault("sequence_parallel", False)
        strategy.setdefault("zero_stage", 0)
        strategy["schedule"] = "interleaved" if strategy.get("vpp", 1) > 1 else "1f1b"
    out += [f"strategy.{key}={_value(value)}" for key, value in strategy.items()]
    return out


def _value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def simulate_run(run: Run, common: dict[str, Any]) -> float:
    """Seconds of one simulated iteration of the run's plan."""
    from src.config import composed
    from src.setup import plan_run, validate
    from src.sim.engine import simulate

    setup = validate(composed(overrides(run, common)))
    plan = plan_run(setup)
    return simulate(plan.program, setup.model, setup.cluster, plan.precision).iteration_time


def check(runs: list[Run], data: dict[str, Any]) -> list[dict[str, Any]]:
    common = data["common"]
    rows = []
    for run in runs:
        row: dict[str, Any] = {
            "id": run.id,
            "source": run.source,
            "where": run.where,
            "series": series(run),
            "gpus": run.gpus,
            "assumed": run.assumed,
        }
        published = published_seconds(run, common["model"]["seq_len"], common["model"]["vocab"])
        row["published_s"] = published
        try:
            simulated = simulate_run(run, common)
        except (ConfigError, RuntimeError) as err:
            row["error"] = str(err).splitlines()[0]
        else:
            row.update(simulated_s=simulated, error_pct=100.0 * (simulated - published) / published)
        rows.append(row)
        shown = row.get("error") or f"published {published:.3f} s, simulated {row['simulated_s']:.3f} s ({row['error_pct']:+.1f} %)"
        print(f"{run.id}: {shown}", file=sys.stderr, flush=True)
    return rows


def series(run: Run) -> str:
    """The source, its table and the strategy: the groups whose errors are summed up."""
    table = run.where.split(" (")[0]
    strategy = run.strategy["name"] + (f" ZeRO-{run.strategy['zero_stage']}" if "zero_stage" in run.strategy else "")
    return f"{run.source}, {table}, {strategy}"


def summarize(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Per value of `key` (source, series): mean absolute error, mean signed error, runs
    simulated faster / slower."""
    out = {}
    for group in dict.fromkeys(r[key] for r in rows):
        errors = [r["error_pct"] for r in rows if r[key] == group and "error_pct" in r]
        if errors:
            out[group] = {
                "runs": len(errors),
                "mape_pct": statistics.fmean(abs(e) for e in errors),
                "mean_error_pct": statistics.fmean(errors),
                "simulated_faster": sum(e < 0 for e in errors),
                "simulated_slower": sum(e >= 0 for e in errors),
            }
    return out


def table(rows: list[dict[str, Any]], summaries: dict[str, dict[str, dict[str, Any]]], data: dict[str, Any]) -> str:
    lines = [
        "# Held-out public runs on the dgx_a100 preset",
        "",
        "`python -m src.heldout`: each run priced with its source's configuration (benchmarks/heldout/runs.yaml).",
        "Error = (simulated - published) / published: negative, the simulator is faster. A check: no constant is",
        "set from these numbers.",
        "",
        "| run | source | GPUs | published s | simulated s | error % | assumed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        simulated = f"{r['simulated_s']:.3f}" if "simulated_s" in r else f"failed: {r['error']}"
        error = f"{r['error_pct']:+.1f}" if "error_pct" in r else ""
        cells = [r["id"], f"{r['source']} ({r['where']})", str(r["gpus"]), f"{r['published_s']:.3f}", simulated, error, r["assumed"]]
        lines.append("| " + " | ".join(cells) + " |")
    for key, summary in summaries.items():
        lines += ["", f"| {key} | runs | MAPE % | mean error % | simulated faster / slower |", "|---|---|---|---|---|"]
        for group, s in summary.items():
            lines.append(
                f"| {group} | {s['runs']} | {s['mape_pct']:.1f} | {s['mean_error_pct']:+.1f} | "
                f"{s['simulated_faster']} / {s['simulated_slower']} |"
            )
    lines += ["", "Sources:"]
    lines += [f"- {key}: {s['title']}; {s['software']}" for key, s in data["sources"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", default="", help="the runs whose id contains this")
    args = parser.parse_args()
    try:
        data, runs = load(args.runs)
    except (OSError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    runs = [r for r in runs if args.only in r.id]
    if not runs:
        parser.error(f"--only {args.only!r} matches no run of {args.runs}")
    rows = check(runs, data)
    summaries = {"source": summarize(rows, "source"), "series": summarize(rows, "series")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heldout.json").write_text(json.dumps({"rows": rows, "by": summaries}, indent=2) + "\n")
    text = table(rows, summaries, data)
    (args.out / "heldout.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
