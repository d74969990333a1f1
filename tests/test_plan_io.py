"""The plan file (src/plan_io.py, src/codec.py): a written plan reads back as the very plan
that was priced, model and Program included, and the simulator prices the read one the
same; a file of another version, a truncated one or one for another world size is one
line; src.plan_diff names what differs between two plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from src.codec import CodecError, decode_ints, encode_ints
from src.errors import ConfigError
from src.metrics import summarize
from src.plan_diff import main as plan_diff_main
from src.plan_diff import plan_diff
from src.plan_io import PLAN_FILE, PLANNED_FROM, VERSION, PlannedRun, read_plan, write_plan
from src.setup import plan_run, validate
from src.sim.engine import simulate
from tests.composing import composed

TINY_GPT = ["model=gpt", "model.preset=null", "model.layers=4", "model.hidden=64", "model.heads=4", "model.vocab=128"]
LOCAL8 = ["cluster=local", "cluster.devices_per_node=8", "train.seq_len=16", "train.global_batch=16"]
PLANS = {
    # Hop routes, interleaved stages, a distributed optimizer, sequence parallelism.
    "megatron": TINY_GPT + LOCAL8 + ["strategy.tp=2", "strategy.pp=2", "strategy.vpp=2", "strategy.zero_stage=1"],
    # Table routes (the batch-sync's), two towers on their own ranks.
    "distmm": ["model=clip", "model.scale=tiny", "cluster=local", "cluster.devices_per_node=8", "strategy=distmm"],
    # Brokers between units, a reordered batch (sample_order), chunked TP passes, a U-Net.
    "disttrain": ["model=mllm_9b", "model.scale=tiny", "cluster=local", "cluster.devices_per_node=8", "train.global_batch=8"]
    + ["strategy=disttrain"],
    # A 3D grid: its layers' layout (UnitPlan.grid), kernel ranges, cached layers.
    "par4d": TINY_GPT + LOCAL8 + ["strategy=par4d", "strategy.grid=[2,2,2,1]", "strategy.micro_batch_size=2"],
}


def _planned(overrides: list[str]) -> PlannedRun:
    config = composed([*overrides, "logger=none"])
    setup = validate(config)
    return PlannedRun(setup.model, setup.cluster, setup.train, plan_run(setup), {k: config[k] for k in PLANNED_FROM})


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[PlannedRun, Path]]:
    root = tmp_path_factory.mktemp("plans")
    out = {}
    for name, overrides in PLANS.items():
        planned = _planned(overrides)
        (root / name).mkdir()
        write_plan(root / name, planned)
        out[name] = (planned, root / name)
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_a_written_plan_reads_back_as_the_plan_and_prices_the_same(written, name):
    planned, run_dir = written[name]
    back = read_plan(run_dir, world_size=planned.plan.devices)
    plan, read = planned.plan, back.plan
    assert read.program.classes == plan.program.classes
    assert read.program.groups == plan.program.groups and read.program.routes == plan.program.routes
    assert read.units == plan.units and read.sample_order == plan.sample_order and read.precision == plan.precision
    assert (back.model, back.cluster, back.train) == (planned.model, planned.cluster, planned.train)
    for unit, again in zip(planned.model.units, back.model.units):  # repeated layers stay one object
        assert len({id(layer) for layer in again.layers}) == len({id(layer) for layer in unit.layers})
    # Summaries compared as the JSON they are written as (tuples and lists alike).
    priced = [
        json.dumps(summarize(p, simulate(p.plan.program, p.model, p.cluster, p.plan.precision)), sort_keys=True)
        for p in (planned, back)
    ]
    assert priced[0] == priced[1]


def test_integer_runs_keep_their_order():
    for values in [(), (5,), (0, 1), (0, 2), (0, 1, 2, 3, 8, 9, 10, 4), (30, 20, 10, 0, 1), (7, 7, 7), (0, 64, 128, 192, 1)]:
        assert decode_ints(encode_ints(values)) == values
    assert encode_ints(tuple(range(0, 12288))) == "0-12287"
    assert encode_ints((0, 8, 16, 24, 1, 9, 17, 25)) == "0-24:8,1-25:8"
    with pytest.raises(CodecError, match="does not step"):
        decode_ints("0-7:2")


def _rewritten(run_dir: Path, tmp_path: Path, edit) -> Path:
    target = tmp_path / PLAN_FILE
    target.write_text(edit((run_dir / PLAN_FILE).read_text()))
    return target


def test_another_version_a_truncated_file_or_another_world_size_is_one_line(written, tmp_path):
    planned, run_dir = written["megatron"]
    older = _rewritten(run_dir, tmp_path, lambda text: text.replace(f'"version":{VERSION}', '"version":2', 1))
    with pytest.raises(ConfigError, match=rf"plan format version 2; this mmdist reads version {VERSION} only"):
        read_plan(older)
    newer = _rewritten(run_dir, tmp_path, lambda text: text.replace(f'"version":{VERSION}', f'"version":{VERSION + 1}', 1))
    with pytest.raises(ConfigError, match=rf"plan format version {VERSION + 1}; this mmdist reads version {VERSION} only"):
        read_plan(newer)
    truncated = _rewritten(run_dir, tmp_path, lambda text: text[: len(text) // 2])
    with pytest.raises(ConfigError, match=r"is not a whole plan file \(truncated or not JSON: .* of \d+\)"):
        read_plan(truncated)
    with pytest.raises(ConfigError, match=rf"plans {planned.plan.devices} ranks, not the launcher's 3 \(WORLD_SIZE\)"):
        read_plan(run_dir, world_size=3)
    other = _rewritten(run_dir, tmp_path, lambda text: json.dumps({"format": "something", "version": 1}))
    with pytest.raises(ConfigError, match=r"is not an mmdist plan file \(format 'something'"):
        read_plan(other)
    broken = _rewritten(run_dir, tmp_path, lambda text: text.replace('"micro_batch":', '"micro_batches":', 1))
    with pytest.raises(ConfigError, match=r"is not a valid plan file: UnitPlan has no field\(s\) \['micro_batches'\]"):
        read_plan(broken)
    with pytest.raises(ConfigError, match="cannot read plan file"):
        read_plan(tmp_path / "nowhere")


def test_plan_diff_names_each_differing_field_and_instruction(written, tmp_path, capsys):
    planned, run_dir = written["megatron"]
    assert plan_diff(planned, read_plan(run_dir)) == []
    other = _planned(PLANS["megatron"][:-1] + ["strategy.zero_stage=0"])
    lines = plan_diff(planned, other)
    assert "plan.units[llm].zero_stage: 1 -> 0" in lines
    assert "sources.strategy.zero_stage: 1 -> 0" in lines
    assert any(line.startswith("plan.program.classes[stage 0] @") and " - Collective op=reduce_scatter" in line for line in lines)
    (tmp_path / "other").mkdir()
    write_plan(tmp_path / "other", other)
    assert plan_diff_main([str(run_dir), str(tmp_path / "other")]) == 1
    assert capsys.readouterr().out.splitlines() == lines
    assert plan_diff_main([str(run_dir), str(run_dir)]) == 0
    assert plan_diff_main([str(run_dir), str(tmp_path / "nowhere")]) == 2
