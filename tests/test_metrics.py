"""One FLOPs definition: model FLOPs, hardware FLOPs with recomputation, frozen units, MFU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.config import TrainSpec
from src.metrics import build_summary, iteration_flops, unit_flops, unit_model_flops
from src.mesh import Mesh
from src.models.registry import build_model
from src.program import Plan, Program, UnitPlan
from src.timeline import BREAKDOWN_CATEGORIES, RankTimeline, Timeline
from tests.costmodel.test_costmodel import CLUSTER


def _plan(model, batch: int, recompute: str = "none") -> Plan:
    mesh = Mesh.contiguous((("dp", 4),))
    units = [
        UnitPlan(
            u.name,
            mesh,
            micro_batch=1,
            num_microbatches=batch // 4,
            batch_per_replica=batch // 4,
            stage_layers=((0, u.num_layers),),
            sample_groups=batch // 4,
            recompute=recompute,
        )
        for u in model.units
    ]
    return Plan("test", devices=4, units=units, program=Program(world_size=4, classes=[]), precision="bf16")


def _train(batch: int, contrastive: int | None = None) -> TrainSpec:
    return TrainSpec(global_batch=batch, contrastive_batch=contrastive or batch, seq_len=None, precision="bf16", steps=1, seed=0)


def test_gpt_model_flops_are_three_forward_passes_of_the_standard_count() -> None:
    s, h, layers, vocab, batch = 2048, 1024, 4, 32000, 16
    model = build_model({"name": "gpt", "preset": None, "layers": layers, "hidden": h, "heads": 16, "vocab": vocab})
    forward = layers * (24 * s * h * h + 4 * s * s * h) + 2 * s * h * vocab  # blocks + logits
    assert unit_flops(model, model.unit("llm")).fwd == pytest.approx(forward)
    model_flops, hardware = iteration_flops(model, _plan(model, batch), _train(batch))
    assert model_flops == pytest.approx(3 * forward * batch)
    assert hardware == model_flops
    # Full recomputation re-runs the blocks' forwards, not the logits'.
    _, with_recompute = iteration_flops(model, _plan(model, batch, "full"), _train(batch))
    assert with_recompute == pytest.approx((4 * forward - 2 * s * h * vocab) * batch)


def test_a_locked_tower_counts_its_forward_only() -> None:
    lit = build_model({"name": "lit", "scale": "tiny"})
    clip = build_model({"name": "clip", "scale": "tiny"})
    vision_lit = unit_flops(lit, lit.unit("vision"))
    assert vision_lit.bwd == 0.0 and vision_lit.fwd > 0
    text = unit_flops(clip, clip.unit("text"))
    # Trainable: weight GEMMs have an input- and a weight-gradient GEMM, attention products
    # two input gradients: backward is exactly twice the forward.
    assert text.bwd == pytest.approx(2 * text.fwd)


def test_contrastive_flops_follow_the_contrastive_batch() -> None:
    clip = build_model({"name": "clip", "scale": "tiny"})
    small = unit_flops(clip, clip.unit("interaction"), contrastive_batch=32).fwd
    large = unit_flops(clip, clip.unit("interaction"), contrastive_batch=64).fwd
    assert large == pytest.approx(2 * small)


def test_summary_figures_are_consistent() -> None:
    model = build_model({"name": "gpt", "preset": None, "layers": 2, "hidden": 256, "heads": 4, "vocab": 1000})
    plan = _plan(model, 8)
    seconds = 0.5
    breakdown = {cat: 0.0 for cat in BREAKDOWN_CATEGORIES} | {"compute": 0.4, "comm_dp": 0.1}
    timeline = Timeline(
        seconds, [RankTimeline((0, 1, 2, 3), "all", ("llm",), [], breakdown, seconds, peak_memory_bytes=2**30, memory={"total": 1.0})]
    )
    summary = build_summary({"model": "gpt"}, plan, timeline, model, CLUSTER, _train(8))
    flops, _ = iteration_flops(model, plan, _train(8))
    assert summary["mfu"] == pytest.approx(flops / (seconds * 4 * 100e12))
    assert summary["tflops_per_device"] == pytest.approx(flops / seconds / 4 / 1e12)
    assert summary["throughput_samples_per_s"] == pytest.approx(16.0)
    assert sum(summary["breakdown_s"].values()) == pytest.approx(seconds)
    assert summary["peak_memory_gib"] == pytest.approx(1.0)


def test_a_profiler_counts_bubbles_as_communication_and_the_breakdown_does_not() -> None:
    """Two classes of ranks: one waits on its peers (a bubble), the other on a transfer. The
    exposed communication is the transfers'; the profiler's view is all that is not compute."""
    model = build_model({"name": "gpt", "preset": None, "layers": 2, "hidden": 256, "heads": 4, "vocab": 1000})
    zero = {cat: 0.0 for cat in BREAKDOWN_CATEGORIES}
    waits = zero | {"compute": 0.6, "bubble_warmup": 0.3, "comm_pp": 0.1}
    sends = zero | {"compute": 0.8, "comm_pp": 0.1, "idle": 0.1}
    classes = [RankTimeline((0, 1), "first", ("llm",), [], waits, 1.0), RankTimeline((2, 3), "last", ("llm",), [], sends, 1.0)]
    timeline = Timeline(1.0, classes)
    summary = build_summary({"model": "gpt"}, _plan(model, 8), timeline, model, CLUSTER, _train(8))
    assert summary["exposed_comm_s"] == pytest.approx(0.1)
    assert summary["profiled_comm_s"] == pytest.approx(0.3)  # 1.0 - (0.6 + 0.8) / 2


def test_an_mllm_counts_the_images_its_sequences_hold() -> None:
    """The encoder reads a sequence's images and the generator makes one per image: both are
    built for model.images_per_sequence (2) and count the images a plan priced (a batch of
    shards holding 1.125 a sequence) or a run processed; the LLM's sequence is the same."""
    model = build_model({"name": "mllm_9b", "scale": "tiny", "images_per_sequence": 2})
    assert [u.name for u in model.units if u.arch.per_image] == ["encoder", "generator"]
    nominal = _plan(model, 8)
    priced = replace(nominal, sample_images=(2, 1, 3, 0, 1, 2, 0, 0), images_per_sequence=1.125)
    train = _train(8)
    full = unit_model_flops(model, nominal, train)
    share = 1.125 / 2
    expected = {"encoder": full["encoder"] * share, "llm": full["llm"], "generator": full["generator"] * share}
    assert unit_model_flops(model, priced, train) == pytest.approx(expected)
    assert unit_model_flops(model, nominal, train, images=1.125) == pytest.approx(expected)  # a real run's measured mean
    assert unit_model_flops(model, priced, train, images=3) == pytest.approx(
        {u: f * (1.5 if u != "llm" else 1) for u, f in full.items()}
    )
    model_flops, hardware = iteration_flops(model, priced, train)
    assert model_flops == pytest.approx(sum(expected.values())) and hardware == model_flops
    seconds = 0.5
    breakdown = {cat: 0.0 for cat in BREAKDOWN_CATEGORIES} | {"compute": seconds}
    timeline = Timeline(seconds, [RankTimeline((0, 1, 2, 3), "all", ("llm",), [], breakdown, seconds, memory={"total": 1.0})])
    summary = build_summary({}, priced, timeline, model, CLUSTER, train)
    assert summary["model_flops_per_iteration"] == pytest.approx(model_flops) and summary["images_per_sequence"] == 1.125
    assert "images_per_sequence" not in build_summary({}, nominal, timeline, model, CLUSTER, train)
