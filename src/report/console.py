"""Terminal rendering of a run: the final summary table and one line per training step.

Plain text and no dependencies, so the same text reads well in a terminal, a Slurm log
and a Hydra job log. Missing keys are skipped rather than failing: a summary from an
older run or another backend still prints.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from src.timeline import BREAKDOWN_CATEGORIES

# Plan columns shown for every unit, in this order: (key in plan["units"][u], header).
_PLAN_COLUMNS = (
    ("dp", "dp"),
    ("tp", "tp"),
    ("pp", "pp"),
    ("vpp", "vpp"),
    ("micro_batch", "micro-batch"),
    ("num_microbatches", "#micro-batches"),
    ("batch_per_replica", "batch/replica"),
    ("devices", "devices"),
    ("ranks", "ranks"),
)
_SCALARS = (int, float, str, bool)
_RANKING_ROWS = 10


def format_summary(summary: Mapping[str, Any]) -> str:
    """The end-of-run table: who ran, the plan per unit, the figures, the breakdown."""
    sections = [
        _header(summary),
        _auto(summary.get("plan")),
        _plan(summary.get("plan")),
        _ranking(summary.get("plan")),
        _figures(summary),
        _breakdown(summary),
    ]
    return "\n\n".join(s for s in sections if s)


def format_step(record: Mapping[str, Any]) -> str:
    """One line per step, e.g. 'step 3 | loss 1.2345 | 0.412 s'; other keys follow. The
    simulator's one priced iteration reads 'simulated iteration | 2.038 s | MFU 9.34 %':
    nothing was trained."""
    parts = []
    rest = dict(record)
    if "iteration_time_s" in rest:
        rest.pop("step", None)
        parts.append("simulated iteration")
    elif "step" in rest:
        parts.append(f"step {rest.pop('step')}")
    if "loss" in rest:
        parts.append(f"loss {_num(rest.pop('loss'), '.4f')}")
    # The real backend times a step; the simulator prices one iteration.
    for key in ("step_time_s", "iteration_time_s"):
        if key in rest:
            parts.append(f"{_num(rest.pop(key), '.3f')} s")
    if "mfu" in rest:
        parts.append(f"MFU {_pct(rest.pop('mfu'))}")
    # Nested records (a step's breakdown) are for the files and W&B, not the terminal.
    parts += [f"{key} {_num(value, '.4g')}" for key, value in rest.items() if not isinstance(value, Mapping)]
    return " | ".join(parts)


def _header(summary: Mapping[str, Any]) -> str:
    rows = [
        [label, str(summary[key])]
        for key, label in (
            ("model", "model"),
            ("strategy", "strategy"),
            ("cluster", "cluster"),
            ("backend", "backend"),
            ("devices", "devices"),
            ("global_batch", "global batch"),
            ("precision", "precision"),
        )
        if summary.get(key) is not None
    ]
    return _table(rows, right=False)


def _plan(plan: Any) -> str:
    units = plan.get("units") if isinstance(plan, Mapping) else None
    if not units:
        return ""
    # Keys a strategy adds (a 3D grid, say) become extra columns when they are scalars;
    # lists such as stage_layers are too long for a terminal and stay in summary.json.
    columns = [c for c in _PLAN_COLUMNS if any(c[0] in u for u in units.values())]
    known = {key for key, _ in _PLAN_COLUMNS}
    for unit in units.values():
        for key, value in unit.items():
            if key not in known and isinstance(value, _SCALARS):
                known.add(key)
                columns.append((key, key))
    rows = [["unit"] + [header for _, header in columns]]
    for name, unit in units.items():
        rows.append([name] + [_cell(unit.get(key)) for key, _ in columns])
    title = "plan"
    if plan.get("strategy") is not None and plan.get("devices") is not None:
        title += f" ({plan['strategy']} on {plan['devices']} devices)"
    return title + "\n" + _table(rows, header=True) + _brokers(plan.get("brokers"))


def _brokers(brokers: Any) -> str:
    """Where units of different DP meet (DistTrain's brokers): one line per hand-off."""
    if not isinstance(brokers, Sequence) or not brokers:
        return ""
    lines = [
        f"  {b['route']}: {b['count']} broker(s) at ranks {b['ranks']}"
        for b in brokers
        if isinstance(b, Mapping) and {"route", "count", "ranks"} <= set(b)
    ]
    return "\nbrokers\n" + "\n".join(lines) if lines else ""


def _auto(plan: Any) -> str:
    """strategy=auto's choice: the winner, the runner-up and the margin, what was refused."""
    auto = plan.get("auto") if isinstance(plan, Mapping) else None
    if not isinstance(auto, Mapping):
        return ""
    line = f"auto: {auto['winner']} wins ({auto['winner_iteration_time_s']:.4g} s)"
    if "runner_up" in auto:
        line += f"; runner-up {auto['runner_up']} ({auto['runner_up_iteration_time_s']:.4g} s, +{auto['margin_pct']:.1f} %)"
    refused = auto.get("refused") or {}
    return line + "".join(f"\n  not run: {label}: {reason}" for label, reason in refused.items())


def _ranking(plan: Any) -> str:
    """A planner's search, best-ranked first (its `search.ranking` rows), when it made one."""
    search = plan.get("search") if isinstance(plan, Mapping) else None
    if not isinstance(search, Mapping):
        return ""
    rows = search.get("ranking")
    if not rows or not all(isinstance(r, Mapping) for r in rows):
        return ""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    table = [columns] + [[_ranked(row.get(key)) for key in columns] for row in rows[:_RANKING_ROWS]]
    facts = ", ".join(f"{key} {value}" for key, value in search.items() if key != "ranking" and isinstance(value, _SCALARS))
    return f"search ({facts})\n" + _table(table, header=True)


def _ranked(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _figures(summary: Mapping[str, Any]) -> str:
    lines = []

    def add(key: str, label: str, render) -> None:
        if isinstance(summary.get(key), (int, float)):
            lines.append([label, render(summary[key])])

    add("iteration_time_s", "iteration time", lambda v: f"{v:.4f} s")
    add("mfu", "MFU", _pct)
    add("hfu", "HFU", _pct)
    add("throughput_samples_per_s", "throughput", lambda v: f"{v:,.1f} samples/s")
    add("tflops_per_device", "TFLOP/s per device", lambda v: f"{v:.1f}")
    add("model_flops_per_iteration", "model FLOPs / iteration", lambda v: f"{v:.3e}")
    add("peak_memory_gib", "peak memory", lambda v: f"{v:.2f} GiB" + _memory_parts(summary))
    return _table(lines, right=False)


def _memory_parts(summary: Mapping[str, Any]) -> str:
    parts = summary.get("memory_gib")
    if not isinstance(parts, Mapping):
        return ""
    shown = [f"{k} {v:.2f}" for k, v in parts.items() if isinstance(v, (int, float))]
    return f" ({', '.join(shown)})" if shown else ""


def _breakdown(summary: Mapping[str, Any]) -> str:
    mean = summary.get("breakdown_s")
    if not isinstance(mean, Mapping) or not mean:
        return ""
    by_unit = summary.get("breakdown_by_unit_s")
    by_unit = by_unit if isinstance(by_unit, Mapping) else {}
    iteration = summary.get("iteration_time_s") or 0.0
    # Reports show categories in the canonical order even when the summary was read
    # back from summary.json (whose keys are sorted); unknown ones follow.
    seen = set(mean).union(*(set(u) for u in by_unit.values()))
    categories = [c for c in BREAKDOWN_CATEGORIES if c in seen]
    categories += sorted(seen.difference(BREAKDOWN_CATEGORIES))
    rows = [["breakdown", "seconds", "% of iter"] + list(by_unit)]
    for cat in categories:
        values = [mean.get(cat, 0.0)] + [u.get(cat, 0.0) for u in by_unit.values()]
        if all(abs(v) < 1e-12 for v in values):
            continue  # a category that no rank spends time in is noise in a terminal
        rows.append([cat, f"{values[0]:.4f}", _share(values[0], iteration)] + [f"{v:.4f}" for v in values[1:]])
    # The total row makes the rule "the breakdown adds up" visible at a glance.
    totals = [sum(mean.values())] + [sum(u.values()) for u in by_unit.values()]
    rows.append(["total", f"{totals[0]:.4f}", _share(totals[0], iteration)] + [f"{v:.4f}" for v in totals[1:]])
    return _table(rows, header=True)


def _table(rows: Sequence[Sequence[str]], header: bool = False, right: bool = True) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest
    right-aligned when they hold numbers (right). With header, a rule goes under the
    first row."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) if right else c.ljust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    if header:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, float) else str(value)


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.2f} %"


def _share(seconds: float, iteration: float) -> str:
    return f"{100 * seconds / iteration:.1f}" if iteration else ""
