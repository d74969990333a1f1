"""backend.deepspeed on two workers: gradient clipping and a warm-up schedule train as the
single-process reference does (losses, learning rates, the model's gradient norm), at
ZeRO-0 (the client optimizer's hook clips), ZeRO-2 (DeepSpeed clips), Megatron-LM's
tp=2 (each rank's slice of the split weights in the norm), a pipeline at ZeRO-0 (each
stage's norm reduced over the stages) and the executor's distributed optimizer (each
replica's slices in the norm); a run stopped with a checkpoint
and resumed trains on to the very numbers of one never stopped (the schedule's state
included); every per-step metric is in metrics.jsonl. Clipping a plan whose parameters
several engines hold, each clipping by its own norm, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from src.config import DeepSpeedSpec, OptimizerSpec, SchedulerSpec
from src.errors import ConfigError
from src.models.registry import build_model
from src.runtime.reference import ReferenceStep, reference_steps
from src.runtime.step_metrics import tokens_per_sample
from tests.runtime.support import CLIP, GPT, TWO_WORKERS, launch_cases, prepare_run_dir, sensitive

MLLM = ["model=mllm_9b", "model.scale=tiny", "train.global_batch=8", "train.data=uniform"]
STOP, STEPS = 2, 4
CLIPPING, LR = 1.0, 0.5
SCHEDULE = {"warmup_min_lr": 0.1, "warmup_max_lr": LR, "warmup_num_steps": 2, "warmup_type": "linear"}
SETTINGS = [
    *sensitive(LR),
    f"backend.deepspeed.gradient_clipping={CLIPPING}",
    "backend.deepspeed.scheduler.type=WarmupDecayLR",
    *(f"backend.deepspeed.scheduler.params.{key}={value}" for key, value in SCHEDULE.items()),
]
DEEPSPEED = DeepSpeedSpec(
    optimizer=OptimizerSpec(lr=LR, eps=1.0), scheduler=SchedulerSpec("WarmupDecayLR", SCHEDULE), gradient_clipping=CLIPPING
)
CASES = {
    "clip_zero0": CLIP + ["strategy=ddp", "strategy.zero_stage=0"],
    "clip_zero2": CLIP + ["strategy=ddp", "strategy.zero_stage=2"],
    "gpt_megatron_tp2": GPT + ["strategy=megatron", "strategy.tp=2", "strategy.pp=1"],
    # A pipeline at ZeRO-0: each stage's norm reduced over the stages, clipped by the model's;
    # an MLLM's so too, its encoder and LLM on the first stage (one engine), its generator on
    # the last.
    "gpt_megatron_pp2": GPT + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.zero_stage=0"],
    "mllm_megatron_pp2": MLLM
    + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.zero_stage=0", "strategy.modality_stages=merged"],
    # The executor's distributed optimizer (Megatron-Core's overlaps under ZeRO-1): its norm
    # over the replicas' slices, clipped by it.
    "gpt_megatron_dp2_distributed_optimizer": GPT
    + [
        "strategy=megatron",
        "strategy.tp=1",
        "strategy.pp=1",
        "strategy.zero_stage=1",
        "strategy.overlap_grad_reduce=true",
        "strategy.overlap_param_gather=true",
    ],
}
METRICS = ("loss", "step_time_s", "lr", "grad_norm", "loss_scale", "samples_per_s", "tokens_per_s", "peak_memory_gib")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("training")
    first = {name: [*TWO_WORKERS, *o, *SETTINGS, f"train.steps={STEPS}"] for name, o in CASES.items()}
    stopped = [*first["clip_zero2"][:-1], f"train.steps={STOP}", f"train.checkpoint_every={STOP}"]
    dirs = launch_cases(root, {**first, "stopped": stopped}, 2)
    resumed = [*first["clip_zero2"], f"train.resume={dirs['stopped']}"]
    return dirs | launch_cases(root, {"resumed": resumed}, 2)


@pytest.fixture(scope="module")
def references() -> dict[str, list[ReferenceStep]]:
    clip = build_model({"name": "clip", "scale": "tiny"})
    gpt = build_model({"name": "gpt", "preset": None, "layers": 4, "hidden": 64, "heads": 4, "vocab": 128}, 16)
    mllm = build_model({"name": "mllm_9b", "scale": "tiny"})
    return {name: reference_steps(model, 0, 8, STEPS, DEEPSPEED) for name, model in (("clip", clip), ("gpt", gpt), ("mllm", mllm))}


def _steps(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["type"] == "step"]


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("case", list(CASES))
def test_clipping_and_the_schedule_train_as_one_process(runs, references, case):
    steps, expected = _steps(runs[case]), references[case.split("_")[0]]
    assert [r["loss"] for r in steps] == pytest.approx([e.loss for e in expected], rel=1e-4)
    assert [r["lr"] for r in steps] == pytest.approx([e.lr for e in expected], rel=1e-12)
    assert [r["grad_norm"] for r in steps] == pytest.approx([e.grad_norm for e in expected], rel=1e-4)
    assert len({r["lr"] for r in steps}) > 1  # warm-up, then decay
    assert any(e.grad_norm is not None and e.grad_norm > CLIPPING for e in expected)  # clipping clipped


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_step_records_the_metrics_people_look_at(runs, case):
    for record in _steps(runs[case]):
        assert all(isinstance(record[key], float) and record[key] > 0 for key in METRICS), record
        assert record["loss_scale"] == 1.0  # fp32: no loss scaling
        assert record["samples_per_s"] == pytest.approx(8 / record["step_time_s"])
        # CLIP's text, GPT's sequence: 16 tokens; the MLLM's LLM sequence, its image tokens included.
        tokens = tokens_per_sample(build_model({"name": "mllm_9b", "scale": "tiny"})) if case.startswith("mllm") else 16
        assert record["tokens_per_s"] == pytest.approx(tokens * record["samples_per_s"])


@pytest.mark.slow
def test_a_resumed_run_continues_the_schedule_exactly(runs):
    whole, parts = _steps(runs["clip_zero2"]), _steps(runs["stopped"]) + _steps(runs["resumed"])
    for key in ("loss", "lr", "grad_norm"):
        assert [r[key] for r in parts] == [r[key] for r in whole], key


def test_clipping_is_refused_where_several_engines_hold_the_model_and_clip_by_their_own_norms(tmp_path: Path) -> None:
    pipeline = GPT + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=2"]
    clipped = [*TWO_WORKERS, *pipeline, "backend.deepspeed.gradient_clipping=1.0"]
    prepare_run_dir(tmp_path / "zero0", [*clipped, "strategy.zero_stage=0"])  # its hook takes the norm: reduced over the stages
    with pytest.raises(ConfigError, match=r"^backend.deepspeed.gradient_clipping=1: DeepSpeed clips each engine by its own"):
        prepare_run_dir(tmp_path / "zero1", [*clipped, "strategy.zero_stage=1"])  # DeepSpeed's ZeRO-1 clips inside its step


def test_resuming_under_other_training_settings_is_refused(tmp_path: Path) -> None:
    from tests.runtime.test_runtime_checkpoint import _fake_checkpoint

    ddp = [*TWO_WORKERS, *CLIP, "strategy=ddp", "train.steps=4"]
    source = tmp_path / "source"
    prepare_run_dir(source, [*ddp, *SETTINGS])
    _fake_checkpoint(source, 2, 2)
    prepare_run_dir(tmp_path / "same", [*ddp, *SETTINGS, f"train.resume={source}"])  # would resume
    line = rf"^train.resume={source}: its checkpoint was trained under other backend.deepspeed settings$"
    with pytest.raises(ConfigError, match=line):
        prepare_run_dir(tmp_path / "other", [*ddp, *SETTINGS, "backend.deepspeed.gradient_clipping=2.0", f"train.resume={source}"])
