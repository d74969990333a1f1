"""FLOPs, MFU and the run summary: one definition for every strategy and backend.

Model FLOPs of an iteration = forward + backward matmul and attention FLOPs of every unit
for the samples it really processes; recomputation is not counted (it is in the hardware
FLOPs, HFU); a frozen unit has no weight-gradient FLOPs and, when nothing upstream of it
trains, no backward at all. MFU = model FLOPs / (iteration time x devices x peak).

An MLLM's units that work per image (its encoder and generator) are built for the model's
images per sequence; where a run's sequences hold another number on average (a real run's
interleaved data or shards, a plan priced on the shards' images) they count that many.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Iterator

from src.cluster import GIB, ClusterSpec
from src.config import TrainSpec
from src.costmodel.memory import rank_memory
from src.models.spec import ModelSpec, UnitSpec
from src.program import Plan, UnitPlan
from src.timeline import BREAKDOWN_CATEGORIES, Timeline

if TYPE_CHECKING:
    from src.plan_io import PlannedRun


@dataclass(frozen=True)
class UnitFlops:
    """Per-sample matmul FLOPs of one unit (or layer): forward, backward, and what
    recomputation adds in each mode."""

    fwd: float
    bwd: float
    recompute_full: float
    recompute_selective: float
    backward_recompute: float = 0.0  # FlashAttention's QK^T re-run in backward (hardware FLOPs only)

    def hardware(self, recompute: str, backward: bool) -> float:
        """What the GPU computes: forward, backward and what `recompute` and the backward
        re-run (nothing re-runs where no backward does)."""
        extra = {"full": self.recompute_full, "selective": self.recompute_selective}.get(recompute, 0.0) + self.backward_recompute
        return self.fwd + self.bwd + (extra if backward else 0.0)


def layer_flops(model: ModelSpec, unit: UnitSpec, index: int, contrastive_batch: int = 1) -> UnitFlops:
    """Per-sample matmul FLOPs of one layer of `unit`. Full recomputation re-runs the
    blocks' forwards only (LayerSpec.block)."""
    layer = unit.layers[index]
    input_grad = model.needs_input_grad(unit.name, index)
    fwd = bwd = core = rerun = blocks = 0.0
    for kernel in layer.kernels:
        flops = kernel.flops(contrastive_batch)
        fwd += flops
        if layer.forward_only:
            continue
        if layer.block:
            blocks += flops
        if kernel.attention_core and (input_grad or unit.trains(layer)):
            core += flops
        if kernel.backward_recompute and (input_grad or unit.trains(layer)):
            rerun += flops
        if input_grad:
            bwd += flops if kernel.has_weight else 2 * flops
        if kernel.has_weight and unit.trains(layer):
            bwd += flops
    return UnitFlops(fwd, bwd, recompute_full=blocks, recompute_selective=core, backward_recompute=rerun)


def unit_flops(model: ModelSpec, unit: UnitSpec, contrastive_batch: int = 1) -> UnitFlops:
    """Per-sample matmul FLOPs of a unit: its layers' summed."""
    layers = [layer_flops(model, unit, index, contrastive_batch) for index in range(unit.num_layers)]
    return UnitFlops(*(sum(getattr(f, field.name) for f in layers) for field in fields(UnitFlops)))


def counted_images(plan: Plan, images: float | None) -> float | None:
    """The mean images per sequence the FLOPs count: `images`, what a run processed, where
    its backend knows them; else what the plan's Program prices (None: the model's)."""
    return plan.images_per_sequence if images is None else images


def image_share(unit: UnitSpec, images: float | None) -> float:
    """The share of its nominal work a unit does on sequences of `images` images on average
    (None: the model's): a unit that works per image does images / the images it is built
    for; any other unit all of it."""
    if images is None or not unit.arch.per_image:
        return 1.0
    return images / unit.arch.images


def _unit_terms(model: ModelSpec, plan: Plan, train: TrainSpec, images: float | None) -> Iterator[tuple[UnitPlan, UnitFlops, float]]:
    """Each unit's plan, its per-sample FLOPs and how many samples' work it does in one
    iteration: every sample of the global batch once (an interaction unit's similarity
    products span its contrastive batch), per image for the images counted."""
    counted = counted_images(plan, images)
    for unit_plan in plan.units:
        unit = model.unit(unit_plan.unit)
        contrastive = train.contrastive_batch if unit.name == model.interaction else 1
        yield unit_plan, unit_flops(model, unit, contrastive), train.global_batch * image_share(unit, counted)


def iteration_flops(model: ModelSpec, plan: Plan, train: TrainSpec, images: float | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one iteration (`images`: the mean images per
    sequence the run processed; None: what the plan prices)."""
    model_flops = hardware = 0.0
    for unit_plan, per_sample, samples in _unit_terms(model, plan, train, images):
        model_flops += samples * (per_sample.fwd + per_sample.bwd)
        hardware += samples * per_sample.hardware(unit_plan.recompute, model.needs_backward(unit_plan.unit))
    return model_flops, hardware


def unit_model_flops(model: ModelSpec, plan: Plan, train: TrainSpec, images: float | None = None) -> dict[str, float]:
    """Model FLOPs of one iteration per unit (the terms iteration_flops adds up)."""
    return {u.unit: samples * (f.fwd + f.bwd) for u, f, samples in _unit_terms(model, plan, train, images)}


def unit_utilisation(
    model: ModelSpec, plan: Plan, timeline: Timeline, train: TrainSpec, peak: float, images: float | None = None
) -> dict[str, float]:
    """Per unit, the GPU utilisation while it computes (DistMM §7.2, Figures 8-9): its model
    FLOPs over peak x the device-seconds its forward, backward and interaction work took
    (every rank of a class counted; optimizer steps excluded)."""
    seconds: dict[str, float] = {}
    for rank_timeline in timeline.ranks:
        for span in rank_timeline.spans:
            if span.category == "compute" and span.unit and not span.name.startswith("optimizer"):
                seconds[span.unit] = seconds.get(span.unit, 0.0) + (span.end - span.start) * len(rank_timeline.ranks)
    flops = unit_model_flops(model, plan, train, images)
    return {unit: flops[unit] / (busy * peak) for unit, busy in seconds.items() if busy > 0 and unit in flops}


def attach_memory(timeline: Timeline, plan: Plan, model: ModelSpec, precision: str, amp: bool) -> None:
    """Fill each rank class's memory from the plan (both backends report the estimate;
    the real backend adds what it measured)."""
    units = {u.unit: u for u in plan.units}
    for rank_timeline, rank_program in zip(timeline.ranks, plan.program.classes):
        memory = rank_memory(rank_program, units, model, precision, amp)
        rank_timeline.memory = {k: v / GIB for k, v in memory.items()}
        rank_timeline.peak_memory_bytes = memory["total"]


def build_summary(
    names: dict[str, str],
    plan: Plan,
    timeline: Timeline,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    images: float | None = None,
) -> dict[str, Any]:
    """The figures of the output contract (docs/design.md), JSON-ready (`images`: the mean
    images per sequence the run processed, where its backend knows them)."""
    seconds = timeline.iteration_time
    devices = plan.devices
    peak = cluster.peak(plan.precision)
    images = counted_images(plan, images)
    model_flops, hardware_flops = iteration_flops(model, plan, train, images)
    worst = max(timeline.ranks, key=lambda r: r.peak_memory_bytes)
    breakdown = timeline.mean_breakdown()
    exposed = sum(v for k, v in breakdown.items() if k.startswith("comm_"))
    return {
        **names,
        "devices": devices,
        "global_batch": train.global_batch,
        "contrastive_batch": train.contrastive_batch,
        "precision": plan.precision,
        "peak_flops_per_device": peak,
        "iteration_time_s": seconds,
        "mfu": model_flops / (seconds * devices * peak),
        "hfu": hardware_flops / (seconds * devices * peak),
        "throughput_samples_per_s": train.global_batch / seconds,
        "tflops_per_device": model_flops / seconds / devices / 1e12,
        "model_flops_per_iteration": model_flops,
        # The images per sequence the FLOPs count, where they are not the model's.
        **({} if images is None else {"images_per_sequence": images}),
        "model_params": model.params,
        "breakdown_s": {k: breakdown[k] for k in BREAKDOWN_CATEGORIES},
        "breakdown_by_unit_s": timeline.unit_breakdown(),
        # The bubbles again, by where they fall on a rank, where the backend tells them apart.
        **({"bubbles_by_position_s": positions} if (positions := timeline.mean_bubble_positions()) else {}),
        "unit_utilisation": unit_utilisation(model, plan, timeline, train, peak, images),
        "comm_share": exposed / seconds,
        "exposed_comm_s": exposed,
        # A GPU profiler's trace (PyTorch Profiler, Nsight) sees every wait of a synchronous
        # step inside a communication kernel, which spins until its peers arrive: its
        # non-overlapped communication is the iteration less the compute, bubbles included.
        "profiled_comm_s": max(0.0, seconds - breakdown["compute"]),
        "peak_memory_gib": worst.peak_memory_bytes / GIB,
        "memory_gib": {"ranks": worst.label, **worst.memory},
        "plan": plan.as_dict(),
        "events": timeline.events,
    }


def summarize(
    run: PlannedRun,
    timeline: Timeline,
    peak_flops: float | None = None,
    extras: dict[str, Any] | None = None,
    images: float | None = None,
) -> dict[str, Any]:
    """The run's summary, for every backend: the plan's memory attached to the timeline,
    the figures of the output contract, and what the backend adds (measured values, how
    it measured them). `peak_flops` replaces the cluster preset's per-device peak (a
    measured one); `images` the mean images per sequence the run processed, where the
    backend knows them (the real backend's measured steps'; None: what the plan prices)."""
    plan = run.plan
    attach_memory(timeline, plan, run.model, plan.precision, run.cluster.amp)
    cluster = run.cluster
    if peak_flops is not None:
        # Measured with every worker computing at once: already each one's share.
        cluster = replace(cluster, peak_flops={plan.precision: peak_flops}, oversubscription={})
    names = {"model": run.model.name, "strategy": plan.strategy, "cluster": run.cluster.name, "backend": timeline.backend}
    return {**build_summary(names, plan, timeline, run.model, cluster, run.train, images), **(extras or {})}
