"""The batch-sync collectives of separate towers (DistMM) on the real backend.

Every scorer of every tower takes part, each with the rows it scores: unequal numbers of
rows (the towers have different replica counts and TP degrees, and a TP rank may score
none), of different towers. So each first tells the group which rows of which tower it
holds (a small all-gather), then:

- all-gather: every rank contributes its query rows, padded to the longest contribution;
  every rank puts every contribution at its rows of its tower's keys;
- reduce-scatter: every rank adds the key gradients it holds into one buffer of all the
  trained towers' batches; the buffers are summed (gloo has no reduce-scatter: an
  all-reduce) and every rank takes the rows of the query gradients it needs.

A collective takes this path when all its payloads are in the interaction's numbering
(its queries and keys), which holds on every rank of the group alike; a colocated
baseline's gather (tower features to keys) keeps the equal-sized one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from src.models.spec import ModelSpec
from src.program import Collective, Payload
from src.runtime.comm import CLOCK, all_reduce
from src.runtime.store import PayloadStore, row_shape


def placed_by_rows(collective: Collective, interaction: str | None) -> bool:
    payloads = collective.inputs + collective.outputs
    return (collective.op in ("all_gather", "reduce_scatter") and bool(payloads)
            and all(p.unit == interaction for p in payloads))


def _tower(payload: Payload) -> str:
    return payload.tensor.rsplit(".", 1)[0]


def _towers(model: ModelSpec) -> list[str]:
    """The contrastive towers, in model order: every rank numbers them alike."""
    return [producer for producer, consumer in model.flows if consumer == model.interaction]


def _held(store: PayloadStore, payload: Payload) -> tuple[int, torch.Tensor] | None:
    return store.read(payload) if payload in store else None


def _elems(model: ModelSpec, tower: str) -> int:
    return model.unit(tower).output_elems


def gather_rows(model: ModelSpec, store: PayloadStore, collective: Collective, ranks: tuple[int, ...],
                group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> None:
    towers = _towers(model)
    extents = torch.zeros((len(towers), 2), dtype=torch.int64, device=device)
    pieces = []
    for payload in sorted(collective.inputs, key=lambda p: towers.index(_tower(p))):
        held = _held(store, payload)
        if held is not None:
            start, tensor = held
            i = towers.index(_tower(payload))
            extents[i, 0], extents[i, 1] = start, start + tensor.shape[0]
            pieces.append(tensor.detach().to(dtype).reshape(-1))
    with CLOCK.timed(collective.kind):
        everyone = [torch.empty_like(extents) for _ in ranks]
        dist.all_gather(everyone, extents, group=group)
        sizes = [sum(int(e[i, 1] - e[i, 0]) * _elems(model, t) for i, t in enumerate(towers)) for e in everyone]
        local = torch.zeros(max(sizes), dtype=dtype, device=device)
        if pieces:
            flat = torch.cat(pieces)
            local[:flat.numel()] = flat
        parts = [torch.empty_like(local) for _ in ranks]
        dist.all_gather(parts, local, group=group)
    targets = {_tower(p): p for p in collective.outputs}
    for rows, part in zip(everyone, parts):
        offset = 0
        for i, tower in enumerate(towers):
            start, end = int(rows[i, 0]), int(rows[i, 1])
            count = (end - start) * _elems(model, tower)
            if count and tower in targets:
                shape = (end - start,) + row_shape(model, targets[tower])
                store.put(targets[tower].part(start, end), part[offset:offset + count].view(shape))
            offset += count


def scatter_rows(model: ModelSpec, store: PayloadStore, collective: Collective, ranks: tuple[int, ...],
                 group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> None:
    towers = _towers(model)
    inputs = [(p, _held(store, p)) for p in collective.inputs]
    outputs = [(p, _held(store, p.value())) for p in collective.outputs]
    ends = torch.zeros(len(towers), dtype=torch.int64, device=device)
    for payload, held in inputs + outputs:
        if held is not None:
            i = towers.index(_tower(payload))
            ends[i] = max(int(ends[i]), held[0] + held[1].shape[0])
    with CLOCK.timed(collective.kind):
        dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=group)
    offsets = [0]
    for i, tower in enumerate(towers):
        offsets.append(offsets[-1] + int(ends[i]) * _elems(model, tower))
    total = torch.zeros(offsets[-1], dtype=dtype, device=device)
    for payload, held in inputs:
        if held is not None:
            start, tensor = held
            i = towers.index(_tower(payload))
            at = offsets[i] + start * _elems(model, _tower(payload))
            total[at:at + tensor.numel()] += tensor.detach().to(dtype).reshape(-1)
    all_reduce(total, group, collective.kind)
    for payload, held in outputs:
        if held is not None:
            start, count = held[0], held[1].shape[0]
            tower = _tower(payload)
            at = offsets[towers.index(tower)] + start * _elems(model, tower)
            rows = total[at:at + count * _elems(model, tower)].view((count,) + row_shape(model, payload))
            store.put(payload.part(start, start + count), rows)
