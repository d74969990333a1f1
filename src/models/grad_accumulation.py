"""How a micro-batch's weight gradients join the step's accumulated ones
(model.grad_accumulation).

A step over several micro-batches sums each weight's gradient over them in a buffer the
data-parallel reduction then reads. How the framework adds a micro-batch's gradient into it
costs bandwidth, once a micro-batch for every weight element, whatever the micro-batch's
rows:

hook: the weight-gradient GEMM writes a fresh 16-bit gradient and a pass of its own adds it
  into the buffer: read 2 bytes, read and write the buffer's element (2 each for fp16's
  buffer, 4 for bf16's fp32 one: memory.grad_bytes), 6 or 10 bytes an element. Megatron-LM's
  DistributedDataParallel of 2021 does it in a backward hook per parameter
  (`_make_param_hook`: `param.main_grad.add_(param.grad.data)`, megatron/model/distributed.py
  at NVIDIA/Megatron-LM de7dc40); its fused alternative (`--gradient-accumulation-fusion`,
  83b1e42, 2022-02) ran only with fp32 accumulation until 07916bf (2022-09), so fp16 runs of
  2021-22 (Narayanan et al., Korthikanti et al.) added this way. PyTorch's autograd
  accumulates a `.grad` the same way after the first micro-batch (AccumulateGrad), which
  DeepSpeed's and plain PyTorch training loops rely on; the first micro-batch's pass is
  priced too.
cast: the 16-bit gradient cast to fp32 and added into an fp32 copy of the step's gradients:
  read 2 bytes and write 4 (the cast), read 4 + 4 and write 4 (the add), 18 bytes an element.
  DeepSpeed's BF16_Optimizer, which every bf16 pipeline of DeepSpeed runs (0.6.2 on), does it
  after each micro-batch's backward (`update_hp_grads`: `hp_grad.add_(lp.grad.to(fp32))`,
  bf16_optimizer.py at 0.6.5 and 0.13.0); DeepSpeed-3D's bf16 runs take it. As the releases up
  to 0.12.0 run it (read at 0.6.5, 0.7.0, 0.8.0, 0.9.0, 0.9.5, 0.10.0, 0.12.0): they free the
  bf16 `.grad`s before each backward (`clear_lp_grads`: `param.grad = None`), so autograd
  writes fresh ones; 0.13.0 zeroes them instead (`zero_()`), so autograd adds into them too
  (2 bytes zeroed, 6 added a micro-batch: not priced).
fused: the weight-gradient GEMM accumulates into the fp32 buffer in its epilogue (apex's
  `fused_weight_gradient_mlp_cuda`, Transformer Engine's `fuse_wgrad_accumulation`):
  Megatron-LM since 2022 with fp32 accumulation, Megatron-Core. Nothing is added (the GEMM
  reads and writes the buffer; at these shapes its FLOPs bound it).

Under PyTorch AMP (cluster.amp) the weights are fp32 and autograd adds the cast-back gradient
into `.grad` whatever this says (src.costmodel.compute prices it with the casts). The default
is the cluster preset's (cluster.grad_accumulation): the software its testbed ran. The weights
of products only: a normalisation's are left out; a lookup table's dense gradient, which no GEMM
accumulates, is added in every mode (Kernel.table, priced by src.costmodel.compute).
"""

from __future__ import annotations

from dataclasses import replace

from src.cluster import GRAD_ACCUMULATIONS
from src.models.spec import ModelSpec

__all__ = ["GRAD_ACCUMULATIONS", "with_grad_accumulation"]


def with_grad_accumulation(spec: ModelSpec, mode: str) -> ModelSpec:
    """The model with its weight gradients accumulated as `mode` says (the builders make
    them fused). Repeated layers stay one object: consumers cache by identity."""
    if mode == "fused":
        return spec
    return spec.map_kernels(lambda kernel: replace(kernel, accumulation=mode) if kernel.has_weight else kernel)
