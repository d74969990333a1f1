"""Checkpoints and resume on four workers: a run stopped after step 2 with a checkpoint and
resumed from it trains on to the very losses of one run of 4 steps, for Megatron-LM's
tp2 x pp2 (model states per TP rank and stage; with ZeRO-1, at dp=1, DeepSpeed's ZeRO
optimizer states of each, and fp16's loss scale), DistMM's towers on disjoint groups (one
engine per tower), Par4D's grid units (per-rank shards of its own, not DeepSpeed's),
Optimus's LLM under the distributed optimizer its plan runs (per-rank shards too) and
ZeRO-3 (loaded into freshly partitioned parameters). The stopped and the uninterrupted
runs, then the resumed runs, each run in ONE launch of four workers (test_runtime_faults
resumes a ddp ZeRO-2 run killed by SIGKILL). A checkpoint damaged after it was sealed (a rank
file deleted, the model states cut short) is refused by the front door in one line naming
the file, before any worker starts. Bad input for checkpoints and resume is one line
before any process starts (the quick tests at the end)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from src.config import CheckpointSpec
from src.errors import ConfigError
from src.runtime.checkpoint import CHECKPOINT_DIR, FORMAT, LATEST, META, VERSION, check_resume
from tests.conftest import run_cli
from tests.runtime.support import CLIP, GPT, composed, launch_cases, summary_of

STOP, STEPS = 2, 4
FOUR_WORKERS = ["backend=torch", "cluster=local", "cluster.devices_per_node=4", "logger=none"]
TP2_PP2 = [*FOUR_WORKERS, *GPT, "strategy=megatron", "strategy.tp=2", "strategy.pp=2", "strategy.micro_batch_size=2"]
CASES = {
    "megatron_tp2_pp2": TP2_PP2,
    "megatron_tp2_pp2_zero1_fp16": [*TP2_PP2, "strategy.zero_stage=1", "train.precision=fp16"],
    # The executor's distributed optimizer, a bucket per layer, its parameters gathered by the
    # next step's forward: the checkpoint gathers them first.
    "megatron_pp2_dp2_zero1_overlapped": [
        *FOUR_WORKERS,
        *GPT,
        "strategy=megatron",
        "strategy.tp=1",
        "strategy.pp=2",
        "strategy.micro_batch_size=2",
        "strategy.zero_stage=1",
        "strategy.overlap_grad_reduce=true",
        "strategy.overlap_param_gather=true",
    ],
    "distmm_clip_2+2": [
        *FOUR_WORKERS,
        "strategy=distmm",
        "model=clip",
        "model.scale=tiny",
        "train.global_batch=12",
        "train.contrastive_batch=6",
        "strategy.vision.dp=2",
        "strategy.text.dp=2",
    ],
    "par4d_grid_fp16": [
        *FOUR_WORKERS,
        *GPT,
        "strategy=par4d",
        "strategy.grid=[2,2,1,1]",
        "strategy.micro_batch_size=2",
        "strategy.recompute=none",
        "train.precision=fp16",
    ],
    "ddp_zero3": [*FOUR_WORKERS, *CLIP, "strategy=ddp", "strategy.zero_stage=3", "strategy.param_persistence_threshold=0"],
    # Optimus's LLM under the distributed optimizer the plan runs (runtime.dist_optimizer): each
    # replica's parameters, shard and AdamW states; the next step's all-gather brings the
    # parameters up to date.
    "optimus_distributed_optimizer": [*FOUR_WORKERS, "model=optimus", "model.scale=tiny", "strategy=optimus"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per case: the run stopped after STOP steps (its checkpoint at its end), the
    uninterrupted run of STEPS and the run resumed from the stopped one's checkpoint."""
    root = tmp_path_factory.mktemp("checkpoint")
    first = {f"{name}/stopped": [*o, f"train.steps={STOP}", f"train.checkpoint_every={STOP}"] for name, o in CASES.items()}
    first |= {f"{name}/whole": [*o, f"train.steps={STEPS}"] for name, o in CASES.items()}
    dirs = launch_cases(root, first, 4)
    resumed = {f"{name}/resumed": [*o, f"train.steps={STEPS}", f"train.resume={dirs[f'{name}/stopped']}"] for name, o in CASES.items()}
    dirs |= launch_cases(root, resumed, 4)
    return {name: {kind: dirs[f"{name}/{kind}"] for kind in ("stopped", "whole", "resumed")} for name in CASES}


@pytest.mark.slow  # the front door in a process
@pytest.mark.parametrize("damage", ["a rank file deleted", "the model states cut short"])
def test_a_damaged_checkpoint_is_refused_before_any_worker_starts(runs, tmp_path, damage):
    source = tmp_path / "source"
    shutil.copytree(runs["megatron_tp2_pp2"]["stopped"], source)
    step = source / CHECKPOINT_DIR / f"step{STOP}"
    if damage == "a rank file deleted":
        (step / "ranks" / "rank3.pt").unlink()
        named = r"ranks/rank3\.pt is missing \(the manifest lists \d+ bytes\)"
    else:
        states = sorted(step.glob("engines/*/state/mp_rank_00_model_states.pt"))[0]
        states.write_bytes(states.read_bytes()[:1000])
        named = rf"{re.escape(str(states.relative_to(step)))} has 1000 bytes, the manifest \d+"
    run_dir = tmp_path / "resumed"
    result = run_cli(*CASES["megatron_tp2_pp2"], f"train.steps={STEPS}", f"train.resume={source}", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    damaged = rf"error: train\.resume={re.escape(str(source))}: its checkpoint {re.escape(str(step))} is damaged: "
    assert len(lines) == 1 and re.fullmatch(rf"{damaged}{named}; .+", lines[0]), lines
    assert (run_dir / "error.txt").read_text() == lines[0].removeprefix("error: ") + "\n"
    assert not (run_dir / "run.json").exists() and not (run_dir / "errors").exists()  # no worker was started


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["type"] == "step"]


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_run_gives_the_losses_of_one_never_stopped(runs, case):
    stopped, whole, resumed = (runs[case][kind] for kind in ("stopped", "whole", "resumed"))
    assert _losses(stopped) + _losses(resumed) == _losses(whole)
    assert len(set(_losses(whole))) == STEPS  # the weights moved: a resume that lost them would differ
    saves = summary_of(stopped)["measured"]["checkpoint"]["saves"]
    assert [s["steps_done"] for s in saves] == [STOP] and saves[0]["bytes"] > 0
    assert summary_of(resumed)["measured"]["first_step"] == STOP
    print(f"{case}: checkpoint of {STOP} steps, {saves[0]['bytes'] / 2**20:.2f} MiB saved in {saves[0]['save_s']:.3f} s")


# ---- bad input: one line (a ConfigError: the door prints it and exits 2), no process ----


def _run_dir(tmp_path: Path, name: str, overrides: list[str]) -> Path:
    """A run directory as the door writes it before starting workers: plan.json and the rest."""
    from src.report import JobInfo
    from src.setup import prepare_run, start_run_dir, write_run_dir

    run_dir = tmp_path / name
    config = composed(overrides)
    start_run_dir(config, run_dir)
    write_run_dir(run_dir, *prepare_run(config, JobInfo(run_name=name)))
    return run_dir


def _fake_checkpoint(run_dir: Path, step: int, world_size: int) -> Path:
    """What check_resume reads of a checkpoint: latest, meta.json and its manifest's files
    (a rank file each, and an engine's model states)."""
    path = run_dir / CHECKPOINT_DIR / f"step{step}"
    files = {f"ranks/rank{rank}.pt": bytes([rank]) * 100 for rank in range(world_size)}
    files["engines/vision.rank0/state/mp_rank_00_model_states.pt"] = bytes(range(256)) * 8
    for relative, data in files.items():
        (path / relative).parent.mkdir(parents=True, exist_ok=True)
        (path / relative).write_bytes(data)
    manifest = {relative: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for relative, data in files.items()}
    meta = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size, "files": manifest}
    (path / META).write_text(json.dumps(meta))
    (run_dir / CHECKPOINT_DIR / LATEST).write_text(path.name)
    return path


DEFAULTS: dict = {}  # the training settings (run.json's "torch" part) of a run at the defaults: none written
DDP = ["backend=torch", "cluster=local", "cluster.devices_per_node=2", "model=clip", "model.scale=tiny", "train.global_batch=8"]


def test_checkpoints_on_the_simulator_are_refused(tmp_path):
    from src.report import JobInfo
    from src.setup import prepare_run

    line = r"^train.checkpoint_every and train.resume are the real backend's \(backend=torch\), not backend=sim's$"
    with pytest.raises(ConfigError, match=line):
        prepare_run(composed(["backend=sim", "train.checkpoint_every=1"]), JobInfo(run_name="sim"))


def test_resuming_from_a_run_without_a_checkpoint_is_refused(tmp_path):
    source = _run_dir(tmp_path, "source", [*DDP, "strategy=ddp", "train.steps=2"])
    run_dir = _run_dir(tmp_path, "run", [*DDP, "strategy=ddp", "train.steps=4"])
    with pytest.raises(ConfigError, match=rf"^train.resume={source}: no checkpoint there \(no {source}/checkpoint/latest; .+\)$"):
        check_resume(CheckpointSpec(resume=str(source)), run_dir, DEFAULTS)
    _fake_checkpoint(source, 2, 2)
    assert check_resume(CheckpointSpec(resume=str(source)), run_dir, DEFAULTS).step == 2  # the same plan: it would resume
    (source / CHECKPOINT_DIR / "step2" / META).write_text('{"format": "mmdist-checkpoint", "version": 1}')  # cut short
    with pytest.raises(ConfigError, match=rf"^train.resume={source}: {source}/checkpoint/step2/meta.json is not an mmdist checkpoint"):
        check_resume(CheckpointSpec(resume=str(source)), run_dir, DEFAULTS)


def test_resuming_from_a_checkpoint_of_another_plan_is_refused(tmp_path):
    source = _run_dir(tmp_path, "source", [*DDP, "strategy=ddp", "strategy.zero_stage=2", "train.steps=2"])
    _fake_checkpoint(source, 2, 2)
    run_dir = _run_dir(tmp_path, "run", [*DDP, "strategy=ddp", "strategy.zero_stage=1", "train.steps=4"])
    line = rf"^train.resume={source}: its checkpoint was saved by another plan \(its plan.json differs in plan; "
    with pytest.raises(ConfigError, match=line):
        check_resume(CheckpointSpec(resume=str(source)), run_dir, DEFAULTS)
    other_world = _run_dir(tmp_path, "four", [*DDP, "cluster.devices_per_node=4", "strategy=ddp", "train.steps=4"])
    with pytest.raises(ConfigError, match=r"its checkpoint is of 2 ranks, this plan runs 4$"):
        check_resume(CheckpointSpec(resume=str(source)), other_world, DEFAULTS)


def test_a_damaged_checkpoint_is_refused_naming_its_file(tmp_path):
    """A file of the manifest deleted, cut short or changed in place: one line naming it."""
    source = _run_dir(tmp_path, "source", [*DDP, "strategy=ddp", "train.steps=2"])
    run_dir = _run_dir(tmp_path, "run", [*DDP, "strategy=ddp", "train.steps=4"])
    spec = CheckpointSpec(resume=str(source))
    damaged = rf"^train.resume={source}: its checkpoint {source}/checkpoint/step2 is damaged: "
    path = _fake_checkpoint(source, 2, 2)
    (path / "ranks" / "rank1.pt").unlink()
    with pytest.raises(ConfigError, match=damaged + r"ranks/rank1.pt is missing \(the manifest lists 100 bytes\); "):
        check_resume(spec, run_dir, DEFAULTS)

    shutil.rmtree(source / CHECKPOINT_DIR)
    path = _fake_checkpoint(source, 2, 2)
    states = path / "engines" / "vision.rank0" / "state" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:1000])
    cut = r"engines/vision.rank0/state/mp_rank_00_model_states.pt has 1000 bytes, the manifest 2048; "
    with pytest.raises(ConfigError, match=damaged + cut):
        check_resume(spec, run_dir, DEFAULTS)

    shutil.rmtree(source / CHECKPOINT_DIR)
    path = _fake_checkpoint(source, 2, 2)
    (path / "ranks" / "rank0.pt").write_bytes(bytes([7]) * 100)  # the same size, other bytes
    with pytest.raises(ConfigError, match=damaged + r"ranks/rank0.pt does not match its checksum \(SHA-256 [0-9a-f]{12}\.\.\., "):
        check_resume(spec, run_dir, DEFAULTS)
    assert check_resume(spec, run_dir, DEFAULTS, checksums=False).step == 2  # a launcher's worker checks sizes only

    meta = json.loads((path / META).read_text())
    (path / META).write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
    with pytest.raises(ConfigError, match=rf"^train.resume={source}: {path}/meta.json lists no files \(its manifest is missing\)$"):
        check_resume(spec, run_dir, DEFAULTS)
