"""Shared fixtures: the repository's paths and a runner for the front door
(`python -m src.run ...`) in a subprocess, as a user would invoke it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"

CliRunner = Callable[..., subprocess.CompletedProcess]


def cli_env() -> dict[str, str]:
    """The caller's environment with W&B kept offline and quiet, and without variables
    that change how Hydra reports errors (HYDRA_FULL_ERROR turns a one-line message into
    a stack trace)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    return env


def run_cli(*overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m src.run <overrides>` from the repository root; stdout/stderr captured."""
    return subprocess.run(
        [sys.executable, "-m", "src.run", *overrides], cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def conf_dir() -> Path:
    return CONF_DIR


@pytest.fixture(scope="session")
def cli() -> CliRunner:
    """Callable fixture: cli("model=clip", "hydra.run.dir=...") -> CompletedProcess."""
    return run_cli
