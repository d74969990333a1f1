"""Loss equality of real runs: every plan must train exactly like one process.

With the same seed, initial weights and global batch, the first 5 losses of each plan
equal the single-process reference within 1e-4 relative. All plans run back to back in
ONE launch of two workers (start-up, the slow part on 2 cores, is paid once).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from src.models.registry import build_model
from src.runtime.reference import reference_losses
from src.timeline import BREAKDOWN_CATEGORIES
from tests.runtime.support import CLIP, GPT, TINY_UNET, TWO_WORKERS, UNET, launch_cases, sensitive, sensitive_optimizer

pytestmark = pytest.mark.slow  # starts worker processes

STEPS = 5
# With AdamW's usual eps the first updates are nearly sign(gradient), blind to a wrong
# gradient scale; eps = 1 and lr = 1 make updates proportional to the gradients.
SENSITIVE = sensitive()
# Every tensor partitioned: the tiny models' are all below DeepSpeed's default persistence threshold.
ZERO3 = ["strategy=ddp", "strategy.zero_stage=3", "strategy.param_persistence_threshold=0"]
# Megatron-Core's overlaps under its distributed optimizer (the executor's, a bucket per layer).
SHARDED_OVERLAPPED = GPT + [
    "strategy=megatron",
    "strategy.tp=1",
    "strategy.pp=1",
    "strategy.micro_batch_size=2",
    "strategy.zero_stage=1",
    "strategy.overlap_grad_reduce=true",
    "strategy.overlap_param_gather=true",
]
CASES = {
    "ddp_zero0": CLIP + ["strategy=ddp", "strategy.zero_stage=0"],
    "ddp_zero1": CLIP + ["strategy=ddp", "strategy.zero_stage=1"],
    "ddp_zero2": CLIP + ["strategy=ddp", "strategy.zero_stage=2"],
    "ddp_zero3": CLIP + ZERO3,
    # Batches made ahead by a producer process beside each worker (DistTrain's disaggregated preprocessing).
    "ddp_zero1_disaggregated": CLIP + ["strategy=ddp", "strategy.zero_stage=1", "backend.preprocess=disaggregated"],
    "coca_ddp_zero1": CLIP + ["model=coca", "strategy=ddp", "strategy.zero_stage=1"],  # + captioning loss
    "lit_ddp_zero2": CLIP + ["model=lit", "strategy=ddp", "strategy.zero_stage=2"],  # frozen image tower
    "megatron_tp2": CLIP + ["strategy=megatron", "strategy.tp=2"],
    # Token states split by sequence between the layers.
    "megatron_tp2_sequence_parallel": GPT + ["strategy=megatron", "strategy.tp=2", "strategy.sequence_parallel=true"],
    "megatron_pp2_1f1b": GPT
    + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=2", "strategy.schedule=1f1b"],
    "megatron_pp2_gpipe": GPT
    + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=2", "strategy.schedule=gpipe"],
    # Stage 0 runs three forwards ahead of its first backward, not one: what it sends queues.
    "megatron_pp2_extra_warmup": GPT
    + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=1", "strategy.extra_warmup=2"],
    # Each layer's gradients all-reduced over dp 2 as the last micro-batch's backward finishes it.
    "megatron_dp2_overlap_grad_reduce": GPT
    + [
        "strategy=megatron",
        "strategy.tp=1",
        "strategy.pp=1",
        "strategy.micro_batch_size=2",
        "strategy.zero_stage=0",
        "strategy.overlap_grad_reduce=true",
    ],
    # Megatron-Core's overlaps under its distributed optimizer (the executor's, a bucket per
    # layer): each layer's gradients reduce-scattered as the last backward finishes them, its
    # parameters gathered before its first forward of the next step.
    "megatron_dp2_distributed_optimizer_overlapped": SHARDED_OVERLAPPED,
    # The same under fp16 (the gradients it reduced before the loss scale was taken off the
    # parameters' are unscaled too) and bf16.
    "megatron_dp2_distributed_optimizer_fp16": SHARDED_OVERLAPPED + ["train.precision=fp16"],
    "megatron_dp2_distributed_optimizer_bf16": SHARDED_OVERLAPPED + ["train.precision=bf16"],
    "megatron_pp2_recompute": GPT
    + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=2", "strategy.recompute=full"],
    # Two micro-batches per step: ZeRO-3 accumulates their gradient partitions.
    "ddp_zero3_accumulation": GPT + [*ZERO3, "strategy.micro_batch_size=2"],
    # Each layer's gradients all-reduced as the last micro-batch's backward finishes them.
    "ddp_zero0_overlap": GPT + ["strategy=ddp", "strategy.zero_stage=0", "strategy.micro_batch_size=2", "strategy.overlap_comm=true"],
    # DeepSpeed overlaps the reduce-scatters and prefetches 1000 parameters ahead.
    "ddp_zero3_overlap": GPT + [*ZERO3, "strategy.overlap_comm=true", "strategy.prefetch_bucket_size=1000"],
    "ddp_zero3_recompute": GPT + [*ZERO3, "strategy.recompute=selective"],
    "deepspeed3d_tp2": GPT + ["strategy=deepspeed3d", "strategy.tp=2", "strategy.pp=1", "strategy.micro_batch_size=2"],
    # DeepSpeed's pipeline engine's exchange (deepspeed3d's p2p): each send in its schedule
    # step's order, a blocking send the receiver has posted for.
    "deepspeed3d_pp2": GPT
    + ["strategy=deepspeed3d", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=2", "strategy.recompute=none"],
    # DeepSpeed's pipeline engine (deepspeed3d's grad_all_reduce): the whole gradient
    # all-reduced over the two replicas, each stepping its slice and gathering the rest.
    "deepspeed3d_dp2": GPT
    + ["strategy=deepspeed3d", "strategy.tp=1", "strategy.pp=1", "strategy.micro_batch_size=2", "strategy.zero_stage=1"],
    # bf16 GEMMs (autocast, fp32 master weights and gradients); activations cross the
    # pipeline stage in bf16.
    "ddp_zero1_bf16": GPT + ["strategy=ddp", "strategy.zero_stage=1", "train.precision=bf16"],
    "megatron_pp2_bf16": GPT
    + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=2", "train.precision=bf16"],
    # fp16 GEMMs with dynamic loss scaling: scaled gradients cross the pipeline stage in fp16.
    "ddp_zero0_fp16": GPT + ["strategy=ddp", "strategy.zero_stage=0", "train.precision=fp16"],
    # A U-Net's skips and timestep embedding cross the pieces its pass runs in: ZeRO-3's
    # layer-by-layer Computes (Par4D Fig 12's baseline), the backward's per-layer parts of
    # an overlapped ZeRO-0 reduction; ZeRO-2, and two micro-batches with full recomputation.
    "unet_ddp_zero3_overlap": UNET + [*ZERO3, "strategy.overlap_comm=true", "strategy.prefetch_bucket_size=10000"],
    "unet_ddp_zero0_overlap": UNET
    + ["strategy=ddp", "strategy.zero_stage=0", "strategy.overlap_comm=true", "strategy.micro_batch_size=2"],
    "unet_ddp_zero2": UNET + ["strategy=ddp", "strategy.zero_stage=2"],
    "unet_megatron_dp2_recompute": UNET
    + ["strategy=megatron", "strategy.tp=1", "strategy.pp=1", "strategy.micro_batch_size=2", "strategy.recompute=full"],
    "megatron_pp2_fp16": GPT
    + ["strategy=megatron", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=2", "train.precision=fp16"],
}
# Megatron-LM balanced (Optimus App. B) on a GPT whose head is heavy enough that the stages of
# equal FLOPs are not the even cut: the embedding (a lookup, no FLOPs) and four blocks, then the head.
BALANCED_VOCAB = 4096
BALANCED = GPT + [
    f"model.vocab={BALANCED_VOCAB}",
    "strategy=megatron",
    "strategy.tp=1",
    "strategy.pp=2",
    "strategy.vpp=1",
    "strategy.micro_batch_size=2",
    "strategy.balance=true",
]
# At this loss scale every step's gradients overflow fp16: each is skipped on every rank,
# also by the executor's distributed optimizer, which drops what it reduced in the backward.
OVERFLOW = GPT + ["strategy=ddp", "strategy.zero_stage=0", "train.precision=fp16", "backend.deepspeed.fp16.initial_scale_power=100"]
OVERFLOW_SHARDED = SHARDED_OVERLAPPED + ["train.precision=fp16", "backend.deepspeed.fp16.initial_scale_power=100"]
# The bf16 runs against a bf16 single-process reference: rounding the payloads that cross
# ranks to bf16 (which the reference never does) may move the losses by about 1e-4 here.
# (A contrastive loss is more sensitive: CLIP's features gathered in bf16 move it by ~4e-3
# with these large updates, as much as bf16 against fp32 does, so no CLIP case is here.)
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-3, "fp16": 1e-3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    all_cases = {**CASES, "fp16_overflow": OVERFLOW, "fp16_overflow_sharded": OVERFLOW_SHARDED, "megatron_pp2_balanced": BALANCED}
    cases = {name: TWO_WORKERS + overrides + [f"train.steps={STEPS}"] + SENSITIVE for name, overrides in all_cases.items()}
    return launch_cases(tmp_path_factory.mktemp("equality"), cases, 2)


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(r["step_time_s"] > 0 for r in steps)
    return [r["loss"] for r in steps]


def _gpt(vocab: int = 128):
    """The tiny GPT of the GPT cases (tests.runtime.support.GPT), at `vocab`."""
    return build_model({"name": "gpt", "preset": None, "layers": 4, "hidden": 64, "heads": 4, "vocab": vocab}, 16)


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    models = {name: build_model({"name": name, "scale": "tiny"}) for name in ("clip", "coca", "lit")}
    models["gpt"] = _gpt()
    models["unet"] = build_model({"name": "unet", "preset": None, **TINY_UNET}, None)
    return {
        (name, precision): reference_losses(model, 0, 8, STEPS, sensitive_optimizer(), precision=precision)
        for name, model in models.items()
        for precision in ("fp32", "bf16", "fp16")
        if precision == "fp32" or any(_setting(c, "model") == name and _setting(c, "train.precision") == precision for c in CASES)
    }


def _setting(case: str, key: str, default: str = "fp32") -> str:
    return ([o.split("=")[1] for o in CASES[case] if o.startswith(f"{key}=")] or [default])[-1]


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, references, case):
    precision = _setting(case, "train.precision")
    expected = references[(_setting(case, "model"), precision)]
    assert _losses(runs[case]) == pytest.approx(expected, rel=TOLERANCE[precision])
    if precision != "fp32":  # and it is not the fp32 run under another name
        assert _losses(runs[case]) != pytest.approx(references[(_setting(case, "model"), "fp32")], rel=1e-6)


def test_an_fp16_step_whose_gradients_overflow_is_skipped_on_every_rank(runs, references):
    gpt = _gpt()
    never_updated = reference_losses(gpt, 0, 8, STEPS, sensitive_optimizer(1e-30), precision="fp16")
    assert _losses(runs["fp16_overflow"]) == pytest.approx(never_updated, rel=1e-3)
    assert _losses(runs["fp16_overflow_sharded"]) == pytest.approx(never_updated, rel=1e-3)
    assert never_updated != pytest.approx(references[("gpt", "fp16")], rel=1e-3)


def test_a_balanced_pipeline_cut_unevenly_trains_as_one_process(runs):
    plan = json.loads((runs["megatron_pp2_balanced"] / "summary.json").read_text())["plan"]
    assert plan["units"]["llm"]["stage_layers"] == [[0, 5], [5, 6]]  # not the even [0, 3), [3, 6)
    gpt = _gpt(BALANCED_VOCAB)
    expected = reference_losses(gpt, 0, 8, STEPS, sensitive_optimizer())
    assert _losses(runs["megatron_pp2_balanced"]) == pytest.approx(expected, rel=TOLERANCE["fp32"])


def test_the_reference_learns(references):
    # Otherwise equality would hold for a runtime that never updates its weights.
    gpt = references[("gpt", "fp32")]
    assert len(set(gpt)) == STEPS and gpt[-1] < gpt[0]


def test_measured_summary_adds_up_and_shows_the_communication_of_each_plan(runs):
    for case, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["backend"] == "torch" and 0 < summary["mfu"] < 1
        assert summary["peak_flops_per_device"] > 1e8
        breakdown = summary["breakdown_s"]
        assert set(breakdown) == set(BREAKDOWN_CATEGORIES)
        assert sum(breakdown.values()) == pytest.approx(summary["iteration_time_s"], rel=1e-6)
        assert (run_dir / "trace.json").exists()
    # The launch's workers timed their GEMMs once per precision, in its first run of it.
    peaks: dict[str, set[float]] = {}
    for run_dir in runs.values():
        summary = json.loads((run_dir / "summary.json").read_text())
        peaks.setdefault(summary["precision"], set()).add(summary["measured_gemm_flops_per_device"])
    assert set(peaks) == {"fp32", "bf16", "fp16"} and all(len(measured) == 1 for measured in peaks.values()), peaks
    assert json.loads((runs["megatron_tp2"] / "summary.json").read_text())["breakdown_s"]["comm_tp"] > 0
    zero0 = json.loads((runs["ddp_zero0"] / "summary.json").read_text())
    assert zero0["breakdown_s"]["comm_dp"] > 0 and zero0["measured_notes"] == []
    # DeepSpeed's reductions inside backward under ZeRO-2 are timed at its communication backend.
    zero2 = json.loads((runs["ddp_zero2"] / "summary.json").read_text())
    assert zero2["breakdown_s"]["comm_dp"] > 0 and zero2["measured_notes"] == []
    # The executor's own overlapped gradient all-reduces are DP communication, not compute.
    overlapped = json.loads((runs["megatron_dp2_overlap_grad_reduce"] / "summary.json").read_text())
    assert overlapped["breakdown_s"]["comm_dp"] > 0
    sequence = json.loads((runs["megatron_tp2_sequence_parallel"] / "summary.json").read_text())
    assert sequence["breakdown_s"]["comm_tp"] > 0
    pipeline = json.loads((runs["megatron_pp2_1f1b"] / "summary.json").read_text())["breakdown_s"]
    assert pipeline["bubble_warmup"] + pipeline["bubble_cooldown"] > 0
