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
metric_label (what the y axis shows, with its unit), normalize (optional: {by: <series>,
invert: bool} reports each series relative to that series in the same group; invert gives
speed-ups from times), base (overrides of every run), series ({name: overrides}, or {name:
{overrides: [...], fastest_of: [[...], ...]}}: one job per variant, the row taking the
fastest that ran, for a baseline the paper pins down only partly, e.g. "PP > 1"), labels
(optional: {series: legend name}), groups (list of {label, overrides, series_overrides
(optional): {series: overrides of that series in this group only}, skip (optional: series
not run in this group, e.g. a baseline the paper did not run there), paper: {series: value
or [low, high]}, paper_extra (optional): {extra metric: {series: value}}}), extra_metrics
(optional: more summary keys shown per row), timed (optional: {repeats: N, metrics: [...]}:
every job runs N times and each of those metrics, a running time of this machine, is the
least over the repeats, the measurement the machine's other load disturbed least, its
largest kept beside it (`timed_spread`: the scorecard judges a running time over both);
every other value is the first repeat's, and repeats that disagree on the iteration time
are a failed row), notes (why the settings are what they are).

results.json carries the preset's fingerprint (`preset_hash`, over every job's overrides,
the reported metrics and the values of the cluster presets the jobs run on), so a reader can
tell results of another version of the preset, or of its clusters.
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

from src.cluster_inputs import cluster_inputs, fingerprint
from src.errors import ConfigError
from src.report import plotting
from src.report.files import SUMMARY_FILE
from src.out_paths import output_dir
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
    variants: dict[str, list[list[str]]] = field(default_factory=dict)  # series -> fastest_of
    labels: dict[str, str] = field(default_factory=dict)
    repeats: int = 1
    timed_metrics: list[str] = field(default_factory=list)

    def label(self, series: str) -> str:
        return self.labels.get(series, series)


def _series(name: str, raw: Any, sweep: str) -> tuple[list[str], list[list[str]]]:
    """A series' overrides and its variants (none: one job)."""
    if not isinstance(raw, dict):
        return list(raw or []), []
    unknown = sorted(set(raw) - {"overrides", "fastest_of"})
    if unknown:
        raise ConfigError(f"sweep {sweep}: series {name} has unknown keys {unknown} (overrides, fastest_of)")
    variants = [list(v or []) for v in raw.get("fastest_of") or []]
    if "fastest_of" in raw and len(variants) < 2:
        raise ConfigError(f"sweep {sweep}: series {name}'s fastest_of needs at least two variants, has {len(variants)}")
    return list(raw.get("overrides") or []), variants


def _timed(raw: Any, sweep: str) -> tuple[int, list[str]]:
    """A sweep's repeats and the running-time metrics taken as their least."""
    if raw is None:
        return 1, []
    if not isinstance(raw, dict) or set(raw) != {"repeats", "metrics"}:
        raise ConfigError(f"sweep {sweep}: timed must be {{repeats: N, metrics: [...]}}, got {raw!r}")
    repeats, metrics = raw["repeats"], raw["metrics"]
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 2:
        raise ConfigError(f"sweep {sweep}: timed.repeats={repeats!r} must be an integer of at least 2")
    if not metrics or not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise ConfigError(f"sweep {sweep}: timed.metrics={metrics!r} must name at least one summary key")
    return repeats, list(metrics)


def load_sweep(path: Path) -> SweepSpec:
    raw = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: the scorecard reads every sweep
    required = ("name", "title", "source", "metric", "series", "groups")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"sweep {path} lacks {missing}")
    series = {name: _series(name, value, raw["name"]) for name, value in raw["series"].items()}
    repeats, timed_metrics = _timed(raw.get("timed"), raw["name"])
    spec = SweepSpec(
        name=raw["name"],
        title=raw["title"],
        source=raw["source"],
        metric=raw["metric"],
        metric_label=raw.get("metric_label", raw["metric"]),
        base=list(raw.get("base", [])),
        series={name: overrides for name, (overrides, _) in series.items()},
        groups=list(raw["groups"]),
        normalize=raw.get("normalize"),
        notes=raw.get("notes", ""),
        extra_metrics=list(raw.get("extra_metrics", [])),
        variants={name: variants for name, (_, variants) in series.items() if variants},
        labels=dict(raw.get("labels") or {}),
        repeats=repeats,
        timed_metrics=timed_metrics,
    )
    if spec.normalize and spec.normalize.get("by") not in spec.series:
        raise ConfigError(f"sweep {spec.name}: normalize.by={spec.normalize.get('by')!r} is not a series ({sorted(spec.series)})")
    strangers = sorted(set(spec.labels) - set(spec.series))
    if strangers:
        raise ConfigError(f"sweep {spec.name}: labels name {strangers}, which are not series ({sorted(spec.series)})")
    return spec


def lookup(summary: dict[str, Any], dotted: str) -> Any:
    value: Any = summary
    for part in dotted.split("."):
        value = value[part]
    return value


def lookup_or_none(summary: dict[str, Any], dotted: str) -> Any:
    """An extra metric some series do not report (Optimus's scheduling efficiencies): None there."""
    try:
        return lookup(summary, dotted)
    except (KeyError, TypeError):
        return None


@dataclass(frozen=True)
class FigureJob:
    group: str
    series: str
    overrides: tuple[str, ...]
    subdir: str  # short and unique: the job's index and its series (and variant, and repeat)
    variant: int | None = None  # index into the series' fastest_of
    repeat: int = 0  # which of the sweep's timed repeats

    @property
    def key(self) -> JobKey:
        return (self.group, self.series, self.variant, self.repeat)


def group_series(spec: SweepSpec, group: dict[str, Any]) -> list[str]:
    """The series a group runs: all but those it skips."""
    return [series for series in spec.series if series not in (group.get("skip") or [])]


def figure_jobs(spec: SweepSpec) -> list[FigureJob]:
    jobs: list[FigureJob] = []
    for group in spec.groups:
        for series in group_series(spec, group):
            series_overrides = spec.series[series]
            overrides = (
                spec.base
                + list(group.get("overrides", []))
                + series_overrides
                + list((group.get("series_overrides") or {}).get(series, []))
            )
            variants: list[tuple[int | None, list[str]]] = list(enumerate(spec.variants.get(series, []))) or [(None, [])]
            for variant, extra in variants:
                suffix = "" if variant is None else f"_{variant}"
                subdir = f"{len(jobs):02d}_{series}{suffix}"
                for repeat in range(spec.repeats):
                    again = f"_r{repeat}" if repeat else ""
                    jobs.append(FigureJob(group["label"], series, tuple(overrides + extra), subdir + again, variant, repeat))
    return jobs


def preset_hash(spec: SweepSpec) -> str:
    """A fingerprint of what a figure's results depend on: its jobs, reported metrics and the
    values of the cluster presets (and their measured tables) the jobs run on."""
    jobs = figure_jobs(spec)
    content = {
        "jobs": [[job.group, job.series, job.variant, list(job.overrides)] for job in jobs],
        "clusters": cluster_inputs(job.overrides for job in jobs),
        "metric": spec.metric,
        "normalize": spec.normalize,
        "extra_metrics": spec.extra_metrics,
        **({"timed": {"repeats": spec.repeats, "metrics": spec.timed_metrics}} if spec.timed_metrics else {}),
    }
    return fingerprint(content)


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
    """A unit's degrees as its strategy states them: Par4D's (x, y, z, dp) grid, else dp/tp/pp
    (and the row shares of a unit replicated over its TP group)."""
    keys = ("grid", "micro_batch") if "grid" in unit else ("dp", "tp", "rows", "pp", "micro_batch")
    return {k: unit[k] for k in keys if k in unit}


def plan_text(facts: dict[str, dict[str, Any]]) -> str:
    """'vision: dp6 tp8 pp1 micro_batch32; text: ...' from each unit's plan_facts."""
    return "; ".join(f"{u}: " + " ".join(f"{k}{v}" for k, v in unit.items()) for u, unit in facts.items())


Outcome = dict[str, Any]
JobKey = tuple[str, str, int | None, int]  # group, series, variant, repeat


def _with_value(summary: Outcome, dotted: str, value: Any) -> Outcome:
    """A copy of a summary with one (dotted) key set, the dictionaries on its path copied."""
    head, _, rest = dotted.partition(".")
    return {**summary, head: _with_value(summary[head], rest, value) if rest else value}


def _least_of_repeats(spec: SweepSpec, repeats: list[Outcome | None]) -> Outcome | None:
    """One job's outcome from its repeats: the first that ran, each timed metric the least
    over those that ran. Repeats that price another iteration are not one measurement."""
    ran = [o for o in repeats if o is not None and "error" not in o]
    if not ran:
        return next((o for o in repeats if o is not None), None)
    times = sorted({o["iteration_time_s"] for o in ran})
    if len(times) > 1:
        return {"error": f"the {len(ran)} timed repeats price different iterations ({times[0]:g} to {times[-1]:g} s)"}
    merged, spread = ran[0], {}
    for metric in spec.timed_metrics:
        values = [lookup_or_none(o, metric) for o in ran]
        if all(v is not None for v in values):
            merged = _with_value(merged, metric, min(values))
            spread[metric] = [min(values), max(values)]
    return {**merged, "timed_repeats": len(ran), "timed_spread": spread}


def chosen_outcomes(spec: SweepSpec, outcomes: dict[JobKey, Outcome | None]) -> dict[tuple[str, str], Outcome]:
    """Each (group, series)'s outcome: its job's (the least of its timed repeats), or for a
    series with variants the fastest variant that ran (its index under 'variant'), else the
    first variant's failure."""
    chosen: dict[tuple[str, str], Outcome] = {}
    for job in figure_jobs(spec):
        if job.repeat:
            continue
        repeats = [outcomes.get((job.group, job.series, job.variant, r)) for r in range(spec.repeats)]
        outcome = _least_of_repeats(spec, repeats) or {"error": "did not finish"}
        if job.variant is not None and "error" not in outcome:
            outcome = {**outcome, "variant": job.variant}
        held = chosen.get((job.group, job.series))
        if held is None or ("error" in held and "error" not in outcome):
            chosen[(job.group, job.series)] = outcome
        elif "error" not in outcome and outcome["iteration_time_s"] < held["iteration_time_s"]:
            chosen[(job.group, job.series)] = outcome
    return chosen


def _row_spread(spec: SweepSpec, spread: dict[str, list[float]]) -> dict[str, list[float]]:
    """A row's timed metrics' [least, largest] by the row's field names: an extra metric's
    own, and 'value' where it is the metric as measured (not normalised by another series)."""
    out = {key: spread[key] for key in spec.extra_metrics if key in spread}
    if spec.metric in spread and not spec.normalize:
        out["value"] = spread[spec.metric]
    return out


def write_report(spec: SweepSpec, outcomes: dict[JobKey, Outcome | None], out: Path) -> str:
    """results.json, results.md and the plot of a figure from its jobs' outcomes (keyed by
    FigureJob.key: a summary, an error, or None for a job that never finished); returns
    the table."""
    raw = chosen_outcomes(spec, outcomes)
    results: dict[str, Any] = {
        "name": spec.name,
        "title": spec.title,
        "source": spec.source,
        "metric": spec.metric,
        "metric_label": spec.metric_label,
        "preset_hash": preset_hash(spec),
        "labels": {series: spec.label(series) for series in spec.series},
        "rows": [],
    }
    for group in spec.groups:
        for series in group_series(spec, group):
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
                    row[key] = lookup_or_none(summary, key)
                row["plan"] = {u: plan_facts(p) for u, p in summary["plan"]["units"].items()}
                if "timed_repeats" in summary:
                    row["timed_repeats"] = summary["timed_repeats"]
                    row["timed_spread"] = _row_spread(spec, summary["timed_spread"])
                if "variant" in summary:
                    row["variant"] = spec.variants[series][summary["variant"]]
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
        if "variant" in row:
            plan += f" (fastest of its variants: {' '.join(row['variant'])})"
        extras = [
            (f"{row[k]:.3g}" if isinstance(row.get(k), float) else "–" if row.get(k) is None else str(row[k]))
            + (f" (paper {_paper_text(row['paper_extra'][k])})" if k in row.get("paper_extra", {}) else "")
            for k in extra
        ]
        label = spec.label(row["series"])
        lines.append("| " + " | ".join([row["group"], label, ours, _paper_text(row["paper"]), gap] + extras + [plan]) + " |")
    if spec.timed_metrics:
        lines += [
            "",
            f"Running times ({', '.join(spec.timed_metrics)}): the least of {spec.repeats} runs of each job "
            "(results.json keeps the largest beside it, `timed_spread`).",
        ]
    if spec.notes:
        lines += ["", "## Notes", "", spec.notes.strip()]
    return "\n".join(lines) + "\n"


def plot(spec: SweepSpec, results: dict[str, Any], path: Path) -> None:
    """One bar per (group, series) with the paper's value over it: a black tick for a value,
    a black bar for a range; a job that did not run is an x on the axis."""
    groups = [g["label"] for g in spec.groups]
    series = list(spec.series)
    width = 0.8 / max(1, len(series))
    fig, (ax,) = plotting.new_figure(max(7.0, 1.2 * len(groups) + 3.5), 4.5)
    marks: dict[str, Any] = {}  # what the paper's marks drawn so far are, by kind, with a legend handle
    for s_index, name in enumerate(series):
        by_group = {r["group"]: r for r in results["rows"] if r["series"] == name}
        xs = [g_index + (s_index - (len(series) - 1) / 2) * width for g_index, g in enumerate(groups) if g in by_group]
        rows = [by_group[g] for g in groups if g in by_group]
        ax.bar(xs, [r["value"] or 0.0 for r in rows], width=width * 0.9, label=f"ours: {spec.label(name)}")
        for x, row in zip(xs, rows):
            paper = row["paper"]
            if isinstance(paper, (list, tuple)):
                low, high = paper
                half = (high - low) / 2
                bar = ax.errorbar([x], [low + half], yerr=[[half]], fmt="none", ecolor="black", elinewidth=1.5, capsize=4)
                marks.setdefault("range", bar)
            elif paper is not None:
                (line,) = ax.plot([x - width * 0.45, x + width * 0.45], [paper, paper], color="black", linewidth=2)
                marks.setdefault("value", line)
            if row["value"] is None:
                (cross,) = ax.plot([x], [0], marker="x", color="tab:red", markersize=8, linestyle="none")
                marks.setdefault("failed", cross)
    handles, labels = ax.get_legend_handles_labels()
    names = {"value": "paper: value", "range": "paper: range", "failed": "not run (results.md says why)"}
    handles += [marks[kind] for kind in names if kind in marks]
    labels += [names[kind] for kind in names if kind in marks]
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(plotting.wrapped(spec.metric_label, fig, share=0.4))
    plotting.title(ax, spec.title)
    plotting.legend_outside(fig, handles, labels=labels)
    plotting.save(fig, path)


def multirun_command(sweep_file: Path, sweep_dir: Path, overrides: list[str]) -> list[str]:
    """The front door's Hydra multirun of one figure: its jobs as the figure sweeper lists them."""
    return [
        sys.executable,
        "-m",
        "src.run",
        "-m",
        "hydra/sweeper=figure",
        f"hydra.sweeper.figure={sweep_file.resolve()}",
        f"hydra.sweep.dir={sweep_dir}",
        *overrides,
    ]


def sweep_from_command_line(argv: list[str] | None, description: str) -> tuple[SweepSpec, Path] | None:
    """Parse `<sweep.yaml> [--out DIR] [overrides]` and run the figure as a Hydra multirun
    of the front door; None (after one error line) if the sweep file is bad or the
    multirun failed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("sweep", type=Path, help="a sweep file in sweeps/")
    parser.add_argument("--out", type=output_dir, default=None, help="output directory (default outputs/sweeps/<name>)")
    args, overrides = parser.parse_known_args(argv)
    try:
        spec = load_sweep(args.sweep)
    except (ConfigError, OSError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    out = (args.out or Path("outputs") / "sweeps" / spec.name).resolve()
    if subprocess.run(multirun_command(args.sweep, out, overrides), cwd=REPO).returncode != 0:
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
