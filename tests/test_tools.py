"""Tools refuse what they cannot do in one line: a GPU benchmark on a machine without one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, cli_env


@pytest.mark.slow  # a subprocess that imports torch
def test_the_gpu_benchmark_refuses_a_machine_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_runtime_gpu.py"], cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: benchmarks/bench_runtime_gpu.py needs a CUDA GPU, and torch sees none on this machine"
