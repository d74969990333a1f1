"""Measured profiles of a cluster preset's host (`python -m src.calibrate` writes them).

A profile holds the figures of one CPU model; the `local` preset takes them on a host of
that model and keeps its own elsewhere, saying so, since a profile measured on another
CPU would price this one's workers wrongly.
"""

from __future__ import annotations

import copy
import functools
import os
import platform
import re
from pathlib import Path
from typing import Any, Callable

import yaml

PRESET_DIR = Path(__file__).resolve().parent.parent / "conf" / "cluster"
PROFILE_DIR = PRESET_DIR / "profiles"


@functools.cache  # a host's CPU model does not change while a process runs
def host_cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_identity() -> dict[str, Any]:
    """What names this host's profile and a measurement made on it: its CPU model and cores."""
    return {"cpu_model": host_cpu_model(), "cores": os.cpu_count()}


def profile_path(preset: str = "local", cpu_model: str | None = None) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", (cpu_model or host_cpu_model()).lower()).strip("-")
    return PROFILE_DIR / f"{preset}-{slug}.yaml"


def host_profile(preset: str, cpu_model: str | None = None) -> dict[str, Any] | None:
    """The preset figures measured on a CPU model (this host's by default), if a profile has them."""
    path = profile_path(preset, cpu_model)
    return _this_version(_preset_figures, path) if path.exists() else None


def profiled_cpu_models(preset: str) -> list[str]:
    """The CPU models a profile of `preset` was measured on, as their profiles name them."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    paths = PROFILE_DIR.glob(f"{preset}-*.yaml")
    return sorted(str((yaml.load(path.read_text(), Loader=loader).get("host") or {}).get("cpu_model", path.stem)) for path in paths)


def _this_version(read: Callable[[Path, int, int], Any], path: Path) -> Any:
    """A copy of what `read` (cached by path, time and size) gives for the file as it is
    now: a file rewritten since is read again."""
    stat = path.stat()
    return copy.deepcopy(read(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _preset_figures(path: Path, mtime_ns: int, size: int) -> dict[str, Any]:
    """A profile's preset figures, read once per version of the file (its time and size: a
    profile calibrate rewrites is read again): every run on cluster=local validates its
    cluster, and the profile's measurements make it a 20 KB YAML (30 ms in pure-Python YAML)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(), Loader=loader)["preset"]


def preset_file(name: str) -> dict[str, Any] | None:
    """A preset's own figures, as its file states them and Hydra reads them (OmegaConf's
    YAML: `37.5e9` a number, not a string); None where there is no such file."""
    path = PRESET_DIR / f"{name}.yaml"
    return _this_version(_preset_file_figures, path) if path.exists() else None


@functools.lru_cache(maxsize=32)
def _preset_file_figures(path: Path, mtime_ns: int, size: int) -> dict[str, Any] | None:
    """A preset file's figures, read once per version of the file: every run's validation
    reads its cluster's (35 ms in OmegaConf's YAML)."""
    from omegaconf import OmegaConf

    figures = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return {str(k): v for k, v in figures.items()} if isinstance(figures, dict) else None
