"""Megatron-style tensor-parallel linear layers, one autograd Function each (AxoNN style).

Column-parallel: each TP rank holds a slice of the output features; its input is
replicated, so the input's gradient is the sum over ranks (all-reduce in backward).
Row-parallel: each rank holds a slice of the input features; the partial products are
summed (all-reduce in forward) and the bias added once after the sum.

Under sequence parallelism (runtime.modules.sequence) a column-parallel layer gathers the
sequence of its input and a row-parallel one scatters its output's sequence; under
StepCCL's overlap, in chunks paired with the GEMM (runtime.modules.stepccl).

Only a rank's shard of a weight is ever materialised: each row is drawn from its own
seed (taken off the global RNG, which every TP degree consumes identically), so a shard
holds the very values of the same rows of a 1-rank run's whole weight.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from src.runtime.comm import all_reduce, chunked_all_reduce
from src.runtime.modules.sequence import TP, gather_sequence, reduce_grad, scatter_sequence
from src.runtime.modules.stepccl import gathered_column, scattered_row


@dataclass
class _Overlap:
    """StepCCL's TP overlap for the pass now running: its row chunks (1: none). The
    executor sets it from the plan (`tp_overlap`); a column-parallel layer keeps its
    forward's count for its backward."""

    chunks: int = 1


OVERLAP = _Overlap()


@contextmanager
def tp_overlap(chunks: int) -> Iterator[None]:
    previous, OVERLAP.chunks = OVERLAP.chunks, chunks
    try:
        yield
    finally:
        OVERLAP.chunks = previous


def linear_shard(d_in: int, d_out: int, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x cols of nn.Linear's initialisation (weight and bias uniform in +-1/sqrt(d_in),
    as kaiming_uniform with a=sqrt(5) gives), materialising one whole row at a time."""
    bound = 1 / math.sqrt(d_in)
    seed = int(torch.randint(2**62, ()))
    generator = torch.Generator()
    weight = torch.empty(len(rows), len(cols))
    for i, row in enumerate(rows.tolist()):
        generator.manual_seed(seed + row)
        weight[i] = torch.rand(d_in, generator=generator)[cols]
    generator.manual_seed(seed + d_out)
    bias = torch.rand(d_out, generator=generator)[rows]
    return weight.mul_(2 * bound).sub_(bound), bias.mul_(2 * bound).sub_(bound)


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TP) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.has_bias, ctx.chunks = tp, bias is not None, OVERLAP.chunks
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_w: list[torch.Tensor] = []

        def weight_grad() -> None:
            grad_w.append(grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))

        if ctx.tp.size > 1 and ctx.chunks > 1:
            # The input gradient's all-reduce, in row chunks, hidden under the later
            # chunks' GEMMs and the weight gradient's (Megatron-LM's async all-reduce, StepCCL's chunks).
            rows = grad.reshape(-1, grad.shape[-1])
            parts = chunked_all_reduce((part @ weight for part in rows.chunk(ctx.chunks)), ctx.tp.group, "tp", weight_grad)
            grad_x = torch.cat(parts).reshape(*grad.shape[:-1], weight.shape[1])
        else:
            grad_x = grad @ weight
            if ctx.tp.size > 1:
                all_reduce(grad_x, ctx.tp.group, "tp")
            weight_grad()
        return grad_x, grad_w[0], _bias_grad(grad) if ctx.has_bias else None, None


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TP) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        if tp.size > 1 and OVERLAP.chunks > 1:
            # Each row chunk's partial sums travel while the next chunk's GEMM runs.
            rows = x.reshape(-1, x.shape[-1])
            parts = chunked_all_reduce((part @ weight.t() for part in rows.chunk(OVERLAP.chunks)), tp.group, "tp")
            out = torch.cat(parts).reshape(*x.shape[:-1], weight.shape[0])
        else:
            out = x @ weight.t()
            if tp.size > 1:
                all_reduce(out, tp.group, "tp")
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad @ weight, grad_w, _bias_grad(grad) if ctx.has_bias else None, None


def _bias_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0)


class ColumnParallelLinear(nn.Module):
    """Output features split over TP. `rows` picks this rank's output rows of the whole
    weight (default: the rank's contiguous block; attention passes its heads' rows).
    `token_states`: the input is the unit's token states (split by sequence under sequence
    parallelism), not another unit's replicated memory."""

    def __init__(
        self, d_in: int, d_out: int, tp: TP, rows: torch.Tensor | None = None, bias: bool = True, token_states: bool = True
    ) -> None:
        super().__init__()
        if rows is None:
            rows = torch.arange(d_out).chunk(tp.size)[tp.rank]
        weight, bias_init = linear_shard(d_in, d_out, rows, torch.arange(d_in))
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias_init) if bias else None
        self.tp = tp
        self.token_states = token_states

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.tp.sequence_parallel and self.token_states:
            if OVERLAP.chunks > 1:
                return gathered_column(x, self.weight, self.bias, self.tp, OVERLAP.chunks)
            # The gather's backward reduce-scatters the input gradient's partial sums.
            return torch.nn.functional.linear(gather_sequence(x, self.tp), self.weight, self.bias)
        return _ColumnParallel.apply(x, self.weight, self.bias, self.tp)


class RowParallelLinear(nn.Module):
    """Input features split over TP (contiguous blocks, or `cols`); bias replicated."""

    def __init__(self, d_in: int, d_out: int, tp: TP, cols: torch.Tensor | None = None, bias: bool = True) -> None:
        super().__init__()
        if cols is None:
            cols = torch.arange(d_in).chunk(tp.size)[tp.rank]
        weight, bias_init = linear_shard(d_in, d_out, torch.arange(d_out), cols)
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias_init) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.tp.sequence_parallel:
            if OVERLAP.chunks > 1:
                y = scattered_row(x, self.weight, self.tp, OVERLAP.chunks)
            else:
                y = scatter_sequence(x @ self.weight.t(), self.tp)
            return y if self.bias is None else y + reduce_grad(self.bias, self.tp)
        return _RowParallel.apply(x, self.weight, self.bias, self.tp)


def head_rows(heads: int, head_dim: int, parts: int, tp: TP) -> torch.Tensor:
    """Rows of a fused projection of `parts` blocks (q, k, v) of `heads` heads each that
    belong to this rank's heads: head-aligned TP keeps each head whole on one rank."""
    local = heads // tp.size
    first = tp.rank * local * head_dim
    block = torch.arange(first, first + local * head_dim)
    return torch.cat([block + p * heads * head_dim for p in range(parts)])
