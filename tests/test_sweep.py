"""The figure runner: runs every (group, series), puts the paper's values beside ours."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from src.sweep import main

TINY_GPT = ["model=gpt", "model.preset=null", "model.layers=2", "model.hidden=256", "model.heads=4",
            "model.vocab=1000", "train.seq_len=128", "cluster=perlmutter", "cluster.nodes=2", "logger=none",
            "train.global_batch=16", "strategy.recompute=none", "strategy.zero_stage=0"]


def test_sweep_writes_table_plot_and_normalised_values(tmp_path: Path) -> None:
    sweep = {
        "name": "tiny", "title": "tiny sweep", "source": "a test", "metric": "iteration_time_s",
        "metric_label": "speed-up over tp1", "normalize": {"by": "tp1", "invert": True},
        "base": TINY_GPT,
        "series": {"tp1": ["strategy.tp=1", "strategy.pp=1"], "tp2": ["strategy.tp=2", "strategy.pp=1"]},
        "groups": [{"label": "mb1", "overrides": ["strategy.micro_batch_size=1"], "paper": {"tp2": 1.5}},
                   {"label": "mb2", "overrides": ["strategy.micro_batch_size=2"], "paper": {"tp2": [0.5, 0.9]}},
                   {"label": "bad", "overrides": ["strategy.micro_batch_size=3"]}],
        "notes": "why these settings",
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    rows = {(r["group"], r["series"]): r for r in results["rows"]}
    assert rows[("mb1", "tp1")]["value"] == 1.0  # the baseline against itself
    summaries = {s: json.loads((out / "runs" / f"00_{s}" / "summary.json").read_text()) for s in ("tp1", "tp2")}
    assert rows[("mb1", "tp2")]["value"] == summaries["tp1"]["iteration_time_s"] / summaries["tp2"]["iteration_time_s"]
    assert rows[("bad", "tp2")]["value"] is None and "micro-batch" in rows[("bad", "tp2")]["error"]
    table = (out / "results.md").read_text()
    assert "| mb1 | tp2 |" in table and "| 1.5 |" in table and "0.5–0.9" in table and "not run:" in table
    assert "why these settings" in table
    assert (out / "tiny.png").stat().st_size > 1000
