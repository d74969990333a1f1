"""strategy=auto and src.compare: every contender priced on one model and cluster, the
fastest chosen, the refusals named."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src import progress
from src.compare import ScalingReport, compare, table, write
from src.config import plain_config
from src.errors import ConfigError
from src.setup import plan_run, validate

CONF = Path(__file__).resolve().parent.parent / "conf"
ROOT = CONF.parent
STORED = ROOT / "benchmarks" / "results" / "comparison"
SMALL_GPT = [
    "model=gpt",
    "model.preset=null",
    "model.layers=8",
    "model.hidden=1024",
    "model.heads=16",
    "model.vocab=32000",
    "cluster=perlmutter",
    "cluster.nodes=2",
    "train.global_batch=64",
]


def composed(name: str, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return plain_config(compose(config_name=name, overrides=list(overrides)))


def test_auto_runs_the_fastest_contender_and_names_the_runner_up() -> None:
    plan = plan_run(validate(composed("config", *SMALL_GPT, "strategy=auto", "logger=none")))
    auto = plan.details["auto"]
    ranking = auto["ranking"]
    times = [r["iteration_time_s"] for r in ranking]
    assert times == sorted(times) and len(ranking) >= 3  # megatron, zero3, deepspeed3d, par4d apply to a GPT
    assert auto["winner"] == ranking[0]["strategy"] and auto["runner_up"] == ranking[1]["strategy"]
    assert auto["margin_pct"] == pytest.approx(100 * (times[1] / times[0] - 1))
    assert {"distmm", "disttrain", "optimus"} <= set(auto["refused"])  # no towers, no MLLM
    assert "contrastive" in auto["refused"]["distmm"]


def test_auto_rejects_unknown_contenders() -> None:
    with pytest.raises(ConfigError, match="strategy.contenders"):
        plan_run(validate(composed("config", *SMALL_GPT, "strategy=auto", "strategy.contenders=[megatorn]", "logger=none")))


@pytest.mark.slow
def test_compare_ranks_priced_contenders_then_lists_refusals(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(progress, "AT_ONCE_FIRST_S", 0.0)  # past its checks it speaks by wall time
    config = composed("compare", *SMALL_GPT, "strategy.contenders=[megatron,par4d,distmm]")
    outcomes = compare(config)
    assert re.search(r"^comparing 3 strategies for gpt on perlmutter \[\d+ s\]: [0-3] of 3 done$", capsys.readouterr().err, re.M)
    assert [o["strategy"] for o in outcomes][-1] == "distmm" and "reason" in outcomes[-1]
    priced = [o["summary"]["iteration_time_s"] for o in outcomes if "summary" in o]
    assert len(priced) == 2 and priced == sorted(priced)
    text = table(outcomes, "t")
    assert "| 1 |" in text and "| 2 |" in text and "- distmm: " in text
    assert all(f"| {o['strategy']} | {o['summary']['devices']} |" in text for o in outcomes if "summary" in o)


def _compare(*args: str) -> subprocess.CompletedProcess:
    """`python -m src.compare ARGS` from the repository root, its output captured."""
    return subprocess.run([sys.executable, "-m", "src.compare", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.slow
def test_compare_refuses_a_single_strategy_in_one_line(tmp_path: Path) -> None:
    done = _compare("strategy=megatron", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: src.compare prices every strategy; strategy=megatron picks one (choose some with strategy.contenders=[...])"
    ]


@pytest.mark.slow
def test_compare_names_a_comparison_it_has_not_in_one_line(tmp_path: Path) -> None:
    done = _compare("-m", "+comparison=nope", f"hydra.sweep.dir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: In 'compare': Could not find 'comparison/nope'; choose one of clip_v100_a100, gpt20b_perlmutter, mllm15b_a800_h100"
    ]


def test_scaling_report_charts_each_strategy_over_device_counts(tmp_path: Path) -> None:
    for job, devices in enumerate((8, 16)):
        outcomes = [
            {"strategy": "megatron", "summary": {"throughput_samples_per_s": devices * 1.0}},
            {"strategy": "distmm", "reason": "no towers"},
        ]
        (tmp_path / str(job)).mkdir()
        result = {
            "title": f"gpt on perlmutter ({devices} devices)",
            "model": "gpt",
            "cluster": "perlmutter",
            "devices": devices,
            "outcomes": outcomes,
        }
        (tmp_path / str(job) / "compare.json").write_text(json.dumps(result))
    ScalingReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    text = (tmp_path / "scaling.md").read_text()
    assert "| gpt on perlmutter (8 devices) | 8 |" in text and "| gpt on perlmutter (16 devices) | 16 |" in text
    assert "distmm" not in text
    assert (tmp_path / "scaling.png").stat().st_size > 0


def _jobs(comparison: Path) -> list[list[str]]:
    """The overrides of each job a comparison's multirun launches (its sweeper's grid)."""
    params = yaml.safe_load(comparison.read_text())["hydra"]["sweeper"]["params"]
    grid = [[f"{key}={value.strip()}" for value in str(values).split(",")] for key, values in params.items()]
    return [[f"+comparison={comparison.stem}", *job] for job in itertools.product(*grid)]


@pytest.mark.slow  # compare() prices its contenders in worker processes
@pytest.mark.parametrize("comparison", sorted((CONF / "comparison").glob("*.yaml")), ids=lambda path: path.stem)
def test_the_stored_comparison_tables_are_what_the_cost_model_gives_today(comparison: Path, tmp_path: Path) -> None:
    """The cross-paper comparisons' tables (benchmarks/results/comparison, which its README's
    paragraphs read) are the simulator's today: a change that moves them re-runs them."""
    for job in _jobs(comparison):
        config = composed("compare", *job)
        text = write(compare(config), config, tmp_path)
        cluster = config["cluster"]
        name = f"{config['model']['name']}_{cluster['name']}_{cluster['nodes'] * cluster['devices_per_node']}.md"
        assert (STORED / name).read_text() == text + "\n", (
            f"benchmarks/results/comparison/{name} is stale: python -m src.compare -m +comparison={comparison.stem}, "
            f"copy each job's compare.md and compare.png there and check the README's paragraphs"
        )
