"""DistMM's batch-sync on separate towers: each rank holds ONE modality's features.

A rank scores its own rows against the whole contrastive batch of the OTHER modality
(§5.3.2: one similarity product per device), so it receives only those rows: one
all-to-all over the interaction group in which every rank sends its rows to the ranks of
the other tower. Backward is the same all-to-all reversed, summing the gradients each
rank's loss put on a row (the paper's reduce-scatter). The ranks' loss shares add up to
the contrastive loss of the whole batch, so the gradients that come back are exactly
those of that loss (the oracle test checks it).

A tower with TP holds each replica's features on all its TP ranks: they split the rows
between them, as the Program's batch-sync Work says (rows = ceil(share / tp)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from src.errors import ConfigError
from src.models.spec import ModelSpec
from src.program import Plan
from src.runtime.comm import CLOCK, all_reduce
from src.runtime.modules.contrastive import ContrastiveLoss
from src.runtime.roster import Roster


@dataclass(frozen=True)
class Rows:
    """The rows one rank scores: `count` rows of `tower` starting at `start` of its
    replica's features, at `offset` of the contrastive batch."""

    rank: int
    tower: str
    start: int
    count: int
    offset: int


@dataclass(frozen=True)
class Layout:
    rows: tuple[Rows, ...]  # in the interaction group's rank order
    me: Rows

    @property
    def send(self) -> list[int]:
        return [self.me.count if r.tower != self.me.tower else 0 for r in self.rows]

    @property
    def receive(self) -> list[int]:
        return [r.count if r.tower != self.me.tower else 0 for r in self.rows]


def layout(plan: Plan, model: ModelSpec, roster: Roster, group: tuple[int, ...], rank: int) -> Layout:
    """Who scores which rows of a batch-sync, from the plan: replica d of a tower holds
    the d-th share of the contrastive batch (runtime.inputs), its TP ranks split it."""
    towers = [p for p, c in model.flows if c == model.interaction]
    rows = []
    for holder in group:
        held = [t for t in towers if any(s.rank == holder and model.unit(t).num_layers - 1 in s.layers
                                         for s in roster.seats.get(t, []))]
        if len(held) != 1:
            raise ConfigError(f"rank {holder} holds the features of {held or 'no tower'} at a batch-sync; "
                              f"separate placement needs exactly one tower per rank")
        unit_plan, seat = plan.unit(held[0]), roster.seat(held[0], holder)
        share = unit_plan.batch_per_replica // int(unit_plan.details.get("batch_sync_groups", 1))
        per_rank = math.ceil(share / unit_plan.tp)
        start = min(share, seat.tp_index * per_rank)
        count = min(share, start + per_rank) - start
        rows.append(Rows(holder, held[0], start, count, seat.replica * share + start))
    for tower in towers:
        mine = [r for r in rows if r.tower == tower]
        if [r.offset for r in mine] != [sum(r.count for r in mine[:i]) for i in range(len(mine))]:
            raise ConfigError(f"the batch-sync group {group} does not list {tower}'s rows in batch order")
    sizes = {t: sum(r.count for r in rows if r.tower == t) for t in towers}
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"the towers bring different contrastive batches to a batch-sync: {sizes}")
    return Layout(tuple(rows), next(r for r in rows if r.rank == rank))


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, send: list[int], receive: list[int]):
        ctx.group, ctx.send, ctx.receive = group, send, receive
        copies = sum(1 for n in send if n)
        out = local.new_empty(sum(receive), local.shape[1])
        with CLOCK.timed("interaction"):
            dist.all_to_all_single(out, torch.cat([local] * copies) if copies else local[:0], receive, send,
                                   group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), grad.shape[1])
        with CLOCK.timed("interaction"):
            dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        rows = max(ctx.send, default=0)
        return back.view(-1, rows, grad.shape[1]).sum(0) if back.numel() else back[:rows], None, None, None


def sync_gradients(loss_module: ContrastiveLoss, features: torch.Tensor, image: bool, where: Layout,
                   group: dist.ProcessGroup, norm: float) -> tuple[float, list[torch.Tensor], torch.Tensor]:
    """One batch-sync on this rank: its share of the loss (the sum of the rank's rows'
    cross-entropies / `norm`), the gradients of the whole loss for the interaction's
    parameters (summed over the group, so every rank has them), and for `features`
    (this rank's replica's rows; rows another TP rank scores get zero here)."""
    leaf = features.detach().requires_grad_()
    mine = leaf[where.me.start:where.me.start + where.me.count]
    others = _Exchange.apply(mine, group, where.send, where.receive)
    pair = (mine, None, None, others) if image else (None, mine, others, None)
    loss = loss_module(*pair, where.me.offset) / norm
    params = [p for p in loss_module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params + [leaf])
    flat = all_reduce(torch.cat([g.reshape(-1) for g in grads[:-1]]), group, "interaction")
    param_grads = [g.view_as(p) for g, p in zip(flat.split([p.numel() for p in params]), params)]
    return float(loss.detach()), param_grads, grads[-1]
