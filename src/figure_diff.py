"""Two runs of the paper figures side by side: what a change to the cost model moved.

    python -m src.figure_diff BEFORE AFTER [--out diff.md]

BEFORE and AFTER are directories holding one sweep directory per figure (each with the
results.json the figure's multirun wrote, e.g. `python -m src.run -m +experiment=NAME
hydra.sweep.dir=BEFORE/NAME`). Prints, per figure, each (group, series) value before and
after, the change, and the paper's value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _rows(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    results = json.loads(path.read_text())
    return {(r["group"], r["series"]): r for r in results["rows"]}


def _value(row: dict[str, Any] | None) -> str:
    if row is None:
        return "–"
    if row.get("value") is None:
        return "failed" if row.get("error") else "–"
    return f"{row['value']:.3g}"


def figure_table(name: str, before: Path, after: Path) -> str:
    old, new = _rows(before), _rows(after)
    metric = json.loads(after.read_text())["metric"]
    lines = [f"## {name} ({metric})", "", "| group | series | before | after | change | paper |", "|---|---|---|---|---|---|"]
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key), new.get(key)
        change = "–"
        if a and b and a.get("value") and b.get("value") is not None:
            change = f"{100 * (b['value'] / a['value'] - 1):+.1f}%"
        paper = (b or a or {}).get("paper")
        paper_text = "–" if paper is None else "–".join(f"{p:g}" for p in paper) if isinstance(paper, list) else f"{paper:g}"
        lines.append(f"| {key[0]} | {key[1]} | {_value(a)} | {_value(b)} | {change} | {paper_text} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    names = sorted(p.parent.name for p in args.after.glob("*/results.json"))
    missing = [n for n in names if not (args.before / n / "results.json").exists()]
    if not names:
        parser.error(f"{args.after} holds no <figure>/results.json")
    text = "\n\n".join(
        figure_table(n, args.before / n / "results.json", args.after / n / "results.json") for n in names if n not in missing
    )
    if missing:
        text += "\n\nOnly after: " + ", ".join(missing)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
