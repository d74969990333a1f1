"""A ZeRO-3 run prints no torch FutureWarnings: DeepSpeed's all-gathers and reduce-scatters
run on torch's current collectives (runtime.engines.start_deepspeed_comm)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.runtime.support import CLIP, TWO_WORKERS, build_deepspeed_ops


@pytest.mark.slow  # starts worker processes
def test_a_zero3_run_prints_no_future_warnings(tmp_path):
    build_deepspeed_ops()
    result = run_cli(
        *TWO_WORKERS,
        *CLIP,
        "strategy=ddp",
        "strategy.zero_stage=3",
        "strategy.param_persistence_threshold=0",
        "train.steps=2",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Warning" not in result.stderr, result.stderr[-2000:]
