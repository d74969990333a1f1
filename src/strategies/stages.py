"""Cutting a model's units into pipeline stages.

Stage boundaries fall between transformer blocks (layers with TP communication); the
embedding, patchify, projector and head layers stay with their neighbouring block, and the
divisibility rule counts blocks, as Megatron's --num-layers does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from src.errors import ConfigError
from src.models.flows import flows_of, unit_order
from src.models.spec import ModelSpec, UnitSpec


@dataclass(frozen=True)
class Segment:
    """Layers [start, end) of one unit, placed on one virtual pipeline stage."""

    unit: str
    layers: tuple[int, int]


def main_unit(model: ModelSpec) -> UnitSpec:
    """The unit a pipeline is built around: the one with the most parameters."""
    return max(model.units, key=lambda u: u.params)


def block_cuts(unit: UnitSpec, parts: int, uneven: bool, what: str) -> list[tuple[int, int]]:
    """Split a unit's layers into `parts` contiguous ranges with equal block counts."""
    blocks = [i for i, layer in enumerate(unit.layers) if layer.tp_allreduces > 0]
    if not blocks:
        blocks = list(range(unit.num_layers))
    if parts > len(blocks):
        raise ConfigError(f"{what}={parts} exceeds the {len(blocks)} blocks of unit {unit.name}")
    if len(blocks) % parts and not uneven:
        raise ConfigError(f"{what}={parts} does not divide the {len(blocks)} blocks of unit {unit.name} "
                          f"(set strategy.uneven_pp=true to allow stages of unequal depth)")
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


def pipeline_segments(model: ModelSpec, pp: int, vpp: int, modality_stages: str,
                      uneven: bool) -> list[list[Segment]]:
    """Virtual stages (pp·vpp of them, in model order) as lists of segments.

    The main unit (the LLM) is cut into equal parts. Other units either get stages of
    their own before/after it (modality_stages='extra', DistTrain §2.1's description of
    Megatron-LM for MLLMs: pp counts them) or join the first/last stage (`merged`, Optimus's
    "encoders in the first stage")."""
    order = unit_order(model)
    main = main_unit(model)
    before = [model.unit(n) for n in order[:order.index(main.name)]]
    after = [model.unit(n) for n in order[order.index(main.name) + 1:]]
    virtual = pp * vpp
    if modality_stages == "extra":
        extra = len(before) + len(after)
        if extra and vpp > 1:
            raise ConfigError(f"vpp={vpp} with the {extra} extra modality stages of {model.name}: "
                              f"interleaving needs strategy.modality_stages=merged")
        main_parts = virtual - extra
        if main_parts < 1:
            raise ConfigError(f"pp={pp} leaves no stage for {main.name}: {model.name} needs "
                              f"{extra} extra stages for {[u.name for u in before + after]}")
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
    range is as fast as possible. F(l, s), the best bottleneck of the first l layers in s
    ranges, is min over j < l of max(F(j, s-1), t_{j+1} + ... + t_l); the argmins give
    the cuts. O(L^2 x parts) at worst; the inner loop stops once the last range alone is
    slower than the best found."""
    count = len(times)
    if not 1 <= parts <= count:
        raise ConfigError(f"cannot cut {count} layers into {parts} non-empty stages")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    best = [prefix[:]]                     # best[s-1][l] = F(l, s)
    cut: list[list[int]] = [[0] * (count + 1)]
    for stages in range(2, parts + 1):
        previous = best[-1]
        row, row_cut = [float("inf")] * (count + 1), [0] * (count + 1)
        for end in range(stages, count + 1):
            value, arg = float("inf"), stages - 1
            for start in range(end - 1, stages - 2, -1):  # the last range is layers [start, end)
                last = prefix[end] - prefix[start]
                if last >= value:
                    break  # earlier starts only lengthen the last range
                candidate = max(previous[start], last)
                if candidate < value:
                    value, arg = candidate, start
            row[end], row_cut[end] = value, arg
        best.append(row)
        cut.append(row_cut)
    ranges, end = [], count
    for stages in range(parts, 0, -1):
        start = cut[stages - 1][end] if stages > 1 else 0
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def linear_chain(model: ModelSpec) -> list[UnitSpec]:
    """The model's units when they form one chain (each unit's whole output is the next
    unit's input); the balanced cut needs one, as Optimus Appendix B says."""
    order = unit_order(model)
    flows = flows_of(model)
    producers = {name: [f for f in flows if f.consumer == name] for name in order}
    for name in order:
        if len(producers[name]) > 1:
            raise ConfigError(f"strategy.balance=true cuts a linear chain of units (Optimus Appendix B), but "
                              f"{len(producers[name])} units ({', '.join(f.producer for f in producers[name])}) "
                              f"feed {name} in {model.name}")
    for previous, name in zip(order, order[1:]):
        flow = producers[name][0] if producers[name] else None
        if flow is None or flow.producer != previous or flow.kind != "chain":
            how = "nothing" if flow is None else f"a {flow.kind} flow from {flow.producer}"
            raise ConfigError(f"strategy.balance=true cuts a linear chain of units (Optimus Appendix B), but "
                              f"{name} of {model.name} takes {how}, not {previous}'s output as its input")
    return [model.unit(name) for name in order]


def chain_segments(units: Sequence[UnitSpec], ranges: Sequence[tuple[int, int]]) -> list[list[Segment]]:
    """Virtual stages from [start, end) ranges over the chain's layers numbered end to end."""
    offsets, total = [], 0
    for unit in units:
        offsets.append(total)
        total += unit.num_layers
    stages = []
    for start, end in ranges:
        stages.append([Segment(unit.name, (max(start - offset, 0), min(end - offset, unit.num_layers)))
                       for unit, offset in zip(units, offsets)
                       if start < offset + unit.num_layers and end > offset])
    return stages


def boundary_elems(unit: UnitSpec, layer_end: int) -> int:
    """Elements per sample leaving a segment that ends at `layer_end`."""
    return unit.output_elems if layer_end >= unit.num_layers else unit.seq_len * unit.hidden
