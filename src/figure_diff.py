"""Two runs of the paper figures side by side: what a change to the cost model moved.

    python -m src.figure_diff BEFORE AFTER [--out diff.md]

BEFORE and AFTER are directories holding, per figure, either the sweep directory its
multirun wrote (NAME/results.json, e.g. `python -m src.run -m +experiment=NAME
hydra.sweep.dir=BEFORE/NAME`) or its stored result (NAME.json, as
benchmarks/results/figures keeps them: a copy of that directory from before a change, beside
the one `python -m src.reproduce --rerun` rewrites). Prints, per figure, each (group, series)
value before and after, the change, and the paper's value; with --changed only the rows
that moved (by 0.05 % or more, or from or to no value), the figures none of whose rows did
named in one line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from src.out_paths import output_file, write_file


def _rows(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    results = json.loads(path.read_text())
    return {(r["group"], r["series"]): r for r in results["rows"]}


def _value(row: dict[str, Any] | None) -> str:
    if row is None:
        return "–"
    if row.get("value") is None:
        return "failed" if row.get("error") else "–"
    return f"{row['value']:.3g}"


def figure_table(name: str, before: Path, after: Path, changed: bool = False) -> str | None:
    """The figure's rows before and after; with `changed`, only those that moved (None if
    none did)."""
    old, new = _rows(before), _rows(after)
    metric = json.loads(after.read_text())["metric"]
    lines = [f"## {name} ({metric})", "", "| group | series | before | after | change | paper |", "|---|---|---|---|---|---|"]
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key), new.get(key)
        change = "–"
        if a and b and a.get("value") and b.get("value") is not None:
            change = f"{100 * (b['value'] / a['value'] - 1):+.1f}%"
        if changed and _value(a) == _value(b) and change in ("+0.0%", "-0.0%", "–"):
            continue
        paper = (b or a or {}).get("paper")
        paper_text = "–" if paper is None else "–".join(f"{p:g}" for p in paper) if isinstance(paper, list) else f"{paper:g}"
        lines.append(f"| {key[0]} | {key[1]} | {_value(a)} | {_value(b)} | {change} | {paper_text} |")
    return None if changed and len(lines) == 4 else "\n".join(lines)


def figure_results(directory: Path) -> dict[str, Path]:
    """Each figure's results file in `directory`, by name: a multirun's NAME/results.json, or
    a stored NAME.json (one with a figure's rows: other files are left out) where there is no
    such directory."""
    found = {p.stem: p for p in directory.glob("*.json") if _is_figure(p)}
    found.update({p.parent.name: p for p in directory.glob("*/results.json")})
    return dict(sorted(found.items()))


def _is_figure(path: Path) -> bool:
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(results, dict) and "rows" in results and "metric" in results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=output_file, default=None)
    parser.add_argument("--changed", action="store_true", help="only the rows that moved")
    args = parser.parse_args()
    after = figure_results(args.after)
    if not after:
        parser.error(f"{args.after} holds no <figure>/results.json and no <figure>.json")
    before = figure_results(args.before)
    missing = [n for n in after if n not in before]
    tables = {n: figure_table(n, before[n], path, args.changed) for n, path in after.items() if n not in missing}
    text = "\n\n".join(table for table in tables.values() if table is not None)
    unchanged = [n for n, table in tables.items() if table is None]
    if unchanged:
        text += ("\n\n" if text else "") + "Unchanged: " + ", ".join(unchanged)
    if missing:
        text += "\n\nOnly after: " + ", ".join(missing)
    if args.out:
        write_file(args.out, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
