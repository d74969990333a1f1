"""Instruction patterns shared by planners: a segment's compute with its TP collectives,
and the end of an iteration (gradient reduction, optimizer step, parameter gather)."""
from __future__ import annotations

from dataclasses import dataclass

from src.models.spec import ModelSpec
from src.program import Collective, Compute, Instruction, Wait, Work
from src.strategies.stages import Segment


@dataclass(frozen=True)
class TPConfig:
    """How one unit's layers run on one rank: TP degree, its group, and memory options."""

    tp: int
    group: str | None
    sequence_parallel: bool
    recompute: str
    act_bytes: int


def segment_pass(model: ModelSpec, segment: Segment, phase: str, samples: int, microbatch: int,
                 tp: TPConfig, chunk: int = 0, contrastive_batch: int = 1) -> list[Instruction]:
    """The forward or backward of one segment for one micro-batch: its compute and the
    TP activation all-reduces its layers need (Megatron: 2 per block each way; with
    sequence parallelism a reduce-scatter + all-gather pair of the same volume). The
    all-reduces block the compute stream, so pricing them as one instruction after the
    compute gives the same time as interleaving them layer by layer."""
    unit = model.unit(segment.unit)
    work = Work(unit.name, phase, samples, segment.layers, tp=tp.tp, sequence_parallel=tp.sequence_parallel,
                recompute=tp.recompute if phase in ("bwd", "bwd_input") else "none",
                contrastive_batch=contrastive_batch)
    out: list[Instruction] = [Compute(work, microbatch=microbatch, chunk=chunk)]
    if tp.tp > 1 and tp.group is not None:
        by_size: dict[int, int] = {}
        for layer in unit.layers[segment.layers[0]:segment.layers[1]]:
            if layer.tp_allreduces:
                by_size[layer.tp_comm_elems] = by_size.get(layer.tp_comm_elems, 0) + layer.tp_allreduces
        for elems, count in sorted(by_size.items()):
            out.append(Collective("all_reduce", tp.group, elems * samples * tp.act_bytes, "tp", stream="compute",
                                  count=count))
    return out


def trainable_params(model: ModelSpec, segments: list[Segment], tp: int) -> float:
    """Parameters of the trainable segments held by one TP rank."""
    return sum(model.unit(s.unit).trainable_params(*s.layers) for s in segments) / tp


def iteration_tail(model: ModelSpec, segments: list[Segment], tp: int, dp_group: str | None, dp: int,
                   zero_stage: int, grad_bytes: int, param_bytes: int,
                   pending: list[str] = ()) -> list[Instruction]:
    """Finish an iteration: wait for asynchronous gradient reductions (`pending`
    handles), reduce the rest (all-reduce; reduce-scatter under the distributed
    optimizer), step the optimizer on the local shard, and all-gather the updated
    16-bit parameters when the optimizer state is sharded."""
    out: list[Instruction] = [Wait(h) for h in pending]
    params = trainable_params(model, segments, tp)
    if params == 0:
        return out
    reduce_now = dp > 1 and dp_group is not None and not pending
    if reduce_now:
        op = "reduce_scatter" if zero_stage >= 1 else "all_reduce"
        out.append(Collective(op, dp_group, params * grad_bytes, "dp"))
    shard = dp if zero_stage >= 1 else 1
    for segment in segments:
        if not model.unit(segment.unit).frozen:
            out.append(Compute(Work(segment.unit, "optimizer", 0, segment.layers, tp=tp, shard=shard)))
    if zero_stage >= 1 and dp > 1 and dp_group is not None:
        out.append(Collective("all_gather", dp_group, params * param_bytes, "dp"))
    return out
