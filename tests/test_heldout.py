"""src.heldout: the published runs' data file and the way each run is priced (no process
starts; one small run is simulated)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from src import heldout
from src.errors import ConfigError

DATA, RUNS = heldout.load(heldout.RUNS)
BY_ID = {r.id: r for r in RUNS}


def test_every_run_cites_a_source_and_a_published_number() -> None:
    assert len(RUNS) == len(BY_ID) >= 26
    for run in RUNS:
        assert run.source in DATA["sources"] and run.where
        assert set(run.published) & {"iteration_s", "tflops_per_gpu"}


def test_a_rate_per_gpu_becomes_seconds_by_narayanans_flop_count() -> None:
    # Table 1's 1.7B row: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs at 137 TFLOP/s on each of 32 GPUs.
    b, s, l, h, v = 512, 2048, 24, 2304, 51200
    flops = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert heldout.published_seconds(BY_ID["t1-1.7b"], s, v) == pytest.approx(flops / (137e12 * 32))
    assert heldout.published_seconds(BY_ID["k22-175b-full"], s, v) == 18.13  # stated as seconds


def test_overrides_state_the_runs_configuration() -> None:
    interleaved = heldout.overrides(BY_ID["t1-145.6b"], DATA["common"])
    assert {"cluster.nodes=192", "strategy.vpp=2", "strategy.schedule=interleaved", "model.attention=eager"} <= set(interleaved)
    assert {"strategy.sequence_parallel=false", "strategy.zero_stage=0", "train.precision=fp16"} <= set(interleaved)
    assert "strategy.schedule=1f1b" in heldout.overrides(BY_ID["t1-1008b"], DATA["common"])
    assert "strategy.sequence_parallel=true" in heldout.overrides(BY_ID["k22-22b-sel-sp"], DATA["common"])
    zero3 = heldout.overrides(BY_ID["t2-zero3-175b-384"], DATA["common"])
    assert {"strategy=ddp", "strategy.zero_stage=3"} <= set(zero3) and not any("schedule" in o for o in zero3)
    with pytest.raises(ConfigError, match="12 GPUs is not a whole number of 8-GPU"):
        heldout.overrides(replace(BY_ID["t1-1.7b"], gpus=12), DATA["common"])


def test_a_run_citing_no_listed_source_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.yaml"
    path.write_text(heldout.RUNS.read_text().replace("source: korthikanti2022", "source: nobody2020", 1))
    with pytest.raises(ConfigError, match=r"sources \['nobody2020'\]"):
        heldout.load(path)


def test_the_smallest_run_is_simulated_and_summed_up_by_source() -> None:
    rows = heldout.check([BY_ID["k22-22b-full"]], DATA)
    assert rows[0]["simulated_s"] > 0 and rows[0]["published_s"] == 1.42
    summary = heldout.summarize(rows, "source")["korthikanti2022"]
    assert summary["runs"] == 1 and summary["mape_pct"] == pytest.approx(abs(rows[0]["error_pct"]))
    assert summary["simulated_faster"] + summary["simulated_slower"] == 1
