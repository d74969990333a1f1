"""Finding and reading a measured table a preset names (conf/cluster/measured/...)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from src.errors import ConfigError


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
