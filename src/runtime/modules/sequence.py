"""Megatron-LM's sequence parallelism (Korthikanti et al.), each move an autograd Function with its adjoint.

Between a unit's layers the token states are split by sequence over the TP group (each
rank holds s/tp tokens), so LayerNorms and residuals run on 1/tp of the tokens. A
column-parallel layer all-gathers the sequence before its GEMM (reduce-scatter of the
input gradient in backward), a row-parallel layer reduce-scatters its partial sums along
the sequence instead of all-reducing them (all-gather in backward). The embedding hands
on its rank's part of the sequence; a head gathers the whole sequence back (its compute
is replicated over TP, as without sequence parallelism).

A parameter replicated over TP but applied to 1/tp of the tokens (LayerNorms, the
row-parallel bias) gets 1/tp of its gradient on each rank: `reduce_grad` sums them.

gloo has no reduce-scatter: it all-reduces and keeps the rank's part, as elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from src.runtime.comm import all_reduce, collective

SEQ = 1  # token states are (batch, sequence, hidden)


@dataclass(frozen=True)
class TP:
    """This rank's place in its unit's TP group (size 1: no group, no communication);
    sequence_parallel: token states between layers are split by sequence over the group."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False


Move = Callable[[torch.Tensor, TP], torch.Tensor]


def _gather(x: torch.Tensor, tp: TP) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    local = x.contiguous()
    collective("tp", lambda async_op: dist.all_gather(parts, local, group=tp.group, async_op=async_op))
    return torch.cat(parts, dim=SEQ)


def _own(x: torch.Tensor, tp: TP) -> torch.Tensor:
    return x.chunk(tp.size, dim=SEQ)[tp.rank].contiguous()


def _reduce_scatter(x: torch.Tensor, tp: TP) -> torch.Tensor:
    return _own(all_reduce(x.contiguous().clone(), tp.group, "tp"), tp)


class _Move(torch.autograd.Function):
    """A move of the sequence in forward and its adjoint in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TP, move: Move, adjoint: Move) -> torch.Tensor:
        ctx.tp, ctx.adjoint = tp, adjoint
        return move(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.adjoint(grad, ctx.tp), None, None, None


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: torch.Tensor, tp: TP) -> torch.Tensor:
        ctx.tp = tp
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous().clone(), ctx.tp.group, "tp"), None


def gather_sequence(x: torch.Tensor, tp: TP) -> torch.Tensor:
    """Into a column-parallel GEMM: the whole sequence; its input gradient is a partial
    sum on each rank, reduce-scattered back to the parts."""
    return _Move.apply(x, tp, _gather, _reduce_scatter) if tp.sequence_parallel else x


def scatter_sequence(x: torch.Tensor, tp: TP) -> torch.Tensor:
    """Out of a row-parallel GEMM: partial sums reduced, each rank keeping its part."""
    return _Move.apply(x, tp, _reduce_scatter, _gather) if tp.sequence_parallel else x


def split_sequence(x: torch.Tensor, tp: TP) -> torch.Tensor:
    """Out of a replicated layer (an embedding): each rank keeps its part; the gradients
    of the parts are gathered, so the replicated layer's gradient is whole on every rank."""
    return _Move.apply(x, tp, _own, _gather) if tp.sequence_parallel else x


def unsplit_sequence(x: torch.Tensor, tp: TP) -> torch.Tensor:
    """Into a replicated layer (a head): the whole sequence; every rank computes the same
    gradient of it and keeps its part's."""
    return _Move.apply(x, tp, _gather, _own) if tp.sequence_parallel else x


def reduce_grad(param: torch.Tensor, tp: TP) -> torch.Tensor:
    return _ReduceGrad.apply(param, tp) if tp.sequence_parallel else param
