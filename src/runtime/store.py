"""The payloads one rank holds during a step, by name, assembled from their rows.

A payload arrives whole (a Compute's output) or in pieces (rows a route delivered, a
gathered batch). Pieces of a gradient that land on the same rows are summed, as the
chain rule sums the gradients of a tensor used several times; pieces of a value must not
overlap. Reading a payload returns its rows from the first held to the last, and where
they start.
"""

from __future__ import annotations

import functools
import operator

import torch

from src.errors import ConfigError
from src.models.spec import ModelSpec
from src.program import Payload


def row_shape(model: ModelSpec, payload: Payload, sequence_parts: int = 1) -> tuple[int, ...]:
    """The shape of one sample's row of a payload; `sequence_parts`: the TP degree of a
    sequence-parallel unit, whose token states between its layers are split by sequence."""
    if payload.unit == model.interaction:
        tower = payload.tensor.rsplit(".", 1)[0]
        return (model.unit(tower).output_elems,)
    unit = model.unit(payload.unit)
    if payload.tensor == "feature" or (payload.tensor == "x" and payload.layer == unit.num_layers and unit.output_elems):
        return (unit.output_elems,)  # a pooled feature, or what a unit hands on along a chain (flattened)
    inside = payload.tensor == "x" and 0 < payload.layer < unit.num_layers
    return (unit.seq_len // (sequence_parts if inside else 1), unit.hidden)


class PayloadStore:
    def __init__(self) -> None:
        self._pieces: dict[Payload, list[tuple[int, torch.Tensor]]] = {}
        self._whole: dict[Payload, tuple[int, torch.Tensor]] = {}

    def clear(self) -> None:
        self._pieces.clear()
        self._whole.clear()

    def put(self, payload: Payload, tensor: torch.Tensor) -> None:
        """Hold `tensor` as the rows `payload.rows` (all from row 0 if None) of its payload."""
        key = payload.whole
        start = payload.rows[0] if payload.rows is not None else 0
        if payload.rows is not None and payload.rows[1] - start != tensor.shape[0]:
            raise ConfigError(f"{payload} holds {payload.rows[1] - start} rows but {tensor.shape[0]} arrived")
        self._whole.pop(key, None)
        self._pieces.setdefault(key, []).append((start, tensor))

    def replace(self, payload: Payload, tensor: torch.Tensor) -> None:
        """Hold `tensor` as the whole payload, dropping what was held (an all-reduce's result)."""
        self._pieces.pop(payload.whole, None)
        self._whole.pop(payload.whole, None)
        self.put(payload, tensor)

    def __contains__(self, payload: Payload) -> bool:
        return payload.whole in self._pieces

    def read(self, payload: Payload) -> tuple[int, torch.Tensor]:
        """(first row held, the rows held from there on) of a payload; a payload with rows
        set reads just those rows."""
        key = payload.whole
        held = self._whole.get(key)
        if held is None:
            pieces = self._pieces.get(key)
            if not pieces:
                raise ConfigError(f"{key} is read before anything produced or received it")
            held = self._whole[key] = self._assemble(key, pieces)
        start, tensor = held
        if payload.rows is None:
            return start, tensor
        lo, hi = payload.rows
        if lo < start or hi > start + tensor.shape[0]:
            raise ConfigError(f"{payload} reads rows outside the {tensor.shape[0]} held from row {start}")
        return lo, tensor[lo - start : hi - start]

    def tensor(self, payload: Payload) -> torch.Tensor:
        return self.read(payload)[1]

    @staticmethod
    def _assemble(key: Payload, pieces: list[tuple[int, torch.Tensor]]) -> tuple[int, torch.Tensor]:
        if len(pieces) == 1:
            return pieces[0]
        spans = sorted(((start, start + t.shape[0], t) for start, t in pieces), key=lambda span: span[0])
        first, last = spans[0][0], max(end for _, end, _ in spans)
        reach = first
        for start, end, _ in spans:  # the rows as integers: no tensor work to check them
            if start > reach:
                raise ConfigError(f"{key}: rows {first}-{last} have a gap")
            if start < reach and not key.grad:
                raise ConfigError(f"{key}: rows arrived twice")
            reach = max(reach, end)
        if not key.grad or all(a_end <= b_start for (_, a_end, _), (b_start, _, _) in zip(spans, spans[1:])):
            return first, torch.cat([t for _, _, t in spans])  # rows side by side: one copy
        sample = spans[0][2]
        if all((start, end) == (first, last) and t.dtype == sample.dtype for start, end, t in spans):
            return first, functools.reduce(operator.add, (t for _, _, t in spans))  # whole gradients: their sum, one op each
        out = sample.new_zeros((last - first,) + tuple(sample.shape[1:]))
        for start, end, tensor in spans:  # gradients of the same rows add up
            out[start - first : end - first] += tensor
        return first, out
