"""Cutting a model's units into pipeline stages.

Stage boundaries fall between transformer blocks (layers with TP communication); the
embedding, patchify, projector and head layers stay with their neighbouring block, and the
divisibility rule counts blocks, as Megatron's --num-layers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from src.errors import ConfigError
from src.mesh import Sharding, tensor_parallel
from src.models.flows import flows_of, unit_order
from src.models.spec import ModelSpec, UnitSpec


@dataclass(frozen=True)
class Segment:
    """Layers [start, end) of one unit, placed on one virtual pipeline stage."""

    unit: str
    layers: tuple[int, int]


def main_unit(model: ModelSpec) -> UnitSpec:
    """The unit a pipeline is built around: its backbone, the one with the most parameters
    among the units whose work is the whole sample rather than its images (an MLLM's LLM,
    however large its encoder or generator: DistTrain §2.1's Megatron-LM treats them as
    layers added to the LLM, and at tiny scale its U-Net has more parameters); of all units
    where every one works per image."""
    backbones = [u for u in model.units if not u.arch.per_image] or list(model.units)
    return max(backbones, key=lambda u: u.params)


def block_cuts(unit: UnitSpec, parts: int, uneven: bool, what: str) -> list[tuple[int, int]]:
    """Split a unit's layers into `parts` contiguous ranges with equal block counts."""
    blocks = [i for i, layer in enumerate(unit.layers) if layer.tp_allreduces > 0]
    if not blocks:
        blocks = list(range(unit.num_layers))
    if parts > len(blocks):
        raise ConfigError(f"{what}={parts} exceeds the {len(blocks)} blocks of unit {unit.name}")
    if len(blocks) % parts and not uneven:
        raise ConfigError(
            f"{what}={parts} does not divide the {len(blocks)} blocks of unit {unit.name} "
            f"(set strategy.uneven_pp=true to allow stages of unequal depth)"
        )
    base, extra = divmod(len(blocks), parts)
    # The first and last stages also hold the embedding and the head: they get no extra block.
    counts = [base] * parts
    middle = list(range(1, parts - 1)) or list(range(parts))
    for i in range(extra):
        counts[middle[i % len(middle)]] += 1
    ranges = []
    start_block = 0
    for p, count in enumerate(counts):
        end_block = start_block + count
        start = 0 if p == 0 else blocks[start_block]
        end = unit.num_layers if p == parts - 1 else blocks[end_block]
        ranges.append((start, end))
        start_block = end_block
    return ranges


def pipeline_segments(model: ModelSpec, pp: int, vpp: int, modality_stages: str, uneven: bool) -> list[list[Segment]]:
    """Virtual stages (pp·vpp of them, in model order) as lists of segments.

    The main unit (the LLM) is cut into equal parts. Other units either get stages of
    their own before/after it (modality_stages='extra', DistTrain §2.1's description of
    Megatron-LM for MLLMs: pp counts them) or join the first/last stage (`merged`, Optimus's
    "encoders in the first stage")."""
    order = unit_order(model)
    main = main_unit(model)
    before = [model.unit(n) for n in order[: order.index(main.name)]]
    after = [model.unit(n) for n in order[order.index(main.name) + 1 :]]
    virtual = pp * vpp
    if modality_stages == "extra":
        extra = len(before) + len(after)
        if extra and vpp > 1:
            raise ConfigError(
                f"vpp={vpp} with the {extra} extra modality stages of {model.name}: interleaving needs strategy.modality_stages=merged"
            )
        main_parts = virtual - extra
        if main_parts < 1:
            raise ConfigError(
                f"pp={pp} leaves no stage for {main.name}: {model.name} needs "
                f"{extra} extra stages for {[u.name for u in before + after]}"
            )
        stages = [[Segment(u.name, (0, u.num_layers))] for u in before]
        stages += [[Segment(main.name, r)] for r in block_cuts(main, main_parts, uneven, "pp")]
        stages += [[Segment(u.name, (0, u.num_layers))] for u in after]
        return stages
    if modality_stages != "merged":
        raise ConfigError(f"strategy.modality_stages={modality_stages!r}; choose extra or merged")
    what = "pp x vpp" if vpp > 1 else "pp"
    stages = [[Segment(main.name, r)] for r in block_cuts(main, virtual, uneven, what)]
    stages[0] = [Segment(u.name, (0, u.num_layers)) for u in before] + stages[0]
    stages[-1] = stages[-1] + [Segment(u.name, (0, u.num_layers)) for u in after]
    return stages


def balanced_cuts(times: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Optimus Appendix B ("Megatron-LM balanced"): cut layers with these times, in
    order, into `parts` contiguous non-empty ranges [start, end) so that the slowest
    range is as fast as possible: F(L, parts) of the DP F(l, s) = min over j < l of
    max(F(j, s-1), t_{j+1} + ... + t_l).

    Many cuts reach that optimum where the slowest range is set by a few heavy layers and
    light ones fill the rest. Optimus follows Alpa's DP (Appendix B: "Following Alpa"),
    whose layer clustering (alpa/pipeline_parallel/layer_construction.py,
    cluster_jaxpr_by_cost) keeps, for each first l layers in s ranges, the cut whose
    slowest range is fastest and, of those, the one whose ranges' layer counts are the
    most even (the least sum of squared counts; Alpa also compares within a relative
    1e-4, here exactly), the first j on a tie. Range sums are prefix differences, so the
    comparisons are exact."""
    count = len(times)
    if not 1 <= parts <= count:
        raise ConfigError(f"cannot cut {count} layers into {parts} non-empty stages")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(times, dtype=float))))
    slowest = np.full((count + 1, parts + 1), np.inf)  # [l, s]: the first l layers in s ranges
    squares = np.full((count + 1, parts + 1), np.inf)  # their ranges' squared layer counts, summed
    start = np.zeros((count + 1, parts + 1), dtype=int)  # where the last range begins
    slowest[0, 0] = squares[0, 0] = 0.0
    ends, starts = np.arange(count + 1)[:, None], np.arange(count + 1)[None, :]
    after = starts < ends  # a range [j, l) holds a layer
    every = np.arange(count + 1)
    # Every l at once for each s: worst[l, j] is the slowest range of the first l layers when
    # the last range is [j, l).
    for s in range(1, parts + 1):
        worst = np.where(after, np.maximum(slowest[None, :, s - 1], prefix[:, None] - prefix[None, :]), np.inf)
        fastest = worst.min(axis=1)
        even = np.where(worst == fastest[:, None], squares[None, :, s - 1] + (ends - starts) ** 2, np.inf)
        best = even.argmin(axis=1)  # the first j of the most even
        slowest[:, s], squares[:, s], start[:, s] = fastest, even[every, best], best
    cuts, end = [], count
    for s in range(parts, 0, -1):
        cuts.append((int(start[end, s]), end))
        end = cuts[-1][0]
    return cuts[::-1]


def linear_chain(model: ModelSpec) -> list[UnitSpec]:
    """The model's units when they form one chain (each unit's whole output is the next
    unit's input); the balanced cut needs one, as Optimus Appendix B says."""
    order = unit_order(model)
    flows = flows_of(model)
    producers = {name: [f for f in flows if f.consumer == name] for name in order}
    for name in order:
        if len(producers[name]) > 1:
            raise ConfigError(
                f"strategy.balance=true (Megatron-LM balanced, Optimus Appendix B) takes a single "
                f"encoder, but {model.name} has {len(producers[name])} encoders feeding {name} "
                f"({', '.join(f.producer for f in producers[name])})"
            )
    for previous, name in zip(order, order[1:]):
        flow = producers[name][0] if producers[name] else None
        if flow is None or flow.producer != previous or flow.kind != "chain":
            how = "nothing" if flow is None else f"a {flow.kind} flow from {flow.producer}"
            raise ConfigError(
                f"strategy.balance=true cuts a linear chain of units (Optimus Appendix B), but "
                f"{name} of {model.name} takes {how}, not {previous}'s output as its input"
            )
    return [model.unit(name) for name in order]


def chain_segments(units: Sequence[UnitSpec], ranges: Sequence[tuple[int, int]]) -> list[list[Segment]]:
    """Virtual stages from [start, end) ranges over the chain's layers numbered end to end."""
    offsets, total = [], 0
    for unit in units:
        offsets.append(total)
        total += unit.num_layers
    stages = []
    for start, end in ranges:
        stages.append(
            [
                Segment(unit.name, (max(start - offset, 0), min(end - offset, unit.num_layers)))
                for unit, offset in zip(units, offsets)
                if start < offset + unit.num_layers and end > offset
            ]
        )
    return stages


def boundary_elems(unit: UnitSpec, layer_end: int) -> int:
    """Elements per sample leaving a segment that ends at `layer_end`."""
    return unit.output_elems if layer_end >= unit.num_layers else unit.seq_len * unit.hidden


@dataclass(frozen=True)
class StageTransfer:
    """What one TP rank sends across a pipeline boundary per micro-batch (`send_bytes`),
    and what the receiving stage then all-gathers over its TP group (`gather_bytes`, the
    whole tensor; 0 when nothing is gathered)."""

    send_bytes: float
    gather_bytes: float = 0.0


def stage_transfer(nbytes: float, tp: int, sequence_parallel: bool, scatter_gather: bool) -> StageTransfer:
    """How Megatron-LM moves an `nbytes` activation (or its gradient) between stages
    (megatron/p2p_communication.py, _communicate). Under sequence parallelism each TP rank
    holds and sends only its s/tp tokens, and the next stage starts sequence-parallel: no
    gather. Without it every TP rank holds the whole tensor; with the scatter/gather
    optimisation (on by default, off with --no-scatter-gather-tensors-in-pipeline) each
    sends 1/tp of it and the receiving stage all-gathers over TP; without, each sends it whole."""
    if tp == 1:
        return StageTransfer(nbytes)
    if sequence_parallel:
        return StageTransfer(nbytes / tp)
    if scatter_gather:
        return StageTransfer(nbytes / tp, nbytes)
    return StageTransfer(nbytes)


@dataclass(frozen=True)
class StageRun:
    """How every rank of one pipeline stage runs its layers. Megatron-LM's tensor parallelism
    splits them over the stage's TP group (`sharding`). A stage replicated over its TP group
    (`replicated`: a unit too small for TP, DistTrain §2.1) runs them whole on each rank, each
    on its share of every micro-batch (`rows`: the busiest rank's share, a fraction of the
    micro-batch's rows), and reduces their gradients over the stage's TP x DP ranks."""

    sharding: Sharding
    rows: float = 1.0
    replicated: bool = False


def replicated_rows(unit: UnitSpec, micro_batch: int, tp: int) -> float:
    """The busiest rank's share of a micro-batch when `unit` is replicated over `tp` ranks,
    as a fraction of the micro-batch: its rows (a per-image unit's images, else its samples)
    are dealt out whole, as evenly as they go, so where tp does not divide them (or exceeds
    them) one rank runs ceil(rows / tp) and sets the stage's pace."""
    rows = micro_batch * (unit.arch.images if unit.arch.per_image else 1)
    return math.ceil(rows / tp) / rows


def stage_runs(
    model: ModelSpec,
    virtual: list[list[Segment]],
    pp: int,
    tp: int,
    sequence_parallel: bool,
    micro_batch: int,
    replicate: Sequence[str] = (),
) -> list[StageRun]:
    """Each stage's StageRun: replicated where it holds a unit of `replicate` alone (the
    planner allows no other), tensor-parallel otherwise (with tp = 1 they are the same)."""
    out = []
    for stage in range(pp):
        units = {s.unit for segments in virtual[stage::pp] for s in segments}
        if tp == 1 or not units & set(replicate):
            out.append(StageRun(tensor_parallel(tp, sequence_parallel)))
            continue
        if len(units) > 1:
            raise ConfigError(f"pipeline stage {stage} holds units {sorted(units)}: only a unit alone on its stage is replicated")
        out.append(StageRun(Sharding(), replicated_rows(model.unit(units.pop()), micro_batch, tp), True))
    return out


def replicated_transfer(nbytes: float, tp: int, rows: float) -> StageTransfer:
    """A boundary with a stage replicated over its TP group (`rows`: that stage's busiest
    share): each rank sends its share of the `nbytes` activation (or gradient), whatever
    the other side holds; a TP stage all-gathers the shares into the whole, padded to the
    largest (an all-gather takes equal parts), when it receives them and, under sequence
    parallelism (it holds its tokens of every row, not whole rows), before it sends."""
    send = nbytes * rows
    return StageTransfer(send, send * tp)
