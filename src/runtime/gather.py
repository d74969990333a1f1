"""The batch-sync all-gather of features, carrying gradients back.

Forward: every rank's rows, concatenated in group order. Backward: rank r's rows of the
summed gradient over all ranks (every rank's loss depends on every rank's features).
gloo has no reduce-scatter, so the backward all-reduces and keeps its own rows: the same
result, with more traffic than a reduce-scatter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from src.runtime.comm import CLOCK, all_reduce


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.rows, ctx.index = group, local.shape[0], dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(size)]
        with CLOCK.timed("interaction"):
            dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = all_reduce(grad.contiguous(), ctx.group, "interaction")
        return total[ctx.index * ctx.rows:(ctx.index + 1) * ctx.rows], None, None


def gather_with_grad(local: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    return _GatherWithGrad.apply(local, group, size)
