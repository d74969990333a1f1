"""Interleaved data on the real backend: sequences that hold their samples' images (none to
several, drawn as the simulator draws them, at the nominal side or at the sides it draws,
or read from tar shards) train exactly like one process, in data order, reordered by
DistTrain's plan, with a frozen encoder, with the encoder on two pipeline stages, under
Megatron-LM's pipeline, and balanced by each train.balance policy (every step placed anew); a
data-parallel rank whose micro-batch holds no image takes part in every collective of the
encoder and generator (ZeRO-0 and ZeRO-3), under a short timeout. All runs share ONE
launch of four workers but ZeRO-3's, which has a launch of two.
"""

from __future__ import annotations

import functools
import tarfile
from pathlib import Path

import pytest

from src.data.interleaved import sampler
from src.metrics import unit_flops
from src.models.registry import build_model
from src.runtime.reference import reference_losses
from tests.conftest import run_cli
from tests.runtime.support import launch_cases, mllm_shard, sensitive, sensitive_optimizer, summary_of

pytestmark = pytest.mark.slow  # starts worker processes

STEPS = 2  # an update and the loss after it (optimizer state over several updates: test_runtime_equality)
# ZeRO-3 pays a collective per module fetch (10-15 s a step on four workers sharing two cores):
# its case runs on two workers of its own (half the time).
ZERO3 = ["strategy=ddp", "strategy.zero_stage=3", "cluster.devices_per_node=2"]
BATCH = 8
WORKERS = 4
# Per sample of the shard: DDP's rank 3 (samples 6-7) and DistTrain's encoder micro-batch 3
# hold no image.
SHARD_IMAGES = [2, 1, 3, 0, 1, 2, 0, 0]
# Every sampled image at the encoder's nominal side, which the real backend runs.
MODEL = {"name": "mllm_9b", "scale": "tiny", "train_projectors": True, "images_per_sequence": 2, "image_size_spread": 0}
BASE = [
    "backend=torch",
    "cluster=local",
    "logger=none",
    "model=mllm_9b",
    "model.scale=tiny",
    "model.train_projectors=true",
    "model.images_per_sequence=2",
    "model.image_size_spread=0",
    f"train.global_batch={BATCH}",
    f"train.steps={STEPS}",
    *sensitive(0.3),
    "backend.timeout_s=30",  # a rank left out of a collective fails the run soon
]
DRAWN = "model.image_size_spread=0.3"
# The orchestrator's plan on 4 workers: encoder dp 1, LLM dp 2, generator dp 1 (a U-Net runs whole).
DISTTRAIN = ["strategy=disttrain", "train.data=interleaved", "strategy.generator.pp=1"]
CASES: dict[str, list[str]] = {
    "in_order": DISTTRAIN + ["strategy.reorder=none"],
    "reordered": DISTTRAIN + ["strategy.reorder=both"],
    "frozen_encoder": DISTTRAIN + ["strategy.reorder=both", "model.frozen=[encoder]"],
    # TP peers share a micro-batch's images: the encoder's broadcast the gradient returned to
    # them as the real images' rows only; the LLM's each take the image tokens from the broker.
    "encoder_tp2": DISTTRAIN + ["strategy.encoder.tp=2", "strategy.encoder.sequence_parallel=false"],
    "llm_tp2": DISTTRAIN + ["strategy.llm.tp=2", "strategy.llm.sequence_parallel=false"],
    # Under sequence parallelism the embedding places each row's image tokens, then keeps its part.
    "llm_tp2_sequence_parallel": DISTTRAIN + ["strategy.llm.tp=2", "strategy.llm.sequence_parallel=true"],
    "shards": DISTTRAIN + ["strategy.reorder=none", "backend.data=SHARDS"],
    # The encoder's two stages pass each micro-batch's real images' token states (none for
    # its micro-batch 3).
    "encoder_pp2_shards": DISTTRAIN + ["strategy.reorder=none", "strategy.encoder.pp=2", "backend.data=SHARDS"],
    # Images at the sides the sampler draws (the model's default spread): the encoder runs
    # each at its own, packed; its two stages pass the packed token states, its TP peers
    # the packed image tokens.
    "drawn_sides": DISTTRAIN + ["strategy.reorder=both", DRAWN],
    "drawn_sides_encoder_pp2": DISTTRAIN + ["strategy.reorder=none", "strategy.encoder.pp=2", DRAWN],
    "drawn_sides_encoder_tp2": DISTTRAIN + ["strategy.encoder.tp=2", "strategy.encoder.sequence_parallel=false", DRAWN],
    # Both: each TP peer of the encoder's first stage passes the packed token states whole to
    # its peer on the second (six workers: the encoder's four, the LLM's and the generator's).
    "encoder_tp2_pp2": DISTTRAIN
    + [
        "cluster.devices_per_node=6",
        "strategy.encoder.tp=2",
        "strategy.encoder.pp=2",
        "strategy.encoder.sequence_parallel=false",
        "strategy.llm.dp=1",
        "strategy.generator.dp=1",
    ],
    "ddp_zero0_no_image": ["strategy=ddp", "strategy.zero_stage=0", "backend.data=SHARDS"],
    # Megatron-LM on the same data: its two replicas' micro-batches carry their own images
    # (rank classes per replica in the plan), the encoder in the first stage, the generator
    # in the last.
    "megatron": [
        "strategy=megatron",
        "train.data=interleaved",
        "strategy.modality_stages=merged",
        "strategy.tp=1",
        "strategy.pp=2",
        "strategy.micro_batch_size=1",
    ],
    # Balanced (train.balance): every step's sequences placed anew by the policy on that step's
    # loads; where a sample runs changes, what the step learns does not.
    "megatron_cost": [
        "strategy=megatron",
        "train.data=interleaved",
        "train.balance=cost",
        "strategy.modality_stages=merged",
        "strategy.tp=1",
        "strategy.pp=2",
        "strategy.micro_batch_size=1",
    ],
    # The plan chosen on the data (strategy.choose_on=data): the searched shapes priced on the
    # first batch under the policy, the fastest there run.
    "megatron_cost_on_data": [
        "strategy=megatron",
        "train.data=interleaved",
        "train.balance=cost",
        "strategy.modality_stages=merged",
        "strategy.choose_on=data",
    ],
    "ddp_zero0_reorder_shards": [
        "strategy=ddp",
        "strategy.zero_stage=0",
        "strategy.micro_batch_size=1",
        "train.balance=reorder",
        "backend.data=SHARDS",
    ],
    # ZeRO-3 gathers every layer's weights on every rank, also for a micro-batch of no image
    # (three of the shard's eight sequences hold none, one a micro-batch wherever they go).
    "ddp_zero3_cost_shards": ZERO3
    + [
        "strategy.micro_batch_size=1",
        "train.balance=cost",
        "backend.data=SHARDS",
    ],
    "disttrain_cost": DISTTRAIN + ["train.balance=cost"],
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("shards")
    mllm_shard(root / "shard-0.tar", SHARD_IMAGES)
    return f"{root}/shard-*.tar"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shards) -> dict[str, Path]:
    cases = {name: BASE + [o.replace("SHARDS", shards) for o in overrides] for name, overrides in CASES.items()}
    by_workers: dict[int, dict[str, list[str]]] = {}
    for name, overrides in cases.items():
        workers = next((int(o.split("=")[1]) for o in overrides if o.startswith("cluster.devices_per_node=")), WORKERS)
        by_workers.setdefault(workers, {})[name] = overrides
    root = tmp_path_factory.mktemp("interleaved")
    dirs: dict[str, Path] = {}
    for workers, group in by_workers.items():  # one launch per worker count
        dirs |= launch_cases(root, group, workers)
    return dirs


@functools.cache
def _reference(data: str, frozen: tuple[str, ...] = (), spread: float = 0.0) -> list[float]:
    model = build_model(MODEL | {"frozen": list(frozen), "image_size_spread": spread})
    return reference_losses(model, 0, BATCH, STEPS, sensitive_optimizer(0.3), data=data, content="interleaved")


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, shards, case):
    data = shards if "backend.data=SHARDS" in CASES[case] else "synthetic"
    frozen = ("encoder",) if case == "frozen_encoder" else ()
    expected = _reference(data, frozen, 0.3 if DRAWN in CASES[case] else 0.0)
    assert summary_of(runs[case])["measured"]["loss"] == pytest.approx(expected, rel=1e-4)
    assert expected[-1] != pytest.approx(expected[0], rel=1e-3)  # it trains, so equality says something
    if frozen:
        assert expected != pytest.approx(_reference(data), rel=1e-6)


def test_micro_batches_differ_in_encoder_load_and_the_plan_reorders_them(runs):
    plan = summary_of(runs["reordered"])["plan"]
    assert plan["sample_order"] != sorted(plan["sample_order"])
    assert summary_of(runs["in_order"])["plan"]["sample_order"] == list(range(BATCH))
    assert plan["units"]["encoder"]["max_load"] > 1
    assert summary_of(runs["reordered"])["breakdown_s"]["comm_broker"] > 0


def _model_flops(images: float) -> float:
    """An iteration's model FLOPs on sequences of `images` images on average: the encoder
    and the generator are built for the model's 2 a sequence and work per image."""
    model = build_model(MODEL)
    return BATCH * sum(
        (f.fwd + f.bwd) * (images / 2 if unit.arch.per_image else 1) for unit in model.units for f in [unit_flops(model, unit)]
    )


def test_the_mfu_counts_the_images_the_measured_steps_held(runs):
    """Every step reads the shard's 8 samples (the data wraps around): 1.125 images a
    sequence, not the model's 2; the sampler's steps hold their own draws. The MFU's FLOPs
    count the measured steps' (those after the first)."""
    shards = summary_of(runs["shards"])
    assert shards["measured"]["images_per_sequence"] == [sum(SHARD_IMAGES) / BATCH] * STEPS
    assert shards["images_per_sequence"] == 1.125
    assert shards["model_flops_per_iteration"] == pytest.approx(_model_flops(1.125), rel=1e-12)
    assert _model_flops(1.125) < 0.8 * _model_flops(2)  # the images' share: the equality says something
    for case in ("encoder_pp2_shards", "ddp_zero0_no_image", "ddp_zero3_cost_shards"):
        assert summary_of(runs[case])["model_flops_per_iteration"] == shards["model_flops_per_iteration"]
    drawn = sampler(build_model(MODEL), 0)
    per_step = [sum(drawn.layout(i).images for i in range(s * BATCH, (s + 1) * BATCH)) / BATCH for s in range(STEPS)]
    synthetic = summary_of(runs["in_order"])
    assert synthetic["measured"]["images_per_sequence"] == per_step
    mean = sum(per_step[1:]) / (STEPS - 1)
    assert synthetic["images_per_sequence"] == pytest.approx(mean, rel=1e-12) and mean != 2
    assert synthetic["model_flops_per_iteration"] == pytest.approx(_model_flops(mean), rel=1e-12)
    iteration = shards["iteration_time_s"] * shards["devices"] * shards["peak_flops_per_device"]
    assert shards["mfu"] == pytest.approx(_model_flops(1.125) / iteration, rel=1e-12)


def test_a_shard_sample_with_images_but_no_text_is_one_line_exit_2(tmp_path):
    mllm_shard(tmp_path / "shard-0.tar", [1, 2])
    with tarfile.open(tmp_path / "shard-1.tar", "w") as tar:
        tar.add(tmp_path / "shard-0.tar", arcname="s009.0.png")  # an image (its bytes do not matter) without s009.txt
    result = run_cli(*BASE, *CASES["shards"][:-1], f"backend.data={tmp_path}/shard-*.tar", f"hydra.run.dir={tmp_path}/run")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: backend.data: shard {tmp_path}/shard-1.tar sample s009: 1 image(s) but no text (s009.txt) "
        "(backend.data_errors=skip leaves bad members out)"
    ]


def test_a_balanced_run_places_the_sequences_where_the_policy_says(runs):
    for case, policy in (("megatron_cost", "cost"), ("ddp_zero3_cost_shards", "cost"), ("ddp_zero0_reorder_shards", "reorder")):
        plan = summary_of(runs[case])["plan"]
        assert plan["balance_policy"] == policy and sorted(plan["sample_order"]) == list(range(BATCH))
    # One sequence per micro-batch, and samples 3, 6 and 7 of the shard hold no image: some
    # balanced micro-batch holds none, and its rank takes part in every collective all the same.
    assert summary_of(runs["ddp_zero3_cost_shards"])["plan"]["sample_order"] != list(range(BATCH))
