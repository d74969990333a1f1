"""Where a worker computes and in what precision.

A worker on an NCCL process group computes on its local GPU; on gloo, on the CPU. The
run's precision (the plan's) is what its GEMMs run in: fp32 as is, bf16 under autocast
with fp32 master weights and fp32 gradients (Megatron-LM keeps bf16 models' gradients and
their reduction in fp32); payloads travel between ranks in the run's precision, as the
simulator prices them. Timing synchronises the GPU at each measured boundary, so
measured seconds are the device's, not the host's enqueue time.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def worker_device(dist_backend: str) -> torch.device:
    if dist_backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def computing(device: torch.device, precision: str) -> Iterator[None]:
    """The run's precision for the GEMMs inside: autocast below fp32."""
    with torch.autocast(device.type, dtype=DTYPES[precision], enabled=precision != "fp32"):
        yield
