"""src.balance_study: each series x policy priced over several batches, against uniform data."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from src import balance_study, progress
from src.balance_study import aggregate, percentile
from src.cluster_inputs import presets_fingerprint
from src.config import composed
from src.setup import LIMITS, validate
from src.strategies.base import PlanRequest
from src.strategies.disttrain.planner import plan_disttrain_batches

REPO = Path(__file__).resolve().parent.parent
SMALL = ["logger=none", "model=mllm_9b", "model.images_per_sequence=10", "cluster=a800", "cluster.nodes=6", "train.global_batch=32"]
MEGATRON = "megatron=strategy=megatron strategy.tp=8 strategy.pp=3 strategy.micro_batch_size=1"


def _batch(seconds: float) -> dict:
    return {"iteration_time_s": seconds, "mfu": 0.0, "model_flops_per_iteration": 2e15, "devices": 8, "peak_flops_per_device": 1e14}


def test_the_policies_are_judged_on_the_distribution_against_uniform_data():
    outcomes = [
        {"series": "s", "policy": "uniform", "batches": [_batch(10.0)]},
        {"series": "s", "policy": "none", "batches": [_batch(t) for t in (12.0, 14.0, 13.0, 13.0)]},
        {"series": "s", "policy": "cost", "batches": [_batch(t) for t in (11.0, 11.5, 10.5, 11.0)]},
        {"series": "t", "policy": "none", "reason": "no plan"},
    ]
    rows = {(r["series"], r["policy"]): r for r in aggregate(outcomes)}
    cost = rows[("s", "cost")]
    assert cost["mean_s"] == 11.0 and cost["max_s"] == 11.5
    assert cost["recovered"] == pytest.approx(2.0 / 3.0)  # none's mean 13 against uniform's 10
    assert cost["gain"] == pytest.approx(13.0 / 11.0)
    assert cost["mfu"] == pytest.approx(2e15 / (11.0 * 8 * 1e14))
    assert "recovered" not in rows[("s", "none")] and rows[("t", "none")]["reason"] == "no plan"
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)


def test_a_series_whose_plan_depends_on_the_data_is_judged_against_the_skew_it_replaces():
    outcomes = [
        {"series": "mean", "policy": "uniform", "batches": [_batch(10.0)]},
        {"series": "mean", "policy": "none", "batches": [_batch(14.0)]},
        {"series": "data", "policy": "uniform", "batches": [_batch(10.0)]},
        {"series": "data", "policy": "none", "batches": [_batch(12.0)]},
        {"series": "data", "policy": "cost", "batches": [_batch(11.5)]},
    ]
    rows = {(r["series"], r["policy"]): r for r in aggregate(outcomes, {"data": "mean"})}
    # Against its own none (12 s) cost would win back a quarter; against the plan it replaces, more.
    assert rows[("data", "cost")]["recovered"] == pytest.approx((14.0 - 11.5) / (14.0 - 10.0))
    assert rows[("data", "none")]["recovered"] == pytest.approx(0.5) and rows[("data", "none")]["against"] == "mean"
    assert "recovered" not in rows[("mean", "none")] and "against" not in rows[("mean", "none")]


def test_a_plan_on_uniform_data_splits_what_skew_leaves_into_shape_and_placement():
    outcomes = [
        {"series": "s", "policy": "uniform", "batches": [_batch(10.0)]},
        {"series": "s", "policy": "none", "batches": [_batch(13.0)], "plan_on_uniform": _batch(10.5)},
        {"series": "s", "policy": "cost", "batches": [_batch(11.0)], "plan_on_uniform": _batch(10.8)},
    ]
    rows = {r["policy"]: r for r in aggregate(outcomes)}
    assert rows["cost"]["plan_uniform_s"] == 10.8 and rows["cost"]["placement_s"] == pytest.approx(0.2)
    assert "plan_uniform_s" not in rows["uniform"]
    assert "| s | cost | 1 | 11.000 |" in balance_study.table(aggregate(outcomes), "t")
    assert balance_study.table(aggregate(outcomes), "t").splitlines()[-1].endswith("| 10.800 | 0.200 |")


def test_a_plan_chosen_on_skewed_data_keeps_its_choices_on_uniform_data():
    """None among a strategy's batches: uniform data (strategies.base.on_batch), the plan's
    degrees kept, every micro-batch at the mean load."""
    overrides = [
        *SMALL[:3], "model.scale=tiny", "model.images_per_sequence=2", "cluster=local", "cluster.devices_per_node=4",
        "train.global_batch=8", "strategy=disttrain", "strategy.generator.pp=1", "train.balance=cost",
    ]  # fmt: skip
    setup = validate(composed(overrides))
    request = PlanRequest(setup.model, setup.cluster, setup.train, setup.config["strategy"], None, LIMITS["sim"])
    skewed, uniform = plan_disttrain_batches(request, (0, None))
    assert (skewed.sample_content, uniform.sample_content) == ("interleaved", "uniform")
    assert uniform.sample_images is None and len(set(skewed.sample_images or ())) > 1
    assert [(u.unit, u.mesh, u.micro_batch, u.num_microbatches) for u in uniform.units] == [
        (u.unit, u.mesh, u.micro_batch, u.num_microbatches) for u in skewed.units
    ]


def test_a_small_study_runs_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "AT_ONCE_FIRST_S", 0.0)  # past its checks it speaks by wall time
    argv = ["--batches=2", "--jobs=1", "--policies=none,cost", f"--out={tmp_path}", f"--series={MEGATRON}", *SMALL]
    assert balance_study.main(argv) == 0
    captured = capsys.readouterr()
    assert re.search(r"^pricing 3 series and policies on 2 batches \[\d+ s\]: [0-3] of 3 done$", captured.err, re.M)
    record = json.loads((tmp_path / "balance.json").read_text())
    rows = {r["policy"]: r for r in record["rows"]}
    assert set(rows) == {"uniform", "none", "cost"} and rows["none"]["batches"] == 2 and rows["uniform"]["batches"] == 1
    times = {o["policy"]: [b["iteration_time_s"] for b in o["batches"]] for o in record["outcomes"]}
    assert times["none"][0] != times["none"][1]  # two batches of other sequences
    assert rows["cost"]["mean_s"] < rows["none"]["mean_s"] and rows["none"]["mean_s"] > rows["uniform"]["mean_s"]
    assert "| megatron | cost | 2 |" in captured.out
    assert record["series"] == {"megatron": MEGATRON.split("=", 1)[1].split()}
    assert record["presets"] == presets_fingerprint([[*SMALL, *record["series"]["megatron"]]])
    # Megatron-LM's plan is chosen at the mean load whatever the policy: on uniform data it is the uniform row's.
    for policy in ("none", "cost"):
        assert rows[policy]["plan_uniform_s"] == pytest.approx(rows["uniform"]["mean_s"], rel=1e-9)
        assert rows[policy]["placement_s"] == pytest.approx(rows[policy]["mean_s"] - rows["uniform"]["mean_s"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policies=none,fast"], "--policies: 'fast'"),
        (["--batches=0"], "--batches 0"),
        (["--series=megatron"], "--series 'megatron': write LABEL='OVERRIDES'"),
        ([f"--series={MEGATRON}", "--skew-of=megatron=disttrain"], "--skew-of 'megatron=disttrain': write LABEL=REFERENCE"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert balance_study.main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_strategy_priced_at_the_mean_load_is_refused_per_series(tmp_path):
    argv = ["--batches=1", "--jobs=1", "--policies=none", f"--out={tmp_path}", "--series=distmm=strategy=distmm", "logger=none"]
    assert balance_study.main(argv + ["model=clip", "cluster=p3_16xlarge"]) == 0
    rows = json.loads((tmp_path / "balance.json").read_text())["rows"]
    assert all("no batch to balance" in r["reason"] for r in rows)


def test_uniform_data_has_no_batch_to_balance(tmp_path):
    argv = ["--batches=1", "--jobs=1", "--policies=none", f"--out={tmp_path}", f"--series={MEGATRON}", *SMALL, "train.data=uniform"]
    assert balance_study.main(argv) == 0
    rows = {r["policy"]: r for r in json.loads((tmp_path / "balance.json").read_text())["rows"]}
    assert rows["none"]["reason"].startswith("train.data=uniform: every sequence weighs the same")
    assert "reason" not in rows["uniform"]


STORED = sorted((REPO / "benchmarks" / "results" / "balance").glob("*/balance.json"))


@pytest.mark.parametrize("stored", STORED, ids=lambda p: p.parent.name)
def test_the_stored_balancing_figure_is_of_todays_presets(stored):
    """A preset's constants changed since the balancing figure was priced leave it stale: re-run
    `python benchmarks/balance_figure.py --only NAME`, as the scorecard's figures are re-run."""
    record = json.loads(stored.read_text())
    jobs = [[*record["overrides"], *overrides] for overrides in record["series"].values()]
    assert record["presets"] == presets_fingerprint(jobs), f"re-run python benchmarks/balance_figure.py --only {stored.parent.name}"


def test_a_changed_preset_changes_the_fingerprint(tmp_path, monkeypatch):
    from src import cluster_inputs

    jobs = [["cluster=a800", "model=mllm_9b"]]
    before = presets_fingerprint(jobs)
    copy = tmp_path / "cluster"
    shutil.copytree(cluster_inputs.CLUSTERS, copy)
    monkeypatch.setattr(cluster_inputs, "CLUSTERS", copy)
    cluster_inputs._values.cache_clear()
    try:
        assert presets_fingerprint(jobs) == before  # the same files elsewhere
        preset = copy / "a800.yaml"
        text = preset.read_text()
        preset.write_text(text.replace("# device gap per kernel", "# a comment changed, not a value", 1))
        cluster_inputs._values.cache_clear()
        assert presets_fingerprint(jobs) == before
        preset.write_text(text.replace("kernel_overhead_s: 1.33e-6", "kernel_overhead_s: 1.5e-6", 1))
        cluster_inputs._values.cache_clear()
        assert presets_fingerprint(jobs) != before
    finally:
        cluster_inputs._values.cache_clear()
