"""The cluster presets a figure's jobs run on, as its fingerprint holds them (src.sweep.preset_hash):
each preset's values and the measured tables it names, their sources and comments aside, so that
results priced on a preset whose constants have changed since read as another version.

A job runs on the last `cluster=NAME` among its overrides (conf/config.yaml's default cluster
without one), with the measured tables the preset names unless an override names others
(`cluster.collective_measurements=[...]` and the like). A host profile that `local` resolves at run
time by the machine's CPU is not a file the job names, and is left out."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from src.attention_measurements import ATTENTION_DIR
from src.cluster import MEASURED_DIR
from src.gemm_measurements import GEMM_DIR
from src.measured_files import read_yaml

CLUSTERS = MEASURED_DIR.parent
# Each list of measured tables a preset names, and the folder under conf/cluster/ its tables are in
# (where src.cluster, src.gemm_measurements and src.attention_measurements read them).
TABLE_FOLDERS = {
    key: folder.relative_to(CLUSTERS).as_posix()
    for key, folder in (
        ("collective_measurements", MEASURED_DIR),
        ("gemm_measurements", GEMM_DIR),
        ("attention_measurements", ATTENTION_DIR),
    )
}
DESCRIPTIVE_KEYS = ("sources", "source")


@functools.cache
def default_cluster() -> str:
    defaults = read_yaml(CLUSTERS.parent / "config.yaml")["defaults"]
    return next(entry["cluster"] for entry in defaults if isinstance(entry, dict) and "cluster" in entry)


@functools.cache
def _values(path: Path) -> Any:
    """A YAML file's values without its descriptive text (None where there is no such file: the
    run itself names what is missing)."""
    if not path.is_file():
        return None
    data = read_yaml(path)
    return {k: v for k, v in data.items() if k not in DESCRIPTIVE_KEYS} if isinstance(data, dict) else data


def _listed(value: str) -> list[str]:
    return [name.strip() for name in value.strip().strip("[]").split(",") if name.strip()]


def job_inputs(overrides: Sequence[str]) -> dict[str, Any]:
    """The preset one job runs on and the measured tables it prices with, by their paths under
    conf/cluster/."""
    settings = dict(o.split("=", 1) for o in overrides if "=" in o)
    name = settings.get("cluster") or default_cluster()
    preset = _values(CLUSTERS / f"{name}.yaml")
    inputs: dict[str, Any] = {f"{name}.yaml": preset}
    for key, folder in TABLE_FOLDERS.items():
        given = settings.get(f"cluster.{key}")
        tables = _listed(given) if given is not None else (preset or {}).get(key) or []
        for table in tables:
            inputs[f"{folder}/{table}.yaml"] = _values(CLUSTERS / folder / f"{table}.yaml")
    return inputs


def cluster_inputs(jobs: Iterable[Sequence[str]]) -> dict[str, Any]:
    """Every preset and measured table the jobs (each its overrides) run on."""
    inputs: dict[str, Any] = {}
    for overrides in jobs:
        inputs.update(job_inputs(overrides))
    return inputs


def fingerprint(content: Any) -> str:
    """A short digest of what stored results depend on (JSON values, keys in order)."""
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def presets_fingerprint(jobs: Iterable[Sequence[str]]) -> str:
    """A fingerprint of every preset and measured table the jobs run on: stored results priced
    on presets whose constants have changed since carry another."""
    return fingerprint(cluster_inputs(jobs))


# The line a stored result of the simulator ends with (src.cluster_inputs.priced_on): the preset files
# it was priced on, by their paths under conf/cluster/, and their fingerprint then.
PRICED_ON = re.compile(r"^Priced on conf/cluster/ (?P<files>\S.*) \(presets fingerprint (?P<digest>[0-9a-f]{16})\)\.$", re.M)


def priced_on(jobs: Iterable[Sequence[str]]) -> str:
    """The line a stored result ends with, naming the presets and measured tables its jobs ran on
    and their fingerprint, so that a later change of their constants shows it stale
    (tests/test_stored_results.py)."""
    inputs = cluster_inputs(jobs)
    return f"Priced on conf/cluster/ {', '.join(inputs)} (presets fingerprint {fingerprint(inputs)})."


def stale_stamp(text: str) -> str | None:
    """Why a stored result's `priced_on` line is not of today's presets, or None where it is."""
    stamps = PRICED_ON.findall(text)
    if len(stamps) != 1:
        return f"{len(stamps)} lines 'Priced on conf/cluster/ ...' where one is expected"
    files, digest = stamps[0]
    today = fingerprint({name: _values(CLUSTERS / name) for name in files.split(", ")})
    if today != digest:
        return f"priced on {files} at fingerprint {digest}; today's is {today}"
    return None
