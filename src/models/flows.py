"""What passes between a model's units, and where it enters: read off the ModelSpec.

Three kinds of flow (producer -> consumer):
- interaction: a tower's pooled feature feeds a contrastive loss (CLIP's towers);
- cross: the consumer's layers from `layer` on cross-attend to the producer's final token
  states (CoCa's text decoder reads the image tokens: its xattn_kv kernels project them);
- chain: the producer's output is the consumer's input (an MLLM's encoder feeds the LLM).
The payload names the Programs use follow from these: a unit ends in a 'feature' for an
interaction, in 'tokens' for a cross-attending consumer, in 'x' for a chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from src.errors import ConfigError
from src.models.spec import ModelSpec, UnitSpec

FlowKind = Literal["interaction", "cross", "chain"]
TENSOR = {"interaction": "feature", "cross": "tokens", "chain": "x"}


@dataclass(frozen=True)
class Flow:
    producer: str
    consumer: str
    kind: FlowKind
    layer: int  # the consumer's layer where it enters
    elems: int  # elements per sample
    source: int  # the producer's layer boundary where it leaves

    @property
    def tensor(self) -> str:
        return TENSOR[self.kind]


def feature_boundary(unit: UnitSpec) -> int:
    """Where a tower's contrastive feature leaves it: after its projection head, which is
    its last layer (CLIP) or sits between its unimodal and multimodal layers (CoCa's text)."""
    return next((i + 1 for i, layer in enumerate(unit.layers) if layer.name == "projection"), unit.num_layers)


# Emitters ask for a model's flows (and a unit's outputs) once per instruction; finding a
# cross flow scans the consumer's kernels. Keyed by identity: hashing a ModelSpec walks all
# its layers.
_FLOWS: dict[int, tuple[ModelSpec, tuple[Flow, ...], dict[str, tuple[tuple[int, str], ...]]]] = {}
_FLOWS_KEPT = 16


def _cached(model: ModelSpec) -> tuple[ModelSpec, tuple[Flow, ...], dict[str, tuple[tuple[int, str], ...]]]:
    cached = _FLOWS.get(id(model))
    if cached is not None and cached[0] is model:
        return cached
    flows = _find_flows(model)
    outputs = {u.name: tuple(dict.fromkeys((f.source, f.tensor) for f in flows if f.producer == u.name)) for u in model.units}
    if len(_FLOWS) >= _FLOWS_KEPT:
        del _FLOWS[next(iter(_FLOWS))]
    cached = _FLOWS[id(model)] = (model, flows, outputs)
    return cached


def flows_of(model: ModelSpec) -> tuple[Flow, ...]:
    return _cached(model)[1]


def _find_flows(model: ModelSpec) -> tuple[Flow, ...]:
    out = []
    for producer, consumer in model.flows:
        source, sink = model.unit(producer), model.unit(consumer)
        end = source.num_layers
        if consumer == model.interaction:
            out.append(Flow(producer, consumer, "interaction", 0, source.output_elems, feature_boundary(source)))
            continue
        cross = next((i for i, layer in enumerate(sink.layers) if _reads_tokens(layer, source)), None)
        if cross is not None:
            out.append(Flow(producer, consumer, "cross", cross, source.seq_len * source.hidden, end))
        else:
            out.append(Flow(producer, consumer, "chain", 0, source.output_elems, end))
    return tuple(out)


def _reads_tokens(layer, producer: UnitSpec) -> bool:
    """A layer cross-attends to the producer's final token states if its cross-attention
    keys and values are projected from them (CoCa's decoder reads the image tokens); an
    MLLM's U-Net cross-attends to its own projected condition instead, which its first
    layer makes from the LLM's output (a chain)."""
    return any(k.name == "xattn_kv" and k.m == producer.seq_len and k.k == producer.hidden for k in layer.kernels)


def chain_key(producer: str) -> str:
    """The state key under which a chain flow's tensor enters its consumer: named by its
    producer, so a consumer fed by several (Optimus's LLM after two encoders) binds each
    where its modules read it, whatever order the payloads come in."""
    return f"inputs.{producer}"


def chain_sources(model: ModelSpec, unit: str) -> tuple[str, ...]:
    """The units chained into `unit`, in the model's flow order (where their outputs
    enter: an LLM's image tokens from its first encoder first)."""
    return tuple(f.producer for f in flows_of(model) if f.consumer == unit and f.kind == "chain")


def outputs_of(model: ModelSpec, unit: str) -> tuple[tuple[int, str], ...]:
    """(layer boundary, tensor) of what a unit hands on (nothing for a unit ending in its loss)."""
    return _cached(model)[2].get(unit, ())


def unit_order(model: ModelSpec) -> list[str]:
    """Units in data-flow order (producers first), model order among equals."""
    names = [u.name for u in model.units]
    order: list[str] = []
    remaining = list(names)
    while remaining:
        for name in remaining:
            producers = [p for p, c in model.flows if c == name]
            if all(p in order for p in producers):
                order.append(name)
                remaining.remove(name)
                break
        else:
            raise ConfigError(f"model {model.name} has a cycle in its unit flows {model.flows}")
    return order
