"""How a layer's bias and normalisation gradients are reduced (model.param_grad_kernels).

A bias's gradient is its output's gradient summed over the tokens; a LayerNorm's (or
GroupNorm's, RMSNorm's) scale and shift gradients are sums over the tokens of the output's
gradient times the normalised input. Both read a whole activation for a handful of
parameters, so they cost bandwidth, not FLOPs.

separate: each is a kernel of its own in backward (Kernel.grad_reduction_bytes). Eager
PyTorch runs them so: a Linear's bias gradient is a reduction kernel after its weight
gradient's GEMM (`at::native::reduce_kernel`), and LayerNorm's backward is two kernels, the
input's gradient and `GammaBetaBackward`, which reads the output's gradient and the input
again. So did Megatron-LM's own layers (a bias gradient summed by autograd or by
`grad_output.sum`, apex's fused LayerNorm with its partial-gradient pass): on one H200 the
1.7B GPT of benchmarks/results/small_gpt_h200.md spends 9.2 ms of a 326.6 ms step in the
biases' reductions and 4.6 ms in LayerNorm's parameter pass.

fused: the framework folds them into kernels it runs anyway: Transformer Engine computes a
Linear's bias gradient in its weight-gradient GEMM's epilogue (cuBLASLt's bias-gradient
epilogue) and a LayerNorm's parameter gradients inside its backward kernel; FlashAttention's
training code does the same (its fused dense and dropout-add-LayerNorm kernels). Nothing is
added.

The default is the cluster preset's (cluster.param_grad_kernels): the software its testbed
ran, as for model.attention. The per-kernel host times are not changed by either mode: they
were measured on eager blocks that run these reductions and are expressed per kernel the
cost model counts without them (src.costmodel.compute.kernel_launches).
"""

from __future__ import annotations

from dataclasses import replace

from src.cluster import PARAM_GRAD_KERNELS
from src.models.spec import ModelSpec

__all__ = ["PARAM_GRAD_KERNELS", "with_param_grad_kernels"]


def with_param_grad_kernels(spec: ModelSpec, mode: str) -> ModelSpec:
    """The model with its parameter-gradient reductions run as `mode` (the builders make
    them separate). Repeated layers stay one object: consumers cache by identity."""
    if mode == "separate":
        return spec
    return spec.map_kernels(lambda kernel: replace(kernel, grad_reduction_bytes=0.0) if kernel.grad_reduction_bytes else kernel)
