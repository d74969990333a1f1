"""Shared fixtures: the repository's paths and a runner for the front door
(`python -m src.run ...`) in a subprocess, as a user would invoke it; and the guard that
keeps `-m "not slow"` a quick tier: a test not marked slow that starts a process fails."""

from __future__ import annotations

import _posixsubprocess
import importlib.util
import os
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable

import pytest

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
# The keys every run's summary.json holds, simulated or real (docs/running.md).
SUMMARY_KEYS = (
    "model",
    "strategy",
    "cluster",
    "backend",
    "devices",
    "iteration_time_s",
    "mfu",
    "throughput_samples_per_s",
    "tflops_per_device",
    "breakdown_s",
    "peak_memory_gib",
    "plan",
)
CONF_DIR = REPO_ROOT / "conf"
HAS_TORCH = importlib.util.find_spec("torch") is not None
# Test modules that import torch (or the real backend, which does) at their top: marked
# torch, and not even collected where it is not installed. Others mark their own tests.
TORCH_MODULES = (
    "runtime/*",
    "data/test_data.py",
    "data/test_bad_shards.py",
    "data/test_interleaved_mllm.py",
    "models/test_mllm_tiny.py",
    "strategies/builders/test_routes.py",
    "test_launchers.py",
)
collect_ignore_glob = [] if HAS_TORCH else list(TORCH_MODULES)


def imports_torch(path: Path) -> bool:
    """Whether the test module at `path` is one of TORCH_MODULES."""
    return any(fnmatch(path.relative_to(TESTS).as_posix(), pattern) for pattern in TORCH_MODULES)


# The planners plan serially in tests (Optimus forks its encoder scheduling otherwise): a
# quick test starts no process; tests/strategies/optimus/test_optimus.py checks the parallel path.
os.environ["MMDIST_PLAN_WORKERS"] = "1"

CliRunner = Callable[..., subprocess.CompletedProcess]
PROCESS_STARTS = ((subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"), (os, "posix_spawn"), (os, "posix_spawnp"))


def cli_env() -> dict[str, str]:
    """The caller's environment with W&B kept offline and quiet, and without variables
    that change how Hydra reports errors (HYDRA_FULL_ERROR turns a one-line message into
    a stack trace)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    return env


def run_cli(*overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m src.run <overrides>` from the repository root; stdout/stderr captured (`timeout`:
    a guard against a hang, not a check of speed: a loaded machine takes its time)."""
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


class ProcessGuard:
    """Keeps `-m "not slow"` a quick tier: while a test not marked slow runs (its fixtures,
    module-scoped ones too, its call and its teardown), starting a process (subprocess,
    multiprocessing, a joblib pool: each forks, spawns or executes through one of
    PROCESS_STARTS) is refused, and the test fails even where the code under test caught
    the refusal."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.started: dict[str, str] = {}  # test id -> the first process it started

    def install(self) -> None:
        for module, name in PROCESS_STARTS:
            setattr(module, name, self._guarded(getattr(module, name)))

    def _guarded(self, start: Callable) -> Callable:
        def guarded(*args, **kwargs):
            item = self.item
            if item is not None and item.get_closest_marker("slow") is None:
                self.started.setdefault(item.nodeid, repr(args[0])[:80] if args else start.__name__)
                raise RuntimeError(f"{item.nodeid} starts a process: mark it @pytest.mark.slow")
            return start(*args, **kwargs)

        return guarded


GUARD = ProcessGuard()


def pytest_configure(config: pytest.Config) -> None:
    # Matplotlib's first import on a fresh machine asks fc-list for the fonts (a process)
    # and caches them: done here, before the guard, not inside whichever test plots first.
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.font_manager  # noqa: F401
    # The tests' tensors are tiny: on a busy 2-core machine a second intra-op thread only
    # waits for a core at each op (a reference's few steps take seconds instead of a tenth
    # of one). One thread, as each CPU worker computes (backend.threads_per_worker).
    if HAS_TORCH:
        import torch

        torch.set_num_threads(1)
    GUARD.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    GUARD.item = item
    yield
    GUARD.item = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    started = GUARD.started.get(item.nodeid)
    if started and report.passed and call.when in ("setup", "call"):
        report.outcome = "failed"
        report.longrepr = f"starts a process ({started}) but is not marked slow"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if imports_torch(item.path):
            item.add_marker(pytest.mark.torch)
        if not HAS_TORCH and item.get_closest_marker("torch") is not None:
            item.add_marker(pytest.mark.skip(reason="needs torch: pip install -e '.[runtime]'"))
