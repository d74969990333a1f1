"""Finding and reading a measured table a preset names (conf/cluster/measured/...)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from src.errors import ConfigError, reject_unknown


def measured_file(directory: Path, shown: str, name: str, what: str, cluster: str) -> Path:
    """<directory>/<name>.yaml, or a one-line refusal naming the tables there are (the
    directory shown to the user as `shown`)."""
    path = directory / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ConfigError(f"cluster {cluster} names {what} {name!r}: no {shown}/{name}.yaml (known: {known})")
    return path


def read_yaml(path: Path) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(), Loader=loader)


def read_table(path: Path, where: str, keys: list[str], stated: tuple[str, ...]) -> Mapping[str, Any]:
    """A measured table's mapping: only `keys`, each of `stated` a non-empty text."""
    data = read_yaml(path)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must map {', '.join(k for k in keys if k != 'name')}")
    reject_unknown(data, keys, f"key(s) of {where}")
    for key in stated:
        if not str(data.get(key) or "").strip():
            raise ConfigError(f"{where} must say its {key}")
    return data


def table_precisions(data: Mapping[str, Any], where: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A measured table's `precisions`: a non-empty list of `allowed` ones, which `what` (its
    values) hold for."""
    precisions = data.get("precisions")
    if not isinstance(precisions, list) or not precisions or not all(p in allowed for p in precisions):
        raise ConfigError(f"{where}: precisions lists the {what} hold for ({', '.join(allowed)}), got {precisions!r}")
    return tuple(str(p) for p in precisions)
