"""One worker's run: build what this rank holds, train, and (rank 0) report.

Every worker runs the plan the door wrote (src/plan_io: the same Plan on every rank; no
worker plans), builds its units' modules from the seed, wraps them in DeepSpeed engines
on their data-parallel groups, and executes its instruction list once per step. Only
rank 0 writes: one line and one metrics record per step, then the summary, to the same
sinks as the simulator. Every N-th step (train.checkpoint_every) all ranks save a
checkpoint, and a run resumed from one (train.resume) starts at the step after it
(runtime.checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
import gc
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from src.config import TorchBackendSpec
from src.data.interleaved_mllm import InterleavedMLLM
from src.metrics import iteration_flops, summarize
from src.plan_io import PlannedRun, RunSettings, settings_record
from src.program import Compute, Plan
from src.report import open_sinks
from src.runtime.checkpoint import Checkpoints, Resume, Saved, check_resume
from src.runtime.comm import CLOCK
from src.runtime.device import DTYPES, worker_device
from src.runtime.dist_optimizer import DistributedOptimizer, sharded_units
from src.runtime.engines import (
    EngineSettings,
    ParallelGroups,
    make_engine,
    new_run,
    partitioned_at_init,
    time_deepspeed_comm,
)
from src.runtime.clipping import clipping_pipeline
from src.runtime.loss_scale import LossScale
from src.runtime.modules.contrastive import CaptionHead, scored_targets
from src.runtime import step_metrics
from src.runtime.executor import Executor
from src.runtime.groups import ProcessGroups
from src.runtime.inputs import Batches, StepSamples, dataset_for, rank_reads
from src.runtime.lifeline import LIFELINE, REPORTING, SAVING, TRAINING
from src.runtime.modules.parallel import TP
from src.models.spec import ModelSpec, UnitSpec
from src.runtime.layouts import LaidOut, layout_runtime
from src.runtime.modules.units import build_units, unit_layers
from src.runtime.peak import GEMM_SIZES, peak_gemm_flops
from src.runtime.preprocess import Producer
from src.runtime.placement import UnitPlacement, placements
from src.runtime.row_shares import dealing_units, rank_shares
from src.runtime.tp_bins import find_bins
from src.runtime.timing import StepTimer
from src.timeline import RankTimeline, Span, Timeline


@dataclass(frozen=True)
class _EngineGroup:
    """Trained units that share a data-parallel group, and so one DeepSpeed engine."""

    names: list[str]
    groups: ParallelGroups
    settings: EngineSettings

    @property
    def partitions_weights(self) -> bool:
        return self.settings.zero_stage == 3 and len(self.groups.dp_ranks) > 1


def _laid_out(run: PlannedRun, places: dict[str, UnitPlacement]) -> dict[str, LaidOut]:
    """Each unit of this rank on a layout of its own, as its layout's runtime lays it out."""
    out = {}
    for name in places:
        layout = layout_runtime(run.plan.unit(name))
        if layout is not None:
            out[name] = layout.lay_out(run.plan.unit(name), run.model.unit(name))
    return out


def _trains(model: ModelSpec, name: str, place: UnitPlacement) -> bool:
    return sum(model.unit(name).trainable_params(i, i + 1) for i in place.layers) > 0


def _parallel(place: UnitPlacement, groups: ProcessGroups, pp: dist.ProcessGroup | None) -> ParallelGroups:
    tp = groups.get(place.tp_ranks) if place.tp > 1 else None
    return ParallelGroups(groups.get(place.dp_ranks), place.dp_ranks, tp, place.tp_ranks, pp)


def _engine_groups(
    run: PlannedRun,
    places: dict[str, UnitPlacement],
    groups: ProcessGroups,
    backend: TorchBackendSpec,
    own: set[str],
    pp: dist.ProcessGroup | None,
) -> list[_EngineGroup]:
    plan, model = run.plan, run.model
    by_group: dict[tuple, list[str]] = {}
    for name, place in places.items():
        if name in own:  # its layout's optimizer (runtime.layouts) or the plan's distributed optimizer (runtime.dist_optimizer)
            continue
        if _trains(model, name, place):
            # Units on one DP group under different ZeRO settings (encoders colocated with an LLM) get an engine each.
            unit = plan.unit(name)
            by_group.setdefault((place.dp_ranks, place.tp_ranks, unit.zero_stage, unit.overlap_comm), []).append(name)
    out = []
    for names in by_group.values():
        first = plan.unit(names[0])
        settings = EngineSettings.of(first, backend.deepspeed, backend.contrastive, run.train.steps)
        parallel = _parallel(places[names[0]], groups, pp)
        out.append(_EngineGroup(names, parallel, settings))
    return out


def _build(
    run: PlannedRun,
    places: dict[str, UnitPlacement],
    tp: dict[str, TP],
    engine_groups: list[_EngineGroup],
    device,
    laid_out: dict[str, LaidOut],
    backend: TorchBackendSpec,
) -> torch.nn.ModuleDict:
    """This rank's layers. A ZeRO-3 unit's parameters are partitioned over its replicas as
    each layer is built, so no rank ever holds more of it than the layer being built."""
    model, seed = run.model, run.train.seed
    recompute = {u.unit: u.recompute for u in run.plan.units}
    keep = {n: set(p.layers) for n, p in places.items()}
    partitioned = {n for g in engine_groups if g.partitions_weights for n in g.names}
    contrastive = backend.contrastive
    units = build_units(model, seed, tp, {n: k for n, k in keep.items() if n not in partitioned}, recompute, laid_out, contrastive)
    units = units.to(device)
    for group in engine_groups:
        if group.partitions_weights:
            with partitioned_at_init(group.groups, group.settings):
                built = build_units(model, seed, tp, {n: keep[n] for n in group.names}, recompute, contrastive=contrastive)
            units.update(dict(built.items()))
    return units


def _engines(
    units: torch.nn.ModuleDict,
    engine_groups: list[_EngineGroup],
    laid_out: dict[str, LaidOut],
    sharded: dict[str, tuple[ParallelGroups, bool]],
    backend: TorchBackendSpec,
    steps: int,
) -> dict[str, Any]:
    """One DeepSpeed engine per data-parallel group: units that share it share an engine;
    a unit on a layout of its own has its layout's, and one whose plan runs its distributed
    optimizer's collectives has that."""
    engines: dict[str, Any] = {
        name: layout.engine(units[name], backend.deepspeed, backend.contrastive, steps) for name, layout in laid_out.items()
    }
    for name, (parallel, layerwise) in sharded.items():
        engines[name] = DistributedOptimizer(
            unit_layers(units, name), parallel, backend.deepspeed, backend.contrastive, steps, layerwise
        )
    for group in engine_groups:
        engine = make_engine(torch.nn.ModuleDict({n: units[n] for n in group.names}), group.groups, group.settings)
        engines.update({n: engine for n in group.names})
    return engines


@dataclass
class _Worker:
    """What this rank builds before its first step."""

    device: torch.device
    samples: StepSamples
    producer: Producer | None
    units: torch.nn.ModuleDict
    engines: dict[str, Any]
    batches: Batches
    executor: Executor
    captions: _CaptionSteps | None
    timer: StepTimer
    measured_peak: float  # the workers' mean best GEMM rate (FLOP/s)
    peak: float  # the MFU denominator
    checkpoints: Checkpoints


@dataclass
class _Measured:
    """What the steps measured: per step, the loss summed over the ranks and the slowest
    rank's times; this rank's peaks and breakdowns."""

    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    step_peaks: list[float] = field(default_factory=list)  # this rank's peak memory in each step (GiB)
    breakdowns: list[dict[str, float]] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    # Each step's mean images per sequence, where its samples hold their own: what its
    # encoder and generator FLOPs count (None: the model's).
    images: list[float | None] = field(default_factory=list)
    saves: list[Saved] = field(default_factory=list)


def run_session(run: PlannedRun, settings: RunSettings, run_dir: Path, rank: int, world: int) -> None:
    """Train `run`'s plan on this rank as `settings` say (the real backend's)."""
    assert settings.torch is not None, "a worker runs the real backend's settings"
    # The door checked it whole; under a launcher the workers check here, rank 0 its checksums.
    resume = check_resume(
        settings.checkpoint, run_dir, settings_record(settings).get("torch", {}), checksums=rank == 0 and not LIFELINE.attached
    )
    first = resume.step if resume is not None else 0
    # ZeRO-3's zero.Init replaces torch.nn.functional.linear for the whole process ("this
    # will persist unless manually reset"): restored below, or every later run of this
    # process computes its linears as matmul + bias (losses off in the 7th digit).
    linear = torch.nn.functional.linear
    worker = _build_worker(run, settings.torch, run_dir, rank, world, first)
    if resume is not None:  # last: the RNG states it restores are those of the step it resumes at
        worker.checkpoints.load(resume, worker.executor.loss_scale)
    sinks = open_sinks(run_dir, settings.record, settings.job) if rank == 0 else None
    try:
        measured = _Measured()
        flops_counting = functools.cache(lambda mean_images: iteration_flops(run.model, run.plan, run.train, mean_images)[0])
        for step in range(first, run.train.steps):
            _train_step(worker, run, world, step, measured, sinks, flops_counting)
            every = settings.checkpoint.every
            if every is not None and (step + 1) % every == 0:
                LIFELINE.at_step(step + 1, SAVING)
                saved = worker.checkpoints.save(step + 1, worker.executor.loss_scale, samples_read=(step + 1) * run.train.global_batch)
                LIFELINE.state(TRAINING)  # saved: between steps again
                if saved is not None:
                    measured.saves.append(saved)
                    print(f"checkpoint of {saved.step} steps: {saved.bytes / 2**20:.3g} MiB in {saved.seconds:.3g} s", flush=True)
        LIFELINE.state(REPORTING)
        _report(run, settings, worker, measured, rank, world, resume, first, sinks)
    except BaseException:
        if sinks is not None:
            sinks.abort()
        raise
    finally:
        torch.nn.functional.linear = linear
        if worker.producer is not None:
            worker.producer.close()
        if sinks is not None:
            sinks.close()
        # Several runs may share this process (runtime.worker): give the next one the
        # device memory of this one (DeepSpeed's hooks make reference cycles).
        device = worker.device
        del worker
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def _build_worker(run: PlannedRun, backend: TorchBackendSpec, run_dir: Path, rank: int, world: int, first: int) -> _Worker:
    """This rank's data, groups, layers, engines and executor, from the plan and the seed."""
    plan, model, train = run.plan, run.model, run.train
    device = worker_device(dist.get_backend())
    CLOCK.device = device
    places = placements(plan, rank)
    dataset = dataset_for(model, train.seed, backend.data, backend.data_errors, plan.sample_content)
    # Sequences of their own images: a replicated unit that works per image deals them out.
    dealing = dealing_units(plan, model) if isinstance(dataset, InterleavedMLLM) else {}
    shares = rank_shares(plan, rank)
    samples = StepSamples(
        model,
        dataset,
        train.global_batch,
        rank_reads(plan, train.global_batch, {n: p.dp_ranks.index(rank) for n, p in places.items()}),
        plan.sample_order,
        plan.balancing,
        shares,
    )
    producer = None
    if backend.preprocess == "disaggregated":  # started first: it works while the model is built
        producer = Producer(samples, range(first, train.steps), backend.prefetch_steps, backend.timeout_s, rank)
    # Clipping by the model's norm over a pipeline's stages (runtime.clipping): each
    # engine reduces its norm over its rank's PP group, which every trained unit shares.
    pipeline = clipping_pipeline(plan, model) if backend.deepspeed.gradient_clipping > 0 else None
    groups = ProcessGroups(plan, backend.timeout_s, pipeline)
    pp = groups.get(pipeline.group("pp", rank)) if pipeline is not None else None
    tp = {
        name: TP(p.tp, p.tp_ranks.index(rank), groups.get(p.tp_ranks), plan.unit(name).sequence_parallel) if p.tp > 1 else TP()
        for name, p in places.items()
    }
    laid_out = _laid_out(run, places)
    sharded = {
        n: (_parallel(places[n], groups, pp), layerwise)
        for n, layerwise in sharded_units(plan, rank).items()
        if _trains(model, n, places[n])
    }
    new_run()
    engine_groups = _engine_groups(run, places, groups, backend, set(laid_out) | set(sharded), pp)
    units = _build(run, places, tp, engine_groups, device, laid_out, backend)
    engines = _engines(units, engine_groups, laid_out, sharded, backend, train.steps)
    if engine_groups:
        time_deepspeed_comm()
    batches = Batches(samples, device, producer)
    loss_scale = LossScale.of(backend.deepspeed.fp16)
    executor = Executor(plan, model, rank, units, engines, groups, batches, device, plan.precision, loss_scale, dealing)
    pad_id = backend.contrastive.pad_id
    captions = (
        _CaptionSteps(run, places, units, batches, pad_id) if pad_id is not None and any(map(_has_caption_head, model.units)) else None
    )
    rank_program = plan.program.class_of(rank)
    measured_peak = _measured_peak(world, device, plan.precision)
    # On a GPU the MFU denominator is the datasheet peak in the run's precision (the
    # cluster preset's); on a CPU there is none, so it is what the workers measure.
    peak = run.cluster.peak(plan.precision) if device.type == "cuda" else measured_peak
    return _Worker(
        device=device,
        samples=samples,
        producer=producer,
        units=units,
        engines=engines,
        batches=batches,
        executor=executor,
        captions=captions,
        timer=StepTimer(rank_program.instructions, rank_program.pipelined),
        measured_peak=measured_peak,
        peak=peak,
        checkpoints=Checkpoints(run_dir, rank, engines, plan),
    )


def _train_step(
    worker: _Worker,
    run: PlannedRun,
    world: int,
    step: int,
    measured: _Measured,
    sinks: Any,
    flops_counting: Callable[[float | None], float],
) -> None:
    """One step on this rank, its figures reduced over the ranks; rank 0 logs them."""
    device, executor, timer, batches, engines = worker.device, worker.executor, worker.timer, worker.batches, worker.engines
    train = run.train
    measured.images.append(worker.samples.images_per_sequence(step))
    LIFELINE.at_step(step)
    batches.start_step(step)
    if worker.captions is not None:
        worker.captions.start_step(device)
    lr = step_metrics.learning_rate(engines)
    loss_scale = executor.loss_scale.scale if executor.loss_scale is not None else 1.0
    step_metrics.start_memory_peak(device)
    dist.barrier()
    timer.reset(time.perf_counter())
    cpu_start = time.process_time()
    share = executor.run_step(timer)
    measured.cpu.append(time.process_time() - cpu_start)  # the step's instructions, as timer.end times them
    norm_share, known = step_metrics.gradient_norm_share(engines)
    # Summed: every rank's share of the loss and of the squared gradient norm, and the
    # ranks whose norm is unknown. Maxima: the slowest rank's times, the peak memory, the lr.
    sums = torch.tensor([share, norm_share, 0.0 if known else 1.0], dtype=torch.float64, device=device)
    peak_memory = step_metrics.memory_peak_gib(device)
    measured.step_peaks.append(peak_memory)
    longest = torch.tensor([timer.end, batches.wait_s, peak_memory, -1.0 if lr is None else lr], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    measured.losses.append(float(sums[0]))
    measured.times.append(float(longest[0]))
    measured.waits.append(float(longest[1]))
    measured.breakdowns.append(timer.finish(measured.times[-1]))
    if sinks is None:
        return
    seconds = measured.times[-1]
    skipped = executor.loss_scale is not None and executor.loss_scale.skipped
    tokens = step_metrics.tokens_per_sample(run.model)
    sinks.log_step(
        {
            "step": step,
            "loss": measured.losses[-1],
            "step_time_s": seconds,
            "data_wait_s": measured.waits[-1],
            "mfu": flops_counting(measured.images[-1]) / (seconds * world * worker.peak),
            "lr": float(longest[3]) if longest[3] >= 0 else None,
            "grad_norm": step_metrics.gradient_norm(float(sums[1]), float(sums[2]), skipped),
            "loss_scale": loss_scale,
            "samples_per_s": train.global_batch / seconds,
            "tokens_per_s": None if tokens is None else train.global_batch * tokens / seconds,
            "peak_memory_gib": float(longest[2]),
            "rank0_breakdown_s": measured.breakdowns[-1],
        }
    )


def _report(
    run: PlannedRun,
    settings: RunSettings,
    worker: _Worker,
    measured: _Measured,
    rank: int,
    world: int,
    resume: Resume | None,
    first: int,
    sinks: Any,
) -> None:
    """Every rank gives rank 0 its spans, breakdowns and memory; rank 0 writes the summary."""
    assert settings.torch is not None, "a worker runs the real backend's settings"
    device, timer, precision, times = worker.device, worker.timer, run.plan.precision, measured.times
    peak_gemm = worker.measured_peak
    mine = {
        "rank": rank,
        "breakdowns": measured.breakdowns,
        "spans": [dataclasses.astuple(s) for s in timer.spans],
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        # Each step's peak is measured from its start: the run's is the largest.
        "device_gib": max(measured.step_peaks, default=0.0) if device.type == "cuda" else 0.0,
        "data_skipped": worker.batches.skipped,
    }
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if sinks is None:
        return
    assert gathered is not None, "rank 0 writes the results, and gathers"
    timeline = _timeline(run.plan, gathered, times)
    counted = [n for n in measured.images[_measured(times)] if n is not None]
    mean_images = statistics.fmean(counted) if counted else None
    sizes = "/".join(map(str, GEMM_SIZES[device.type]))
    gemms = (
        f"best of {sizes}-cubed {precision} GEMMs on all {world} workers at once (in the launch's first run in {precision}), "
        f"mean per worker: {peak_gemm:.4g} FLOP/s"
    )
    extras = {
        "peak_flops_source": (
            f"cluster preset {run.cluster.name} ({run.cluster.device} datasheet); measured {gemms}"
            if device.type == "cuda"
            else f"measured: {gemms}"
        ),
        "measured_gemm_flops_per_device": peak_gemm,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "dist_backend": dist.get_backend(),
        # data_wait_s: the longest wait of any trainer for its step's batches, before
        # the step's timed window (backend.preprocess)
        "measured": {
            "loss": measured.losses,
            "step_time_s": times,
            "data_wait_s": measured.waits,
            "rank0_process_time_s": measured.cpu,  # CPU seconds of rank 0's process per step (wall time beside it: a loaded machine)
            "preprocess": settings.torch.preprocess,
            # backend.data_errors=skip: the bad shard members every trainer left out
            "data_skipped": sorted(set().union(*(g["data_skipped"] for g in gathered))),
            "first_step": first,  # of the losses and times above: a resumed run starts after its checkpoint
            # each step's mean images per sequence (interleaved data, an MLLM's shards)
            **({} if mean_images is None else {"images_per_sequence": measured.images}),
            "checkpoint": _checkpoint_record(settings.checkpoint.every, resume, measured.saves),
        },
        "measured_notes": _notes(run.plan),
    }
    summary = summarize(run, timeline, peak_flops=worker.peak, extras=extras, images=mean_images)
    for rank_timeline in timeline.ranks:
        rank_timeline.memory["measured_rss_gib"] = max(gathered[r]["rss_gib"] for r in rank_timeline.ranks)
    summary["memory_gib"]["measured_rss_gib"] = max(g["rss_gib"] for g in gathered)
    summary["memory_gib"]["measured_rss_gib_by_rank"] = [g["rss_gib"] for g in gathered]
    if device.type == "cuda":
        summary["memory_gib"]["measured_device_peak_gib"] = max(g["device_gib"] for g in gathered)
    with LIFELINE.writing_results():
        sinks.finish(summary, timeline)
        LIFELINE.finished()


class _CaptionSteps:
    """CoCa's captioning loss is the mean over the step's caption tokens that are not padding
    (runtime.modules.contrastive.CaptionHead): before each step, the ranks count the scored
    tokens of the micro-batches they read (each data-parallel replica's once) and every
    caption head of this rank takes the step's scored tokens per sample. Every rank joins
    the count (a collective), those without a caption head too."""

    def __init__(
        self, run: PlannedRun, places: dict[str, UnitPlacement], units: torch.nn.ModuleDict, batches: Batches, pad_id: int
    ) -> None:
        self.heads = [m for m in units.modules() if isinstance(m, CaptionHead)]
        self.units = [n for n in places if _has_caption_head(run.model.unit(n))]
        self.plan, self.batches, self.batch, self.pad_id = run.plan, batches, run.train.global_batch, pad_id

    def start_step(self, device: torch.device) -> None:
        count = 0.0
        for name in self.units:
            unit = self.plan.unit(name)
            readers = len(unit.ranks) // unit.dp  # the ranks that read one replica's micro-batches
            for j in range(unit.num_microbatches):
                count += float(scored_targets(self.batches(name, j)["targets"], self.pad_id).sum()) / readers
        total = torch.tensor([count], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        for head in self.heads:
            head.scored_per_sample = float(total) / self.batch


def _has_caption_head(unit: UnitSpec) -> bool:
    return any(layer.name == "caption_head" for layer in unit.layers)


def _checkpoint_record(every: int | None, resume: Resume | None, saves: list[Saved]) -> dict[str, Any]:
    """The run's checkpoints as the summary records them: each save's size on disk and rank
    0's wall seconds from starting its part to every rank having saved theirs."""
    return {
        "every": every,
        "resumed_from": {"run_dir": str(resume.source), "steps_done": resume.step} if resume is not None else None,
        "saves": [{"steps_done": s.step, "bytes": s.bytes, "save_s": s.seconds} for s in saves],
    }


def _notes(plan: Plan) -> list[str]:
    """What the measured breakdown leaves out, so that no reader takes it for measured."""
    notes = []
    if any(u.zero_stage == 3 and u.dp > 1 for u in plan.units):
        notes.append(
            "comm_dp counts ZeRO-3's parameter all-gathers from their issue to their return: DeepSpeed "
            "issues them asynchronously and waits for them inside forward and backward, where the wait "
            "is counted as compute"
        )
    if any(isinstance(i, Compute) and i.work.kernels is not None for c in plan.program.classes for i in c.instructions):
        notes.append(
            "a layer the plan splits into kernel ranges (a tensor grid's FCs, encoder kernels in another unit's bubbles) runs "
            "whole where its last range stands: its time is measured there, its earlier ranges take none"
        )
    if any(find_bins(c.instructions) for c in plan.program.classes):
        notes.append(
            "the work a plan places in a pass's TP bins runs while the pass's last TP collective travels (a pass's first "
            "run, which counts its collectives, runs it after the pass); what the pass does after that collective is "
            "timed at its first wait"
        )
    return notes


# The workers' peak per (device, world, precision), measured by a launch's first run in that
# precision: its later runs share the same machine with the same workers, and timing the
# GEMMs again would cost each of them about half a second of every worker's time.
_PEAKS: dict[tuple[str, int, str], float] = {}


def _measured_peak(world: int, device: torch.device, precision: str) -> float:
    key = (str(device), world, precision)
    if key not in _PEAKS:  # every rank runs the launch's runs in the same order: all measure, or none
        flops = torch.tensor([peak_gemm_flops(device, DTYPES[precision])], dtype=torch.float64, device=device)
        dist.all_reduce(flops)
        _PEAKS[key] = float(flops) / world
    return _PEAKS[key]


def _timeline(plan: Plan, per_rank: list[dict], times: list[float]) -> Timeline:
    """One RankTimeline per rank class, as the simulator reports: the spans of the class's
    first rank in the last step, the breakdown averaged over its ranks and its measured steps."""
    measured = _measured(times)
    iteration = statistics.fmean(times[measured])
    ranks = []
    for rank_program in plan.program.classes:
        members = [per_rank[r] for r in rank_program.ranks]
        breakdown: dict[str, float] = {}
        for member in members:
            steps = member["breakdowns"][measured]
            for category in steps[0]:
                breakdown[category] = breakdown.get(category, 0.0) + (statistics.fmean(s[category] for s in steps) / len(members))
        busy = sum(v for k, v in breakdown.items() if k != "idle")
        breakdown["idle"] = max(0.0, iteration - busy)
        spans = [Span(*s) for s in members[0]["spans"]]
        ranks.append(
            RankTimeline(
                ranks=rank_program.ranks,
                label=rank_program.label,
                units=rank_program.units,
                spans=spans,
                breakdown=breakdown,
                end=iteration,
            )
        )
    return Timeline(iteration_time=iteration, ranks=ranks, backend="torch", events=len(plan.program.classes))


def _measured(times: list[float]) -> slice:
    """The steps a summary's figures are of: those after the first (which pays for
    warm-up: allocation, DeepSpeed's first step), or the only one."""
    return slice(1, None) if len(times) > 1 else slice(None)
