"""A paper figure: its sweep file, its jobs, and its table and plot with the paper's values
beside ours.

    python -m src.run -m +experiment=par4d_table3_megatron   # the figure as a Hydra multirun
    python -m src.sweep sweeps/par4d_table3_megatron.yaml [--out DIR] [overrides]  # the same

A sweep file names groups (the x axis: a model, a scale) and series (the bars: a
strategy), each a list of Hydra overrides; every (group, series) pair is one job of the
front door, in its own directory `<job>_<series>` of the sweep directory. Hydra's figure
sweeper (hydra_plugins/mmdist_figures) launches the jobs and calls write_report when they
are done; `python -m src.sweep` is a thin wrapper that starts that multirun. The paper's
values are reference data in the sweep file; nothing reads them but this report.

Sweep file keys: name, title, source, metric (a summary.json key, dotted for nesting),
metric_label, normalize (optional: {by: <series>, invert: bool} reports each series
relative to that series in the same group; invert gives speed-ups from times),
base (overrides of every run), series ({name: overrides}), groups (list of {label,
overrides, series_overrides (optional): {series: overrides of that series in this group only},
paper: {series: value or [low, high]}, paper_extra (optional): {extra metric: {series: value}}}),
extra_metrics (optional: more summary keys shown per row), notes (why the settings are what
they are).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from src.errors import ConfigError
from src.report.files import SUMMARY_FILE
from src.setup import ERROR_FILE

REPO = Path(__file__).resolve().parent.parent


@dataclass
class SweepSpec:
    name: str
    title: str
    source: str
    metric: str
    metric_label: str
    base: list[str]
    series: dict[str, list[str]]
    groups: list[dict[str, Any]]
    normalize: dict[str, Any] | None = None
    notes: str = ""
    extra_metrics: list[str] = field(default_factory=list)


def load_sweep(path: Path) -> SweepSpec:
    raw = yaml.safe_load(path.read_text())
    required = ("name", "title", "source", "metric", "series", "groups")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"sweep {path} lacks {missing}")
    spec = SweepSpec(
        name=raw["name"],
        title=raw["title"],
        source=raw["source"],
        metric=raw["metric"],
        metric_label=raw.get("metric_label", raw["metric"]),
        base=list(raw.get("base", [])),
        series={k: list(v or []) for k, v in raw["series"].items()},
        groups=list(raw["groups"]),
        normalize=raw.get("normalize"),
        notes=raw.get("notes", ""),
        extra_metrics=list(raw.get("extra_metrics", [])),
    )
    if spec.normalize and spec.normalize.get("by") not in spec.series:
        raise ConfigError(f"sweep {spec.name}: normalize.by={spec.normalize.get('by')!r} is not a series ({sorted(spec.series)})")
    return spec


def lookup(summary: dict[str, Any], dotted: str) -> Any:
    value: Any = summary
    for part in dotted.split("."):
        value = value[part]
    return value


@dataclass(frozen=True)
class FigureJob:
    group: str
    series: str
    overrides: list[str]
    subdir: str  # short and unique: the job's index and its series


def figure_jobs(spec: SweepSpec) -> list[FigureJob]:
    jobs: list[FigureJob] = []
    for group in spec.groups:
        for series, series_overrides in spec.series.items():
            overrides = (
                spec.base
                + list(group.get("overrides", []))
                + series_overrides
                + list((group.get("series_overrides") or {}).get(series, []))
            )
            jobs.append(FigureJob(group["label"], series, overrides, f"{len(jobs):02d}_{series}"))
    return jobs


def find_sweep_file(figure: str) -> Path:
    """A sweep file by path, from the working directory or the repository."""
    for path in (Path(figure), REPO / figure):
        if path.is_file():
            return path
    raise ConfigError(f"no sweep file {figure!r} (looked in the working directory and {REPO.name}/)")


def outcome_of(job_dir: Path) -> dict[str, Any] | None:
    """A finished job's summary, or its one-line failure; None if it has not finished."""
    if (job_dir / SUMMARY_FILE).exists():
        return json.loads((job_dir / SUMMARY_FILE).read_text())
    if (job_dir / ERROR_FILE).exists():
        return {"error": (job_dir / ERROR_FILE).read_text().strip()}
    return None


def _paper_text(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, (list, tuple)):
        return f"{value[0]:.3g}–{value[1]:.3g}"
    return f"{value:.3g}"


def _paper_mid(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return (value[0] + value[1]) / 2
    return float(value)


def plan_facts(unit: dict[str, Any]) -> dict[str, Any]:
    """A unit's degrees as its strategy states them: Par4D's (x, y, z, dp) grid, else dp/tp/pp."""
    keys = ("grid", "micro_batch") if "grid" in unit else ("dp", "tp", "pp", "micro_batch")
    return {k: unit[k] for k in keys if k in unit}


def plan_text(facts: dict[str, dict[str, Any]]) -> str:
    """'vision: dp6 tp8 pp1 micro_batch32; text: ...' from each unit's plan_facts."""
    return "; ".join(f"{u}: " + " ".join(f"{k}{v}" for k, v in unit.items()) for u, unit in facts.items())


def write_report(spec: SweepSpec, outcomes: dict[tuple[str, str], dict[str, Any] | None], out: Path) -> str:
    """results.json, results.md and the plot of a figure from its jobs' outcomes (a
    summary, an error, or None for a job that never finished); returns the table."""
    raw: dict[tuple[str, str], dict[str, Any]] = {
        key: outcome if outcome is not None else {"error": "did not finish"} for key, outcome in outcomes.items()
    }
    results: dict[str, Any] = {"name": spec.name, "title": spec.title, "source": spec.source, "metric": spec.metric, "rows": []}
    for group in spec.groups:
        for series in spec.series:
            summary = raw[(group["label"], series)]
            row: dict[str, Any] = {
                "group": group["label"],
                "series": series,
                "paper": (group.get("paper") or {}).get(series),
                "paper_extra": {key: values[series] for key, values in (group.get("paper_extra") or {}).items() if series in values},
            }
            if "error" in summary:
                row.update(value=None, error=summary["error"])
            else:
                value: float | None = float(lookup(summary, spec.metric))
                if spec.normalize:
                    base = raw[(group["label"], spec.normalize["by"])]
                    base_value = None if "error" in base else float(lookup(base, spec.metric))
                    if base_value is None or value is None:
                        value = None
                    else:
                        value = base_value / value if spec.normalize.get("invert") else value / base_value
                row["value"] = value
                for key in spec.extra_metrics:
                    row[key] = lookup(summary, key)
                row["plan"] = {u: plan_facts(p) for u, p in summary["plan"]["units"].items()}
            results["rows"].append(row)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(spec, results)
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    (out / "results.md").write_text(table)
    plot(spec, results, out / f"{spec.name}.png")
    return table


def markdown_table(spec: SweepSpec, results: dict[str, Any]) -> str:
    extra = spec.extra_metrics
    lines = [
        f"# {spec.title}",
        "",
        f"Source: {spec.source}",
        "",
        "| " + " | ".join(["group", "series", f"ours: {spec.metric_label}", "paper", "gap"] + extra + ["plan"]) + " |",
        "|" + "---|" * (6 + len(extra)),
    ]
    for row in results["rows"]:
        paper = _paper_mid(row["paper"])
        value = row["value"]
        if value is None:
            ours, gap = f"not run: {row.get('error', 'baseline failed')}", "–"
        else:
            ours = f"{value:.3g}"
            gap = "–" if paper is None else f"{(value - paper) / paper * 100:+.0f}%"
        plan = plan_text(row.get("plan", {}))
        extras = [
            (f"{row[k]:.3g}" if isinstance(row.get(k), float) else str(row.get(k, "–")))
            + (f" (paper {_paper_text(row['paper_extra'][k])})" if k in row.get("paper_extra", {}) else "")
            for k in extra
        ]
        lines.append("| " + " | ".join([row["group"], row["series"], ours, _paper_text(row["paper"]), gap] + extras + [plan]) + " |")
    if spec.notes:
        lines += ["", "## Notes", "", spec.notes.strip()]
    return "\n".join(lines) + "\n"


def plot(spec: SweepSpec, results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g["label"] for g in spec.groups]
    series = list(spec.series)
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    for s_index, name in enumerate(series):
        rows = [r for r in results["rows"] if r["series"] == name]
        xs = [g_index + (s_index - (len(series) - 1) / 2) * width for g_index in range(len(groups))]
        values = [r["value"] if r["value"] is not None else 0.0 for r in rows]
        ax.bar(xs, values, width=width * 0.9, label=f"ours: {name}")
        for x, row in zip(xs, rows):
            paper = row["paper"]
            if isinstance(paper, (list, tuple)):
                ax.plot([x, x], paper, color="black", linewidth=2)
            elif paper is not None:
                ax.plot([x - width * 0.4, x + width * 0.4], [paper, paper], color="black", linewidth=2)
    ax.plot([], [], color="black", linewidth=2, label="paper")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=15, ha="right")
    ax.set_ylabel(spec.metric_label)
    ax.set_title(spec.title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_from_command_line(argv: list[str] | None, description: str) -> tuple[SweepSpec, Path] | None:
    """Parse `<sweep.yaml> [--out DIR] [overrides]` and run the figure as a Hydra multirun
    of the front door; None (after one error line) if the sweep file is bad or the
    multirun failed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("sweep", type=Path, help="a sweep file in sweeps/")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default outputs/sweeps/<name>)")
    args, overrides = parser.parse_known_args(argv)
    try:
        spec = load_sweep(args.sweep)
    except (ConfigError, OSError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    out = (args.out or Path("outputs") / "sweeps" / spec.name).resolve()
    command = [
        sys.executable,
        "-m",
        "src.run",
        "-m",
        "hydra/sweeper=figure",
        f"hydra.sweeper.figure={args.sweep.resolve()}",
        f"hydra.sweep.dir={out}",
        *overrides,
    ]
    if subprocess.run(command, cwd=REPO).returncode != 0:
        print(f"error: the multirun of {spec.name} failed (its output is above)", file=sys.stderr)
        return None
    return spec, out


def main(argv: list[str] | None = None) -> int:
    ran = sweep_from_command_line(argv, __doc__.splitlines()[0])
    if ran is None:
        return 2
    spec, out = ran
    print(f"wrote {out / 'results.md'} and {out / (spec.name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
