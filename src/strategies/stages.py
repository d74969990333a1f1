"""Cutting a model's units into pipeline stages.

Stage boundaries fall between transformer blocks (layers with TP communication); the
embedding, patchify, projector and head layers stay with their neighbouring block, and the
divisibility rule counts blocks, as Megatron's --num-layers does.
"""
from __future__ import annotations

from dataclasses import dataclass

from src.errors import ConfigError
from src.models.flows import unit_order
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


def boundary_elems(unit: UnitSpec, layer_end: int) -> int:
    """Elements per sample leaving a segment that ends at `layer_end`."""
    return unit.output_elems if layer_end >= unit.num_layers else unit.seq_len * unit.hidden
