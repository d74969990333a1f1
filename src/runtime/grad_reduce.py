"""Gradient reductions in flattened buckets.

Where a plan reduces a layer's parameter gradients itself (a DP all-reduce naming them in
`Collective.grads_of`, issued right after the step's last backward of that layer), the
executor starts an asynchronous all-reduce of those gradients, flattened into one bucket,
and finishes it at the plan's Wait, before the optimizer step (Megatron-LM's
--overlap-grad-reduce); the unit's DeepSpeed engine then does not reduce them again
(engines.make_engine). The bucket is averaged over the replicas, as DeepSpeed's own
reduction averages.

A tensor grid sums its gradients over z and over data parallelism at the end of the
backward (`all_reduce_grads`): in buckets of one dtype up to PyTorch DDP's default size, one
collective each, where one per tensor paid a collective's latency a parameter.
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
        if self.replicas > 1:
            self.flat.div_(self.replicas)
        offset = 0
        for grad in self.grads:
            grad.copy_(self.flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


# PyTorch DistributedDataParallel's default bucket (bucket_cap_mb=25): a bucket's flat copy is
# the memory a reduction adds.
BUCKET_BYTES = 25 * 2**20


def start_bucket(grads: list[torch.Tensor], group: dist.ProcessGroup | None, replicas: int) -> GradBucket:
    """Start the all-reduce of `grads`, flattened into one buffer, over their replicas."""
    flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
    work = dist.all_reduce(flat, group=group, async_op=True) if grads else None
    return GradBucket(work, flat, grads, replicas)


def start_reduction(layers: list[nn.Module], group: dist.ProcessGroup, replicas: int) -> GradBucket:
    """Start the all-reduce of the layers' parameter gradients over their replicas."""
    grads = [p.grad for layer in layers for p in layer.parameters() if p.requires_grad and p.grad is not None]
    return start_bucket(grads, group, replicas)


def all_reduce_grads(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum `grads` over `group` in place: buckets of one dtype up to BUCKET_BYTES (a larger
    tensor alone), one after another, so that one bucket's flat copy is all it adds."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in same:
            nbytes = grad.numel() * grad.element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                start_bucket(bucket, group, 1).finish()
                bucket, size = [], 0
            bucket.append(grad)
            size += nbytes
        start_bucket(bucket, group, 1).finish()
