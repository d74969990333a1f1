"""Instruction patterns shared by planners: what a segment consumes and produces, its
compute with its TP collectives, and the end of an iteration (gradient reduction,
optimizer step, parameter gather)."""

from __future__ import annotations

from typing import Sequence

from dataclasses import dataclass, replace

from src.costmodel.memory import zero_shards
from src.mesh import Sharding
from src.models.flows import flows_of, outputs_of
from src.models.spec import LayerSpec, ModelSpec, Pairing
from src.program import Collective, CollectiveOp, Compute, Instruction, Payload, Phase, Wait, Work
from src.strategies.builders.stages import Segment


@dataclass(frozen=True)
class TPConfig:
    """How one unit's layers run on one rank: its sharding, the group of its TP
    collectives, and its recompute mode. overlap_chunks > 1 splits each pass into that
    many row chunks whose TP collectives run asynchronously under the next chunk's GEMMs
    (DistTrain §7's StepCCL). rows: the share of a micro-batch this rank runs (a unit
    replicated over its TP group: stages.replicated_rows); 1: all of it."""

    sharding: Sharding
    group: str | None
    recompute: str
    act_bytes: int
    overlap_chunks: int = 1
    rows: float = 1.0


def share_of(samples: int, rows: float) -> tuple[int, float]:
    """(samples, fraction) of a Work that runs the share `rows` of a micro-batch of
    `samples`: whole samples where the share holds a whole number of them (what the real
    backend runs), else the micro-batch's fraction (a sequence's images split over ranks)."""
    whole = samples * rows
    if rows == 1.0 or abs(whole - round(whole)) > 1e-9:
        return samples, rows
    return round(whole), 1.0


def produced(model: ModelSpec, segment: Segment, microbatch: int) -> tuple[Payload, ...]:
    """What a segment's forward hands on: its last layer's token states (unless it ends
    its unit), and what the unit's consumers read that leaves inside its layers (a
    feature, tokens; nothing after a loss)."""
    unit = model.unit(segment.unit)
    start, end = segment.layers
    out = [Payload(segment.unit, end, microbatch)] if end < unit.num_layers else []
    out += [
        Payload(segment.unit, boundary, microbatch, tensor)
        for boundary, tensor in outputs_of(model, segment.unit)
        if start < boundary <= end
    ]
    return tuple(out)


def consumed(model: ModelSpec, segment: Segment, microbatch: int) -> tuple[Payload, ...]:
    """What a segment's forward reads besides the step's data: the token states entering
    its first layer (a previous segment's, or the outputs of the units chained before
    it) and the tokens of any unit its layers cross-attend to."""
    start, end = segment.layers
    out: list[Payload] = []
    if start > 0:
        out.append(Payload(segment.unit, start, microbatch))
    for flow in flows_of(model):
        if flow.consumer != segment.unit:
            continue
        if (flow.kind == "chain" and start == 0) or (flow.kind == "cross" and start <= flow.layer < end):
            out.append(Payload(flow.producer, flow.source, microbatch, flow.tensor))
    return tuple(out)


def backward_io(model: ModelSpec, segment: Segment, microbatch: int) -> tuple[tuple[Payload, ...], tuple[Payload, ...]]:
    """(gradients a segment's backward reads, gradients it writes): those of what its
    forward produced, and of what it consumed from units that train or feed one."""
    inputs = tuple(p.gradient() for p in produced(model, segment, microbatch))
    outputs = tuple(p.gradient() for p in consumed(model, segment, microbatch) if model.needs_backward(p.unit))
    return inputs, outputs


def range_io(
    model: ModelSpec, segment: Segment, phase: str, microbatch: int, first: bool, last: bool
) -> tuple[tuple[Payload, ...], tuple[Payload, ...]]:
    """What one kernel range of a layer's pass reads and writes (first, last: whether it
    holds the layer's first or last kernels): the pass's inputs at the range that runs
    first (forward: the first kernels; backward: the last), its outputs at the one that
    runs last."""
    if phase == "fwd":
        return consumed(model, segment, microbatch) if first else (), produced(model, segment, microbatch) if last else ()
    reads, writes = backward_io(model, segment, microbatch)
    return reads if last else (), writes if first else ()


def segment_pass(
    model: ModelSpec,
    segment: Segment,
    phase: Phase,
    samples: int,
    microbatch: int,
    tp: TPConfig,
    chunk: int = 0,
    contrastive_batch: int = 1,
) -> list[Instruction]:
    """The forward or backward of one segment for one micro-batch: its compute (with the
    payloads it reads and writes) and the TP activation all-reduces its layers need
    (Megatron: 2 per block each way, a fully recomputed backward 4; with sequence
    parallelism a reduce-scatter + all-gather pair of the same volume). The all-reduces
    block the compute stream, so pricing them as one instruction after the compute gives
    the same time as interleaving them layer by layer."""
    unit = model.unit(segment.unit)
    backward = phase in ("bwd", "bwd_input")
    share, fraction = share_of(samples, tp.rows)
    work = Work(
        unit.name,
        phase,
        share,
        segment.layers,
        sharding=tp.sharding,
        recompute=tp.recompute if backward else "none",
        contrastive_batch=contrastive_batch,
        fraction=fraction,
    )
    if backward:
        inputs, outputs = backward_io(model, segment, microbatch)
    else:
        inputs, outputs = consumed(model, segment, microbatch), produced(model, segment, microbatch)
    out: list[Instruction] = [Compute(work, microbatch=microbatch, chunk=chunk, inputs=inputs, outputs=outputs)]
    if tp.sharding.degree("tp") == 1 or tp.group is None:
        return out
    if tp.overlap_chunks > 1:
        transfers = _tp_transfers(unit.layers, segment.layers, backward, work.recompute, tp.sharding.sequence_parallel)
        if transfers:
            return _overlapped_pass(work, microbatch, chunk, inputs, outputs, tp, tp.group, transfers)
        return out
    by_size: dict[int, int] = {}
    for layer in unit.layers[segment.layers[0] : segment.layers[1]]:
        if layer.tp_allreduces:
            count = layer.tp_collectives(backward, work.recompute)
            by_size[layer.tp_comm_elems] = by_size.get(layer.tp_comm_elems, 0) + count
    for elems, count in sorted(by_size.items()):
        out.append(Collective("all_reduce", tp.group, elems * samples * tp.act_bytes, "tp", stream="compute", count=count))
    return out


@dataclass(frozen=True)
class _Transfer:
    """TP collectives of a pass alike: `count` of `elems` elements per sample, each beside
    the GEMMs `pair` names on its layer (the first of the span's layers that runs it,
    `layer`), or unpaired (None: layers whose products do not pair with their collectives,
    gathered by size)."""

    elems: int
    count: int
    layer: int = 0
    pair: tuple[Pairing, ...] | None = None


def _tp_transfers(
    layers: Sequence[LayerSpec], span: tuple[int, int], backward: bool, recompute: str, sequence_parallel: bool
) -> list[_Transfer]:
    """The span's TP collectives in one pass: one entry per pair of each distinct layer
    (LayerSpec.tp_pairs), the unpaired ones one entry per size."""
    kinds: dict[int, tuple[int, LayerSpec, int]] = {}  # id -> (first index, layer, occurrences)
    for index in range(*span):
        layer = layers[index]
        if layer.tp_allreduces:
            first, _, count = kinds.get(id(layer), (index, layer, 0))
            kinds[id(layer)] = (first, layer, count + 1)
    out: list[_Transfer] = []
    unpaired: dict[int, int] = {}
    for first, layer, count in kinds.values():
        pairs = layer.tp_pairs(backward, recompute, sequence_parallel)
        if pairs is None:
            collectives = count * layer.tp_collectives(backward, recompute)
            unpaired[layer.tp_comm_elems] = unpaired.get(layer.tp_comm_elems, 0) + collectives
        else:
            out += [_Transfer(layer.tp_comm_elems, count, first, pair) for pair in pairs]
    return out + [_Transfer(elems, count) for elems, count in sorted(unpaired.items())]


def _overlapped_pass(
    work: Work,
    microbatch: int,
    chunk: int,
    inputs: tuple[Payload, ...],
    outputs: tuple[Payload, ...],
    tp: TPConfig,
    group: str,
    transfers: list[_Transfer],
) -> list[Instruction]:
    """StepCCL's overlap: the pass runs as `overlap_chunks` row chunks; each chunk's TP
    collectives start on their own stream when the chunk's GEMMs end, under the next
    chunk's, and the pass ends when the last one has landed. StepCCL moves the data with
    the GPU's copy engines, "without using any SM at all" (§7, line 105), so its
    collectives do not slow the GEMMs they run beside; only the GEMMs paired with a
    collective are cut (line 106), the rest of the pass is issued once (Work.chunks).
    Each transfer is paired with its own GEMM (LayerSpec.tp_pairs: "decomposing the single
    GEMM and the corresponding communication into several smaller pairs", line 106): a
    chunk's transfer hides under that GEMM's next chunk only, so what outlasts it is exposed
    (Collective.beside), "when TP communication is longer than GEMM, fusing them cannot fully
    hide the communication overhead" (line 108); the last chunk's transfers are exposed
    whole. A layer whose products do not pair one to one with its collectives keeps the
    pass-wide overlap."""
    n = tp.overlap_chunks
    part = replace(work, fraction=work.fraction / n, chunks=n)
    chunk_rows = (part.samples, part.sharding, part.fraction)
    out: list[Instruction] = []
    handles: list[str] = []
    for c in range(n):
        out.append(
            Compute(part, microbatch=microbatch, chunk=chunk, inputs=inputs if c == 0 else (), outputs=outputs if c == n - 1 else ())
        )
        for number, transfer in enumerate(transfers):
            beside = (
                ()
                if transfer.pair is None or c == n - 1
                else paired_gemms(work.unit, transfer.layer, *chunk_rows, transfer.pair, part.load)
            )
            handle = f"tp.{work.unit}.{work.phase}.{microbatch}.{chunk}.{c}.{number}"
            out.append(
                Collective(
                    "all_reduce",
                    group,
                    transfer.elems * work.samples * tp.act_bytes / n,
                    "tp",
                    stream="tp",
                    blocking=False,
                    handle=handle,
                    count=transfer.count,
                    sms=False,
                    beside=beside,
                )
            )
            handles.append(handle)
    return out + [Wait(h) for h in handles]


def paired_gemms(
    unit: str, layer: int, samples: int, sharding: Sharding, fraction: float, pair: tuple[Pairing, ...], load: float = 1.0
) -> tuple[Work, ...]:
    """The chunk (`fraction` of the rows) of each GEMM a TP transfer is paired with, on one
    layer: that product's forward, or its backward (both gradients), alone."""
    return tuple(
        Work(unit, phase, samples, (layer, layer + 1), sharding=sharding, kernels=(kernel, kernel + 1), fraction=fraction, load=load)
        for phase, kernel in pair
    )


def trainable_params(model: ModelSpec, segments: list[Segment], shards: int) -> float:
    """Parameters of the trainable segments held by one of `shards` tensor-parallel ranks."""
    return sum(model.unit(s.unit).trainable_params(*s.layers) for s in segments) / shards


def dp_grad_op(zero_stage: int, whole_grads: bool = False) -> CollectiveOp:
    """The collective data parallelism reduces gradients with: an all-reduce, or a
    reduce-scatter where the optimizer is sharded (ZeRO 1-3), unless `whole_grads`: DeepSpeed's
    pipeline engine all-reduces the whole gradient after the flush under ZeRO-1 and its
    BF16_Optimizer alike (PipelineEngine._exec_reduce_grads, buffered_allreduce_fallback, at
    0.3.15, 0.6.5 and 0.13.0), each replica then stepping its shard and gathering the rest."""
    return "reduce_scatter" if zero_stage >= 1 and not whole_grads else "all_reduce"


def iteration_tail(
    model: ModelSpec,
    segments: list[Segment],
    sharding: Sharding,
    dp_group: str | None,
    dp: int,
    zero_stage: int,
    grad_bytes: int,
    param_bytes: int,
    pending: Sequence[str] = (),
    gather_params: bool = True,
    name_grads: bool = False,
    whole_grads: bool = False,
) -> list[Instruction]:
    """Finish an iteration: wait for asynchronous gradient reductions (`pending`
    handles), reduce the rest (all-reduce; reduce-scatter under the distributed
    optimizer), step the optimizer on the local shard, and all-gather the updated
    16-bit parameters when the optimizer state (not the parameters) is sharded, unless
    the next forward gathers them (`gather_params` false: pipeline.ParamGathers).
    `name_grads`: the DP collectives are the plan's own distributed optimizer's, one per
    unit naming the layers whose parameters it carries (Collective.grads_of). `whole_grads`:
    the reduction is an all-reduce of the whole gradient even where the optimizer is sharded
    (dp_grad_op)."""
    out: list[Instruction] = [Wait(h) for h in pending]
    params = trainable_params(model, segments, sharding.devices)
    if params == 0:
        return out
    parts: list[tuple[tuple[str, tuple[int, int]] | None, float]] = [(None, params)]
    if name_grads:
        units = {seg.unit: [s for s in segments if s.unit == seg.unit] for seg in segments}
        parts = [
            ((unit, (min(s.layers[0] for s in own), max(s.layers[1] for s in own))), trainable_params(model, own, sharding.devices))
            for unit, own in units.items()
        ]
    if dp > 1 and dp_group is not None and not pending:
        op = dp_grad_op(zero_stage, whole_grads)
        out += [Collective(op, dp_group, n * grad_bytes, "dp", grads_of=named) for named, n in parts if n]
    shards = zero_shards(dp, zero_stage)
    for segment in segments:
        if not model.unit(segment.unit).frozen:
            work = Work(
                segment.unit, "optimizer", 0, segment.layers, sharding=sharding, shard=shards.optimizer, grad_shard=shards.grads
            )
            out.append(Compute(work))
    # ZeRO-1/2 gather the updated parameters; ZeRO-3 gathers each layer's before it runs.
    if gather_params and zero_stage in (1, 2) and dp > 1 and dp_group is not None:
        out += [Collective("all_gather", dp_group, n * param_bytes, "dp", grads_of=named) for named, n in parts if n]
    return out
