"""Gradient reduction overlapped with the backward (Megatron-LM's --overlap-grad-reduce).

Where a plan reduces a layer's parameter gradients itself (a DP all-reduce naming them in
`Collective.grads_of`, issued right after the step's last backward of that layer), the
executor starts an asynchronous all-reduce of those gradients, flattened into one bucket,
and finishes it at the plan's Wait, before the optimizer step; the unit's DeepSpeed
engine then does not reduce them again (engines.make_engine). The bucket is averaged over
the replicas, as DeepSpeed's own reduction averages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class GradBucket:
    """An all-reduce in flight and the gradients it will write back."""

    work: dist.Work | None
    flat: torch.Tensor
    grads: list[torch.Tensor]
    replicas: int

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.flat.div_(self.replicas)
        offset = 0
        for grad in self.grads:
            grad.copy_(self.flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def start_reduction(layers: list[nn.Module], group: dist.ProcessGroup, replicas: int) -> GradBucket:
    """Start the all-reduce of the layers' parameter gradients over their replicas."""
    grads = [p.grad for layer in layers for p in layer.parameters() if p.requires_grad and p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
    work = dist.all_reduce(flat, group=group, async_op=True) if grads else None
    return GradBucket(work, flat, grads, replicas)
