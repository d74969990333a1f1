"""What passes between a model's units, and where it enters: read off the ModelSpec.

Three kinds of flow (producer -> consumer):
- interaction: a tower's pooled feature feeds a contrastive loss (CLIP's towers);
- cross: the consumer's layers from `layer` on cross-attend to the producer's final token
  states (CoCa's text decoder reads the image tokens; kernels named xattn_*);
- chain: the producer's output is the consumer's input (an MLLM's encoder feeds the LLM).
The payload names the Programs use follow from these: a unit ends in a 'feature' for an
interaction, in 'tokens' for a cross-attending consumer, in 'x' for a chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from src.models.spec import ModelSpec

FlowKind = Literal["interaction", "cross", "chain"]
TENSOR = {"interaction": "feature", "cross": "tokens", "chain": "x"}


@dataclass(frozen=True)
class Flow:
    producer: str
    consumer: str
    kind: FlowKind
    layer: int    # the consumer's layer where it enters
    elems: int    # elements per sample

    @property
    def tensor(self) -> str:
        return TENSOR[self.kind]


def flows_of(model: ModelSpec) -> list[Flow]:
    out = []
    for producer, consumer in model.flows:
        source, sink = model.unit(producer), model.unit(consumer)
        if consumer == model.interaction:
            out.append(Flow(producer, consumer, "interaction", 0, source.output_elems))
            continue
        cross = next((i for i, layer in enumerate(sink.layers)
                      if any(k.name.startswith("xattn_") for k in layer.kernels)), None)
        if cross is not None:
            out.append(Flow(producer, consumer, "cross", cross, source.seq_len * source.hidden))
        else:
            out.append(Flow(producer, consumer, "chain", 0, source.output_elems))
    return out


def outputs_of(model: ModelSpec, unit: str) -> tuple[str, ...]:
    """The tensors a unit's last layer hands on (none for a unit ending in its loss)."""
    return tuple(dict.fromkeys(f.tensor for f in flows_of(model) if f.producer == unit))
