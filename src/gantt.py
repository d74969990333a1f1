"""Gantt charts of simulated iterations: one row per rank class, its compute stream as
bars coloured by phase and labelled with the micro-batch (DistMM Figure 6 is such a
picture: GPipe with batch-sync against DistMM-Pipe).

    python -m src.gantt sweeps/distmm_fig6_pipeline.yaml [--out DIR]

runs the sweep (its table and bar chart as src.sweep writes them) and draws every run's
trace.json, the simulator's Chrome trace, one panel per run, into <out>/<name>_gantt.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from src.program import COMPUTE_STREAM
from src.report import plotting
from src.report.sinks import TRACE_FILE
from src.sweep import figure_jobs, sweep_from_command_line
from src.timeline import RankTimeline, Span, Timeline

# Bars by the phase that starts a compute span's name (engine: "<phase> <unit> L<a>-<b>").
PHASE_COLOURS = {
    "fwd": "#4c72b0",
    "bwd": "#dd8452",
    "bwd_input": "#dd8452",
    "bwd_weight": "#c44e52",
    "interaction": "#55a868",
    "optimizer": "#8c8c8c",
}


def load_trace(path: Path) -> Timeline:
    """A Timeline rebuilt from a Chrome trace written by report.trace (spans and labels;
    the breakdown is not in a trace and stays empty)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    labels = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    streams = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans: dict[int, list[Span]] = {pid: [] for pid in labels}
    for e in events:
        if e.get("ph") != "X":
            continue
        start = e["ts"] / 1e6
        spans[e["pid"]].append(
            Span(
                streams[(e["pid"], e["tid"])],
                start,
                start + e["dur"] / 1e6,
                e["name"],
                e["cat"],
                e["args"].get("unit", ""),
                e["args"].get("microbatch", -1),
            )
        )
    ranks = [
        RankTimeline(
            ranks=(), label=labels[pid], units=(), spans=spans[pid], breakdown={}, end=max((s.end for s in spans[pid]), default=0.0)
        )
        for pid in sorted(labels)
    ]
    return Timeline(iteration_time=max((r.end for r in ranks), default=0.0), ranks=ranks)


def draw(ax, timeline: Timeline, title: str) -> None:
    """One row per rank class (first class on top); compute bars with micro-batch labels."""
    rows = [r for r in timeline.ranks if any(s.stream == COMPUTE_STREAM for s in r.spans)]
    scale = 1e3  # milliseconds read better than seconds for one iteration
    for row, rank_timeline in enumerate(rows):
        y = len(rows) - 1 - row
        for span in rank_timeline.spans:
            if span.stream != COMPUTE_STREAM:
                continue
            phase = span.name.split()[0]
            width = (span.end - span.start) * scale
            ax.barh(
                y,
                width,
                left=span.start * scale,
                height=0.7,
                color=PHASE_COLOURS.get(phase, "#937860"),
                edgecolor="white",
                linewidth=0.5,
            )
            if span.microbatch >= 0 and phase != "optimizer" and width > timeline.iteration_time * scale / 80:
                text = "S" if phase == "interaction" else str(span.microbatch)
                ax.text(span.start * scale + width / 2, y, text, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r.label.split(" (ranks")[0] for r in reversed(rows)], fontsize=7)
    plotting.title(ax, f"{title}: {timeline.iteration_time * scale:.1f} ms")


def render(panels: list[tuple[str, Timeline]], path: Path) -> None:
    from matplotlib.patches import Patch

    # A shared time axis makes the idle cycles of the slower schedule visible as length.
    fig, axes = plotting.new_figure(10.0, 1.6 + 0.45 * sum(len(t.ranks) for _, t in panels), rows=len(panels), sharex=True)
    for ax, (title, timeline) in zip(axes, panels):
        draw(ax, timeline, title)
    axes[-1].set_xlim(0, max(t.iteration_time for _, t in panels) * 1e3)
    axes[-1].set_xlabel("time (ms)")
    legend = [
        Patch(color=PHASE_COLOURS[p], label=label)
        for p, label in (("fwd", "forward"), ("bwd", "backward"), ("interaction", "batch-sync (S)"), ("optimizer", "optimizer"))
    ]
    plotting.legend_outside(fig, legend, above=True)
    plotting.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ran = sweep_from_command_line(argv, __doc__.splitlines()[0])
    if ran is None:
        return 2
    spec, out = ran
    panels = [
        (f"{job.group}, {job.series}", load_trace(out / job.subdir / TRACE_FILE))
        for job in figure_jobs(spec)
        if not job.repeat and (out / job.subdir / TRACE_FILE).exists()
    ]
    path = out / f"{spec.name}_gantt.png"
    render(panels, path)
    print(f"wrote {out / 'results.md'}, {out / (spec.name + '.png')} and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
