"""Which strategy for my model on my cluster: every contender planned and simulated.

    python -m src.compare model=mllm_9b cluster=a800 cluster.nodes=12
    python -m src.compare -m model=gpt cluster=perlmutter cluster.nodes=4,8,16,32   # a scaling chart

Composes the front door's config (any model, cluster and train override) and prices each
of strategy=auto's contenders (each strategy descriptor's `auto_variants`;
`strategy.contenders=[...]` picks some) in parallel on all cores, saying on stderr how many
are priced while it works. Writes, in the run
directory, compare.md (ranked: iteration time, MFU, throughput, peak memory, breakdown,
plan; then the contenders that do not apply or do not fit, with their one-line reason),
compare.json and compare.png. A multirun adds scaling.md and scaling.png over its jobs in
the sweep directory.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.config import options_from, plain_config, unknown_option
from src.errors import ConfigError
from src.parallel_work import run_all
from src.report import plotting
from src.strategies.auto import AutoOptions, Contender
from src.sweep import plan_facts, plan_text

log = logging.getLogger("src.compare")
RESULTS = "compare.json"
WINNER, OTHERS = "tab:green", "tab:blue"  # compare.png marks the fastest contender
BUBBLES = ("bubble_warmup", "bubble_cooldown", "bubble_imbalance", "bubble_dependency")


def price_contender(config: dict[str, Any], contender: Contender) -> dict[str, Any]:
    """One contender's summary, or its refusal: {'strategy', 'summary'|'reason'}."""
    from src.metrics import summarize
    from src.plan_io import PlannedRun
    from src.setup import validate
    from src.strategies.auto import price
    from src.strategies.base import PlanRequest

    setup = validate(config)
    priced = price(contender, PlanRequest(setup.model, setup.cluster, setup.train, {}))
    if priced.plan is None or priced.timeline is None:
        return {"strategy": contender.label, "reason": priced.reason}
    planned = PlannedRun(setup.model, setup.cluster, setup.train, priced.plan)
    return {"strategy": contender.label, "summary": summarize(planned, priced.timeline)}


def compare(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every chosen contender's outcome, the fastest first, the refused last."""
    from joblib import delayed

    if config["strategy"]["name"] != "auto":
        raise ConfigError(
            f"src.compare prices every strategy; strategy={config['strategy']['name']} picks one "
            f"(choose some with strategy.contenders=[...])"
        )
    from src.setup import validate

    validate(config)  # a bad model, cluster or batch is one line here, not one per contender
    contenders = options_from(AutoOptions, config["strategy"]).chosen()
    task = f"comparing {len(contenders)} strategies for {config['model'].get('name')} on {config['cluster'].get('name')}"
    outcomes = run_all(task, [delayed(price_contender)(config, c) for c in contenders], os.cpu_count() or 1)
    priced = sorted((o for o in outcomes if "summary" in o), key=lambda o: o["summary"]["iteration_time_s"])
    return priced + [o for o in outcomes if "summary" not in o]


def _exposed(breakdown: dict[str, float], total: float) -> str:
    comm = {k.removeprefix("comm_"): v for k, v in breakdown.items() if k.startswith("comm_") and v > 0}
    parts = [f"{k} {100 * v / total:.0f}%" for k, v in sorted(comm.items(), key=lambda kv: -kv[1])]
    return ", ".join(parts) or "none"


def table(outcomes: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"# {title}",
        "",
        "| rank | strategy | GPUs used | iteration s | vs best | MFU | samples/s | peak memory GiB | compute % | exposed comm "
        "(% of iteration) | bubbles % | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    best = next((o["summary"]["iteration_time_s"] for o in outcomes if "summary" in o), None)
    for rank, outcome in enumerate((o for o in outcomes if "summary" in o), start=1):
        s = outcome["summary"]
        total = s["iteration_time_s"]
        breakdown = s["breakdown_s"]
        bubbles = sum(breakdown.get(k, 0.0) for k in BUBBLES)
        plan = plan_text({u: plan_facts(p) for u, p in s["plan"]["units"].items()})
        lines.append(
            f"| {rank} | {outcome['strategy']} | {s['devices']} | {total:.4g} | {total / best:.2f}x | {100 * s['mfu']:.1f} % | "
            f"{s['throughput_samples_per_s']:.4g} | {s['peak_memory_gib']:.1f} | "
            f"{100 * breakdown.get('compute', 0.0) / total:.0f} | {_exposed(breakdown, total)} | "
            f"{100 * bubbles / total:.0f} | {plan} |"
        )
    refused = [o for o in outcomes if "summary" not in o]
    if refused:
        lines += ["", "Not run:", ""] + [f"- {o['strategy']}: {o['reason']}" for o in refused]
    return "\n".join(lines)


def bar_chart(outcomes: list[dict[str, Any]], title: str, path: Path) -> None:
    """Each priced contender's throughput, the fastest first and in green (the legend says so)."""
    from matplotlib.patches import Patch

    priced = [o for o in outcomes if "summary" in o]
    if not priced:
        return
    fig, (ax,) = plotting.new_figure(8.0, 0.5 * len(priced) + 2.0)
    names = [o["strategy"] for o in priced][::-1]
    values = [o["summary"]["throughput_samples_per_s"] for o in priced][::-1]
    ax.barh(names, values, color=[WINNER if i == len(values) - 1 else OTHERS for i in range(len(values))])
    ax.set_xlabel("throughput (samples/s), simulated")
    plotting.title(ax, title)
    plotting.legend_outside(
        fig, [Patch(color=WINNER, label="fastest (highest throughput)"), Patch(color=OTHERS, label="the other contenders")]
    )
    plotting.save(fig, path)


def write(outcomes: list[dict[str, Any]], config: dict[str, Any], out: Path) -> str:
    cluster = config["cluster"]
    # The cluster's GPUs: a contender may leave some idle (DistTrain's orchestration can), which
    # its row's "GPUs used" says.
    devices = cluster["nodes"] * cluster["devices_per_node"] if any("summary" in o for o in outcomes) else None
    title = (
        f"{config['model']['name']} on {cluster['name']}"
        + (f" ({devices} devices)" if devices else "")
        + ", global batch "
        + str(next((o["summary"]["global_batch"] for o in outcomes if "summary" in o), config["train"]["global_batch"]))
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS).write_text(
        json.dumps(
            {"title": title, "model": config["model"]["name"], "cluster": cluster["name"], "devices": devices, "outcomes": outcomes},
            indent=1,
        )
        + "\n"
    )
    text = table(outcomes, title)
    (out / "compare.md").write_text(text + "\n")
    bar_chart(outcomes, title, out / "compare.png")
    return text


class ScalingReport(Callback):
    """At the end of a multirun: each strategy's throughput per job (scaling.md) and, when
    the jobs differ only in size, over the device count (scaling.png)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        results = [json.loads(p.read_text()) for p in sorted(sweep.glob(f"*/{RESULTS}"))]
        results = [r for r in results if r["devices"]]
        if len(results) < 2:
            return
        results.sort(key=lambda r: (r["model"], r["cluster"], r["devices"]))
        strategies = list(dict.fromkeys(o["strategy"] for r in results for o in r["outcomes"] if "summary" in o))
        rows = ["| job | " + " | ".join(strategies) + " |", "|---|" + "---|" * len(strategies)]
        for r in results:
            by = {o["strategy"]: o.get("summary") for o in r["outcomes"]}
            cells = [f"{by[s]['throughput_samples_per_s']:.4g}" if by.get(s) else "–" for s in strategies]
            rows.append(f"| {r['title']} | " + " | ".join(cells) + " |")
        text = "# Throughput (samples/s, simulated) per job\n\n" + "\n".join(rows)
        (sweep / "scaling.md").write_text(text + "\n")
        log.info(text)
        one_setting = len({(r["model"], r["cluster"]) for r in results}) == 1
        if one_setting and len({r["devices"] for r in results}) == len(results):
            self._plot(results, strategies, sweep / "scaling.png")

    @staticmethod
    def _plot(results: list[dict[str, Any]], strategies: list[str], path: Path) -> None:
        fig, (ax,) = plotting.new_figure(8.0, 4.5)
        for name in strategies:
            points = [
                (r["devices"], o["summary"]["throughput_samples_per_s"])
                for r in results
                for o in r["outcomes"]
                if o["strategy"] == name and "summary" in o
            ]
            ax.plot([d for d, _ in points], [t for _, t in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel("throughput (samples/s), simulated")
        plotting.title(ax, f"{results[0]['model']} on {results[0]['cluster']}")
        plotting.legend_outside(fig)
        plotting.save(fig, path)


@hydra.main(version_base=None, config_path="../conf", config_name="compare")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    config = plain_config(cfg)
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        outcomes = compare(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            sys.exit(2)
        return
    print(write(outcomes, config, out))


if __name__ == "__main__":
    problem = unknown_option(sys.argv[1:], "compare")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
