"""StepCCL's chunked TP layers under sequence parallelism (DistTrain §7, Figures 13 and 14).

A column-parallel layer's all-gather and a row-parallel layer's reduce-scatter are cut,
with the GEMM beside them, into `chunks` pairs along the sequence: each rank's part of the
sequence is split into `chunks` pieces, and chunk c gathers (or scatters) the c-th piece of
every rank's part. The transfers are issued at once and each GEMM chunk waits only for its
own, so later chunks travel while earlier ones compute (forward); in backward each chunk's
input gradient is reduced (or its output gradient gathered) under the next chunk's GEMMs
and the weight gradient. A chunk's rows come out in rank-major order, so the outputs are
put back in the sequence's order at the end (the paper's layout remap, Figure 14).

Only the waits are charged to the "tp" kind: the communication the compute did not hide.
gloo has no reduce-scatter: a chunk is all-reduced and each rank keeps its part, as in
runtime.modules.sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from src.runtime.comm import CLOCK
from src.runtime.modules.sequence import SEQ, TP


def _wait(handle: dist.Work) -> None:
    with CLOCK.timed("tp"):
        handle.wait()


def _gather_async(piece: torch.Tensor, tp: TP) -> tuple[list[torch.Tensor], dist.Work]:
    parts = [torch.empty_like(piece) for _ in range(tp.size)]
    return parts, dist.all_gather(parts, piece.contiguous(), group=tp.group, async_op=True)


def _by_rank(rows: torch.Tensor, ranks: int) -> torch.Tensor:
    """(batch, ranks x n, ...) rows in rank-major order as (batch, ranks, n, ...)."""
    return rows.reshape(rows.shape[0], ranks, -1, *rows.shape[2:])


def _rank_major(rows: torch.Tensor) -> torch.Tensor:
    """(batch, ranks, n, ...) as (batch, ranks x n, ...): _by_rank undone."""
    return rows.reshape(rows.shape[0], -1, *rows.shape[3:])


def _reduce_async(partial: torch.Tensor, tp: TP) -> tuple[torch.Tensor, dist.Work]:
    partial = partial.contiguous()
    return partial, dist.all_reduce(partial, group=tp.group, async_op=True)


def _own_parts(reduced: list[tuple[torch.Tensor, dist.Work]], tp: TP) -> torch.Tensor:
    """Each reduced chunk's rows of this rank, once it has landed, in sequence order."""
    own = []
    for partial, handle in reduced:
        _wait(handle)
        own.append(_by_rank(partial, tp.size)[:, tp.rank])
    return torch.cat(own, dim=SEQ)


class _GatheredColumn(torch.autograd.Function):
    """y = gather_sequence(x) @ W^T + b, the gather cut into chunks paired with the GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TP, chunks: int) -> torch.Tensor:
        pending = [_gather_async(piece, tp) for piece in x.tensor_split(chunks, dim=SEQ)]
        gathered, outputs = [], []
        for parts, handle in pending:
            _wait(handle)
            rows = torch.cat(parts, dim=SEQ)  # rank-major: every rank's c-th piece
            gathered.append(rows)
            outputs.append(_by_rank(torch.nn.functional.linear(rows, weight, bias), tp.size))
        ctx.save_for_backward(weight, *gathered)
        ctx.tp, ctx.has_bias = tp, bias is not None
        return _rank_major(torch.cat(outputs, dim=2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, *gathered = ctx.saved_tensors
        tp = ctx.tp
        sizes = [rows.shape[SEQ] // tp.size for rows in gathered]
        grads = [_rank_major(g) for g in _by_rank(grad, tp.size).split(sizes, dim=2)]
        reduced = [_reduce_async(g @ weight, tp) for g in grads]
        grad_w = torch.zeros_like(weight)
        for g, rows in zip(grads, gathered):
            grad_w += g.flatten(0, -2).t() @ rows.flatten(0, -2)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return _own_parts(reduced, tp), grad_w, grad_b, None, None


class _ScatteredRow(torch.autograd.Function):
    """y = scatter_sequence(x @ W^T), the reduce-scatter cut into chunks paired with the GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tp: TP, chunks: int) -> torch.Tensor:
        pieces = [_rank_major(p) for p in _by_rank(x, tp.size).tensor_split(chunks, dim=2)]
        reduced = [_reduce_async(piece @ weight.t(), tp) for piece in pieces]
        ctx.save_for_backward(weight, *pieces)
        ctx.tp = tp
        return _own_parts(reduced, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, *pieces = ctx.saved_tensors
        tp = ctx.tp
        sizes = [piece.shape[SEQ] // tp.size for piece in pieces]
        pending = [_gather_async(g, tp) for g in grad.split(sizes, dim=SEQ)]
        grad_x, grad_w = [], torch.zeros_like(weight)
        for (parts, handle), piece in zip(pending, pieces):
            _wait(handle)
            rows = torch.cat(parts, dim=SEQ)
            grad_x.append(_by_rank(rows @ weight, tp.size))
            grad_w += rows.flatten(0, -2).t() @ piece.flatten(0, -2)
        return _rank_major(torch.cat(grad_x, dim=2)), grad_w, None, None


def gathered_column(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TP, chunks: int) -> torch.Tensor:
    """A column-parallel layer's GEMM on the gathered sequence, gather and GEMM in `chunks` pairs."""
    return _GatheredColumn.apply(x, weight, bias, tp, chunks)


def scattered_row(x: torch.Tensor, weight: torch.Tensor, tp: TP, chunks: int) -> torch.Tensor:
    """A row-parallel layer's GEMM, its partial sums reduce-scattered in `chunks` pairs."""
    return _ScatteredRow.apply(x, weight, tp, chunks)
