"""FLOPs, MFU and the run summary: one definition for every strategy and backend.

Model FLOPs of an iteration = forward + backward matmul and attention FLOPs of every unit
for the samples it really processes; recomputation is not counted (it is in the hardware
FLOPs, HFU); a frozen unit has no weight-gradient FLOPs and, when nothing upstream of it
trains, no backward at all. MFU = model FLOPs / (iteration time x devices x peak).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from src.cluster import GIB, ClusterSpec
from src.config import TrainSpec
from src.costmodel.memory import rank_memory
from src.models.spec import ModelSpec, UnitSpec
from src.program import Plan
from src.timeline import BREAKDOWN_CATEGORIES, Timeline

if TYPE_CHECKING:
    from src.plan_io import PlannedRun


@dataclass(frozen=True)
class UnitFlops:
    """Per-sample matmul FLOPs of one unit: forward, backward, and what recomputation
    adds in each mode."""

    fwd: float
    bwd: float
    recompute_full: float
    recompute_selective: float
    backward_recompute: float = 0.0  # FlashAttention's QK^T re-run in backward (hardware FLOPs only)


def unit_flops(model: ModelSpec, unit: UnitSpec, contrastive_batch: int = 1) -> UnitFlops:
    fwd = bwd = core = rerun = 0.0
    for index, layer in enumerate(unit.layers):
        input_grad = model.needs_input_grad(unit.name, index)
        for kernel in layer.kernels:
            flops = kernel.flops(contrastive_batch)
            fwd += flops
            if layer.forward_only:
                continue
            if kernel.attention_core and (input_grad or unit.trains(layer)):
                core += flops
            if kernel.backward_recompute and (input_grad or unit.trains(layer)):
                rerun += flops
            if input_grad:
                bwd += flops if kernel.has_weight else 2 * flops
            if kernel.has_weight and unit.trains(layer):
                bwd += flops
    return UnitFlops(fwd, bwd, recompute_full=fwd, recompute_selective=core, backward_recompute=rerun)


def iteration_flops(model: ModelSpec, plan: Plan, train: TrainSpec) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one iteration: every unit processes every sample
    of the global batch once; an interaction unit's similarity products span its
    contrastive batch."""
    model_flops = hardware = 0.0
    for unit_plan in plan.units:
        unit = model.unit(unit_plan.unit)
        contrastive = train.contrastive_batch if unit.name == model.interaction else 1
        per_sample = unit_flops(model, unit, contrastive)
        samples = train.global_batch
        extra = {"full": per_sample.recompute_full, "selective": per_sample.recompute_selective}.get(unit_plan.recompute, 0.0)
        extra += per_sample.backward_recompute
        if not model.needs_backward(unit.name):
            extra = 0.0
        model_flops += samples * (per_sample.fwd + per_sample.bwd)
        hardware += samples * (per_sample.fwd + per_sample.bwd + extra)
    return model_flops, hardware


def unit_model_flops(model: ModelSpec, plan: Plan, train: TrainSpec) -> dict[str, float]:
    """Model FLOPs of one iteration per unit (the terms iteration_flops adds up)."""
    out = {}
    for unit_plan in plan.units:
        unit = model.unit(unit_plan.unit)
        contrastive = train.contrastive_batch if unit.name == model.interaction else 1
        per_sample = unit_flops(model, unit, contrastive)
        out[unit.name] = train.global_batch * (per_sample.fwd + per_sample.bwd)
    return out


def unit_utilisation(model: ModelSpec, plan: Plan, timeline: Timeline, train: TrainSpec, peak: float) -> dict[str, float]:
    """Per unit, the GPU utilisation while it computes (DistMM §7.2, Figures 8-9): its model
    FLOPs over peak x the device-seconds its forward, backward and interaction work took
    (every rank of a class counted; optimizer steps excluded)."""
    seconds: dict[str, float] = {}
    for rank_timeline in timeline.ranks:
        for span in rank_timeline.spans:
            if span.category == "compute" and span.unit and not span.name.startswith("optimizer"):
                seconds[span.unit] = seconds.get(span.unit, 0.0) + (span.end - span.start) * len(rank_timeline.ranks)
    flops = unit_model_flops(model, plan, train)
    return {unit: flops[unit] / (busy * peak) for unit, busy in seconds.items() if busy > 0 and unit in flops}


def attach_memory(timeline: Timeline, plan: Plan, model: ModelSpec, precision: str) -> None:
    """Fill each rank class's memory from the plan (both backends report the estimate;
    the real backend adds what it measured)."""
    units = {u.unit: u for u in plan.units}
    for rank_timeline, rank_program in zip(timeline.ranks, plan.program.classes):
        memory = rank_memory(rank_program, units, model, precision)
        rank_timeline.memory = {k: v / GIB for k, v in memory.items()}
        rank_timeline.peak_memory_bytes = memory["total"]


def build_summary(
    names: dict[str, str], plan: Plan, timeline: Timeline, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec
) -> dict[str, Any]:
    """The figures of the output contract (docs/design.md), JSON-ready."""
    seconds = timeline.iteration_time
    devices = plan.devices
    peak = cluster.peak(plan.precision)
    model_flops, hardware_flops = iteration_flops(model, plan, train)
    worst = max(timeline.ranks, key=lambda r: r.peak_memory_bytes)
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
        "model_params": model.params,
        "breakdown_s": {k: timeline.mean_breakdown()[k] for k in BREAKDOWN_CATEGORIES},
        "breakdown_by_unit_s": timeline.unit_breakdown(),
        "unit_utilisation": unit_utilisation(model, plan, timeline, train, peak),
        "comm_share": sum(v for k, v in timeline.mean_breakdown().items() if k.startswith("comm_")) / seconds,
        "exposed_comm_s": sum(v for k, v in timeline.mean_breakdown().items() if k.startswith("comm_")),
        "peak_memory_gib": worst.peak_memory_bytes / GIB,
        "memory_gib": {"ranks": worst.label, **worst.memory},
        "plan": plan.as_dict(),
        "events": timeline.events,
    }


def summarize(
    run: PlannedRun, timeline: Timeline, peak_flops: float | None = None, extras: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run's summary, for every backend: the plan's memory attached to the timeline,
    the figures of the output contract, and what the backend adds (measured values, how
    it measured them). `peak_flops` replaces the cluster preset's per-device peak (a
    measured one)."""
    plan = run.plan
    attach_memory(timeline, plan, run.model, plan.precision)
    cluster = run.cluster
    if peak_flops is not None:
        # Measured with every worker computing at once: already each one's share.
        cluster = replace(cluster, peak_flops={plan.precision: peak_flops}, oversubscription={})
    names = {"model": run.model.name, "strategy": plan.strategy, "cluster": run.cluster.name, "backend": timeline.backend}
    return {**build_summary(names, plan, timeline, run.model, cluster, run.train), **(extras or {})}
