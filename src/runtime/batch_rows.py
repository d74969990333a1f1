"""The batch-sync all-to-alls of towers on separate ranks on the real backend.

Every scorer of every tower takes part with the rows it scores: unequal numbers of rows
(the towers have different replica counts and TP degrees, and a TP rank may score none).
So each first tells the group which tower it scores, which rows, and which towers' keys
it wants (a small all-gather); then one all-to-all, every piece padded to the longest
(gloo's all-to-all takes equal pieces only):

- forward: every rank sends its query rows to every rank that wants its tower's keys,
  which puts them at their rows of those keys;
- backward: every rank sends, from the key gradients it holds, each scorer of that tower
  the gradient of the scorer's rows; the scorer adds up what arrives into its query
  gradient.

A collective takes this path when all its payloads are in the interaction's numbering
(its queries and keys), which holds on every rank of the group alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from src.models.spec import ModelSpec
from src.program import Collective, Payload
from src.runtime.comm import CLOCK
from src.runtime.store import PayloadStore, row_shape

NONE = -1


def placed_by_rows(collective: Collective, interaction: str | None) -> bool:
    payloads = collective.inputs + collective.outputs
    return collective.op == "all_to_all" and bool(payloads) and all(p.unit == interaction for p in payloads)


def _tower(payload: Payload) -> str:
    return payload.tensor.rsplit(".", 1)[0]


def _towers(model: ModelSpec) -> list[str]:
    """The contrastive towers, in model order: every rank numbers them alike."""
    return [producer for producer, consumer in model.flows if consumer == model.interaction]


def _held(store: PayloadStore, payload: Payload) -> tuple[int, torch.Tensor] | None:
    return store.read(payload) if payload in store else None


class _Exchange:
    """One all-to-all of rows over a group: who scores which rows of which tower."""

    def __init__(
        self, model: ModelSpec, ranks: tuple[int, ...], group: dist.ProcessGroup, kind: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.model, self.ranks, self.group, self.kind = model, ranks, group, kind
        self.dtype, self.device = dtype, device
        self.towers = _towers(model)

    def elems(self, tower: str) -> int:
        return self.model.unit(tower).output_elems

    def layout(self, own: str | None, rows: tuple[int, int], wanted: set[str]) -> list[tuple[int, int, int, int]]:
        """Every rank's (tower index or NONE, first row, end row, mask of the towers it wants)."""
        mask = sum(1 << i for i, t in enumerate(self.towers) if t in wanted)
        mine = torch.tensor(
            [self.towers.index(own) if own is not None else NONE, rows[0], rows[1], mask], dtype=torch.int64, device=self.device
        )
        everyone = [torch.empty_like(mine) for _ in self.ranks]
        with CLOCK.timed(self.kind):
            dist.all_gather(everyone, mine, group=self.group)
        return [(int(t), int(a), int(b), int(m)) for t, a, b, m in (e.tolist() for e in everyone)]

    def swap(self, pieces: list[torch.Tensor | None], longest: int) -> list[torch.Tensor]:
        """Send pieces[j] (None: nothing) to rank j of the group; returns what each sent here."""
        send = []
        for piece in pieces:
            padded = torch.zeros(longest, dtype=self.dtype, device=self.device)
            if piece is not None:
                padded[: piece.numel()] = piece.detach().to(self.dtype).reshape(-1)
            send.append(padded)
        received = [torch.empty(longest, dtype=self.dtype, device=self.device) for _ in self.ranks]
        with CLOCK.timed(self.kind):
            dist.all_to_all(received, send, group=self.group)
        return received


def exchange_rows(
    model: ModelSpec,
    store: PayloadStore,
    collective: Collective,
    ranks: tuple[int, ...],
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Forward or backward all-to-all of a batch-sync (a backward carries gradients)."""
    x = _Exchange(model, ranks, group, collective.kind, dtype, device)
    backward = any(p.grad for p in collective.inputs + collective.outputs)
    (_returned if backward else _sent)(x, store, collective)


def _sent(x: _Exchange, store: PayloadStore, collective: Collective) -> None:
    (source,) = collective.inputs
    own = _tower(source)
    held = _held(store, source)
    rows = (held[0], held[0] + held[1].shape[0]) if held is not None else (0, 0)
    targets = {_tower(p): p for p in collective.outputs}
    layout = x.layout(own, rows, set(targets))
    longest = max(((b - a) * x.elems(x.towers[t]) for t, a, b, _ in layout if t != NONE), default=0)
    if longest == 0:
        return
    mine = x.towers.index(own)
    pieces = [held[1] if held is not None and mask >> mine & 1 else None for _, _, _, mask in layout]
    for (t, a, b, _), buffer in zip(layout, x.swap(pieces, longest)):
        tower = x.towers[t] if t != NONE else None
        if tower in targets and b > a:
            target = targets[tower]
            store.put(target.part(a, b), buffer[: (b - a) * x.elems(tower)].view((b - a,) + row_shape(x.model, target)))


def _returned(x: _Exchange, store: PayloadStore, collective: Collective) -> None:
    target = collective.outputs[0] if collective.outputs else None
    held = _held(store, target.value()) if target is not None else None
    rows = (held[0], held[0] + held[1].shape[0]) if held is not None else (0, 0)
    layout = x.layout(_tower(target) if target is not None else None, rows, set())
    longest = max(((b - a) * x.elems(x.towers[t]) for t, a, b, _ in layout if t != NONE), default=0)
    if longest == 0:
        return
    grads = {_tower(p): _held(store, p) for p in collective.inputs}
    pieces = []
    for t, a, b, _ in layout:
        grad = grads.get(x.towers[t]) if t != NONE else None
        pieces.append(grad[1][a - grad[0] : b - grad[0]] if grad is not None and b > a else None)
    received = x.swap(pieces, longest)
    if target is not None and held is not None and rows[1] > rows[0]:
        count = rows[1] - rows[0]
        summed = torch.stack([r[: count * x.elems(_tower(target))] for r in received]).sum(0)
        store.put(target.part(*rows), summed.view((count,) + row_shape(x.model, target)))
