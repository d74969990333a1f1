"""Which of a block's elementwise operations the software runs unfused (model.unfused).

The builders make them fused (src/models/layers.py), as Megatron-Core with Transformer
Engine runs them: RMSNorm one kernel each way (Transformer Engine's or apex's), the rotary
embedding one kernel for the queries and one for the keys (Megatron-Core's RoPE fusion, on
by default since 2024: `--no-rope-fusion` turns it off), SwiGLU one kernel (its bias-SwiGLU
fusion, `--no-bias-swiglu-fusion`). Software that writes an operation in PyTorch runs each
of its steps as a kernel of its own, every step reading and writing the whole tensor, and
keeps more for backward:

rmsnorm: Hugging Face Transformers' LlamaRMSNorm: the input cast to fp32, squared, its
  mean, plus epsilon and the reciprocal square root (one value a row), the fp32 input
  scaled by it, cast back, times the weight: 8 kernels moving 36 bytes a value forward.
  Backward, as autograd runs it (the ops a profiler lists, torch 2.13): the output's
  gradient times the weight (4), cast to fp32 (6); the scaling's two gradients, times the
  scale (8) and times the input then summed over the row (12, 4); the mean's gradient
  divided out over the row (4), the square's (the input to the power 1: 8; times 2: 8;
  times that gradient: 12), the input's two gradients summed (12) and cast back (6): 84
  bytes a value in 14 kernels (three of them on one value a row); the weight's gradient the
  output's gradient times the cast-back output, summed over the rows (6, 2), two kernels
  more, whatever model.param_grad_kernels says. The fp32 input kept besides (4 bytes a
  value, replicated as the norm's input is).
rope: `t * cos + rotate_half(t) * sin` (Transformers' and Megatron-LM's legacy models'),
  for the queries and for the keys: the product with the cosines, the negated half, their
  concatenation, the product with the sines, the sum: 5 kernels moving 20 bytes a value
  forward. Backward: the product with the sines (4), the negated half (2), each half's
  gradient put back into a zero-filled whole (autograd's slice_backward: a fill and a copy,
  4 each), the two summed (6), the product with the cosines (4) and the two paths summed
  (6): 30 bytes in 9 kernels. Nothing kept (its factors are constants). Megatron-LM's legacy
  copy of the result into a concatenation with its empty unrotated part is left out.
swiglu: `F.silu(gate) * up`: 2 kernels moving 10 bytes a value of the output forward (the
  fused kernel: 6) and 3 moving 18 backward (12: the two products' gradients and SiLU's);
  the SiLU's output kept besides (2 bytes a value, split by TP as the MLP's are). A
  separate gate and up projection's input gradients summed (Transformers') and a chunked
  input's gradients concatenated (Megatron-LM's legacy MLP) are left out.

softmax: eager attention's scale-mask-softmax (the builders: one kernel each way, Megatron-LM's
  fused scaled_upper_triang_masked_softmax) as Megatron-LM v1.1.5 runs it without
  `--scaled-upper-triang-masked-softmax-fusion` (off by default) or in any 16-bit type but fp16
  (its fused path takes fp16 inputs only): the causal mask filled into the scores in place
  (`masked_fill_`), then `torch.nn.Softmax`: 8 bytes a score in 2 kernels forward (the fused
  kernel: 4); backward the softmax's gradient (8, as fused) and the mask filled into it (4):
  12 bytes in 2 kernels. Nothing more kept (the fill is in place, the mask one tensor for all).
  Only eager attention runs it: FlashAttention's softmax never reaches memory.

An unfused operation's bytes are counted in the dtypes its steps run, under PyTorch AMP too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from src.errors import ConfigError
from src.models.spec import Kernel, LayerSpec, ModelSpec

UNFUSABLE = ("rmsnorm", "rope", "swiglu", "softmax")
# Forward bytes a value of the operation's fused kernel moves, as the builders make it: RMSNorm,
# RoPE and the softmax read and write each 16-bit value; SwiGLU reads two for each it writes.
FUSED_BYTES = {"rmsnorm": 4.0, "rope": 4.0, "swiglu": 6.0, "softmax": 4.0}


@dataclass(frozen=True)
class Unfused:
    """An operation run step by step: bytes a value forward and its input's gradient
    backward, kernels each way, bytes a value its parameter's gradient moves in kernels of
    its own, bytes a value kept for backward beyond what the fused kernel keeps, and whether
    those lie replicated across TP ranks (a norm's input) or split (the MLP's)."""

    forward: float
    backward: float
    launches: int
    backward_launches: int
    weight_gradient: float = 0.0
    saved: float = 0.0
    replicated: bool = False


UNFUSED = {
    "rmsnorm": Unfused(36.0, 84.0, 8, 14, weight_gradient=8.0, saved=4.0, replicated=True),
    "rope": Unfused(20.0, 30.0, 5, 9),
    "swiglu": Unfused(10.0, 18.0, 2, 3, saved=2.0),
    "softmax": Unfused(8.0, 12.0, 2, 2),
}


def with_unfused(spec: ModelSpec, ops: list[str], software: bool = False) -> ModelSpec:
    """The model with the listed operations run unfused; an operation its blocks do not run
    is refused (a GPT block's LayerNorm and GELU are one PyTorch kernel each already), unless
    `software` (a codebase's own setting, for whichever of them the model runs: a softmax
    under FlashAttention runs in no kernel of its own). Repeated layers stay one object:
    consumers cache by identity."""
    unknown = sorted(set(ops) - set(UNFUSABLE))
    if unknown:
        raise ConfigError(f"model.unfused={ops} names {unknown}: the operations are {', '.join(UNFUSABLE)}")
    present = {kernel.elementwise for unit in spec.units for layer in unit.layers for kernel in layer.kernels if kernel.bytes}
    absent = sorted(set(ops) - present)
    if absent and not software:
        raise ConfigError(
            f"model.unfused names {', '.join(absent)}, which model {spec.name} does not run (only Llama blocks run "
            f"rmsnorm, rope and swiglu, and only eager attention a softmax of its own)"
        )
    chosen = frozenset(ops) & present
    if not chosen:
        return spec
    return spec.map_layers(lambda layer: _unfused_layer(layer, chosen))


def _unfused_layer(layer: LayerSpec, ops: frozenset[str]) -> LayerSpec:
    def unfusing(kernel: Kernel) -> bool:  # a softmax FlashAttention runs moves nothing of its own
        return kernel.elementwise in ops and bool(kernel.bytes)

    kernels = [kernel for kernel in layer.kernels if unfusing(kernel)]
    if not kernels:
        return layer
    kept = {True: 0.0, False: 0.0}  # bytes kept beyond the fused kernels', replicated or split
    for kernel in kernels:
        way = UNFUSED[kernel.elementwise]
        kept[way.replicated] += _values(kernel) * way.saved
    a = layer.activations
    return replace(
        layer,
        kernels=tuple(unfused_kernel(kernel) if unfusing(kernel) else kernel for kernel in layer.kernels),
        activations=replace(a, replicated=a.replicated + kept[True], split=a.split + kept[False]),
    )


def _values(kernel: Kernel) -> float:
    """The values a sample's operation works on (normalised, rotated, or the MLP's output)."""
    return kernel.bytes / FUSED_BYTES[kernel.elementwise]


def unfused_kernel(kernel: Kernel) -> Kernel:
    """The operation's kernel as its software runs it step by step (UNFUSED)."""
    way = UNFUSED[kernel.elementwise]
    values = _values(kernel)
    return replace(
        kernel,
        bytes=values * way.forward,
        backward_moves=way.backward / way.forward,
        launches=way.launches,
        backward_launches=way.backward_launches,
        grad_reduction_bytes=values * way.weight_gradient if way.weight_gradient else kernel.grad_reduction_bytes,
    )
