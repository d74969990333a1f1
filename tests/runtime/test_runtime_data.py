"""Bad shards through the front door: a shard the index finds bad is refused before any
worker starts; with backend.data_errors=skip a run trains around bad members and its
summary names them."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.runtime.support import CLIP, TWO_WORKERS, build_deepspeed_ops
from tests.runtime.test_runtime_cli import _shard_with_a_broken_second_half

pytestmark = pytest.mark.slow  # subprocess runs of the front door


def test_a_truncated_shard_is_refused_before_training(tmp_path):
    _shard_with_a_broken_second_half(tmp_path / "shard-0.tar")
    raw = (tmp_path / "shard-0.tar").read_bytes()
    (tmp_path / "shard-0.tar").write_bytes(raw[: raw.index(b"0006.png") + 512 + 4])  # cut inside its data
    result = run_cli(*TWO_WORKERS, *CLIP, "strategy=ddp", f"backend.data={tmp_path}/shard-*.tar", f"hydra.run.dir={tmp_path}/run")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: backend.data: shard {tmp_path}/shard-0.tar member 0006.png: cut short")
    assert (tmp_path / "run" / "error.txt").read_text() == lines[0].removeprefix("error: ") + "\n"
    assert not (tmp_path / "run" / "errors").exists() and not (tmp_path / "run" / "summary.json").exists()


def test_skip_trains_around_bad_members_and_the_summary_names_them(tmp_path):
    build_deepspeed_ops()
    _shard_with_a_broken_second_half(tmp_path / "shard-0.tar")
    data = [f"backend.data={tmp_path}/shard-*.tar", "backend.data_errors=skip", "train.steps=2"]
    result = run_cli(*TWO_WORKERS, *CLIP, "strategy=ddp", *data, f"hydra.run.dir={tmp_path}/run")
    assert result.returncode == 0, result.stderr[-2000:]
    # 8 samples for 2 steps of 8: said once, by the front door.
    assert result.stderr.count("backend.data: 8 samples for 2 steps of 8: each sample is read 2 times") == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["measured"]["data_skipped"] == [f"{tmp_path}/shard-0.tar:{i:04d}.png" for i in range(4, 8)]
