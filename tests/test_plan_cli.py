"""`python -m src.run plan=RUN_DIR`: a written plan runs again as written (the simulator's
summary is byte for byte the first run's), and what would change it is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.test_cli import assert_one_line_error

pytestmark = pytest.mark.slow  # front-door subprocesses

PLANNED = ["model=clip", "model.scale=tiny", "cluster=local", "strategy=megatron", "strategy.tp=2", "logger=none"]


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("first")
    result = run_cli(*PLANNED, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    return run_dir


def test_a_written_plan_runs_again_into_the_same_summary(first, tmp_path):
    result = run_cli("logger=none", f"plan={first}", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "summary.json").read_text() == (first / "summary.json").read_text()
    assert (tmp_path / "plan.json").read_text() == (first / "plan.json").read_text()
    resolved = (tmp_path / "resolved.yaml").read_text()  # the plan's groups, this run's backend
    assert "tp: 2" in resolved and "scale: tiny" in resolved and f"plan: {first}" in resolved


def test_what_would_change_the_plan_is_refused_in_one_line(first, tmp_path):
    result = run_cli("logger=none", f"plan={first}", "model=gpt", "strategy.tp=4", f"hydra.run.dir={tmp_path}")
    assert_one_line_error(result, tmp_path, r"runs the written plan's model, strategy, cluster and train", r"'model=gpt'")


def test_a_truncated_plan_is_refused_in_one_line(first, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text((first / "plan.json").read_text()[:500])
    result = run_cli("logger=none", f"plan={plan}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(result, tmp_path / "run", r"is not a whole plan file \(truncated or not JSON")
