"""A figure's results as the scorecard reads them: its results.json, refused when another
version of its preset wrote it (the fingerprint src.sweep stores differs). `stale` says why a
figure has no current results (none stored, or another version's), which the scorecard reports
as rows not run until the figures are re-run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from src.errors import ConfigError
from src.sweep import REPO, SweepSpec, lookup, preset_hash

# The committed results of every figure the catalogue names (`python -m src.reproduce --rerun` writes them).
STORE = REPO / "benchmarks" / "results" / "figures"


def results_path(directory: Path, name: str) -> Path:
    """<name>.json in the store's layout, or <name>/results.json in a directory of sweep
    directories (e.g. outputs/figures after `python -m src.run -m +experiment=<name>`)."""
    flat = directory / f"{name}.json"
    return flat if flat.is_file() or not (directory / name / "results.json").is_file() else directory / name / "results.json"


@dataclass
class FigureResults:
    name: str
    path: Path
    rows: dict[tuple[str, str], dict[str, Any]]
    labels: dict[str, str]

    def value(self, group: str, series: str, field: str) -> float | None:
        """A row's number (dotted: a degree of its plan, `plan.llm.pp`); None where the row's
        job did not run."""
        value = self.field(group, series, field)
        return None if value is None else float(value)

    def field(self, group: str, series: str, field: str) -> Any:
        """A row's field as stored (a number, or a setting's name: `plan.units.vision.recompute`);
        None where the row's job did not run."""
        row = self.rows[(group, series)]
        if row.get("value") is None:
            return None
        try:
            return row[field] if field in row else lookup(row, field)
        except (KeyError, TypeError):
            raise ConfigError(f"figure {self.name}: the row of {series} at {group!r} has no {field}") from None

    def largest(self, group: str, series: str, field: str) -> float | None:
        """The largest of a running time's repeated runs (the row's value is their least);
        None where the field was measured once."""
        spread = self.rows[(group, series)].get("timed_spread", {}).get(field)
        return None if spread is None else float(spread[1])

    def error(self, group: str, series: str) -> str:
        return str(self.rows[(group, series)].get("error", "its baseline did not run"))

    def label(self, series: str) -> str:
        return self.labels.get(series, series)


def stale(spec: SweepSpec, directory: Path) -> str:
    """Why a directory holds no current results of a figure ('' when it does): none stored,
    or results another version of the preset wrote."""
    path = results_path(directory, spec.name)
    if not path.is_file():
        return "no results"
    try:
        written = json.loads(path.read_text()).get("preset_hash")
    except (json.JSONDecodeError, AttributeError):
        return ""  # load_results names what is wrong with it
    return "" if written == preset_hash(spec) else "results of another version of the preset"


def load_results(spec: SweepSpec, directory: Path) -> FigureResults:
    path = results_path(directory, spec.name)
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    if not path.is_file():
        raise ConfigError(f"no results of figure {spec.name} at {shown}: run `python -m src.reproduce --rerun`")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{shown} is not JSON ({err.msg} at line {err.lineno})") from err
    wanted = preset_hash(spec)
    if raw.get("preset_hash") != wanted:
        raise ConfigError(
            f"{shown} was written by another version of preset {spec.name} (fingerprint {raw.get('preset_hash')}, "
            f"sweeps/{spec.name}.yaml and the cluster presets it runs on now give {wanted}): "
            "run `python -m src.reproduce --rerun-stale`"
        )
    rows = {(r["group"], r["series"]): r for r in raw["rows"]}
    return FigureResults(spec.name, path, rows, raw.get("labels", {}))
