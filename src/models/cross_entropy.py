"""How the loss over the vocabulary's logits is computed (model.cross_entropy).

A language model's loss reads a logit per token and vocabulary entry: 4096 tokens of a
131,072-entry vocabulary are 537 M values a sequence, whose passes move as many bytes as a
small model's other memory-bound kernels together. What it costs is the bytes its kernels
move per logit, which depend on the software, not on the model:

eager: PyTorch's `F.cross_entropy` on the 16-bit logits, `log_softmax` then `nll_loss`:
  forward reads and writes each logit once (4 bytes); backward writes the dense gradient of
  `nll_loss`, which `log_softmax`'s backward reads with the saved output to write the
  input's gradient (8). Under PyTorch AMP autocast runs it in fp32 (src.costmodel.compute
  prices that from `cluster.amp`): 14 bytes forward (the cast: read 2, write 4;
  `log_softmax`: 8) and 22 backward (`nll_loss`'s fp32 gradient: 4; `log_softmax`'s: 12;
  the cast back: 6). On one H200 (benchmarks/results/small_gpt_h200.md, the 1.7B case: 2.15 G
  logits of a 131,072-entry vocabulary a step) the softmax and loss kernels took 8.2 ms,
  about 16 bytes a logit at 90 % of its 4.8 TB/s, where the two `log_softmax` kernels are
  priced at 20.
fp32: Megatron-LM's vocab-parallel cross entropy on an fp32 copy of the logits, as it runs
  unless `--fp16-lm-cross-entropy` is given (megatron/model/gpt_model.py's
  `post_language_model_processing` of 2021, `output.float()`; Megatron-Core's
  `VocabParallelCrossEntropy.calculate_logits_max` since 2024): forward casts (read 2, write 4
  bytes), takes the row maximum (read 4), subtracts it in place (8), exponentiates in place
  (8), sums (4) and normalises in place into the softmax it saves (8): 38 bytes a logit;
  backward scales the saved softmax by the loss's gradient in place (8) and autograd casts
  the fp32 gradient back to the logits' dtype (read 4, write 2): 14.
fused: one kernel each way on the 16-bit logits, the gradient written over them (apex's
  `xentropy` and FlashAttention's `CrossEntropyLoss(inplace_backward=True)`): forward reads
  them (2), backward reads them and writes the gradient (4).

What each keeps for backward is an activation of the head: `log_softmax`'s 16-bit output
(2 bytes a logit), Megatron-LM's fp32 softmax (4), the fused kernel's logits (2). As
elsewhere, the memory model is the 16-bit regime's: under autocast `log_softmax` keeps fp32.

The default is the cluster preset's (cluster.cross_entropy): the software its testbed ran.
Each mode is priced as one kernel each way (its host launches as one).
"""

from __future__ import annotations

from dataclasses import replace

from src.cluster import CROSS_ENTROPY_MODES
from src.models.spec import Kernel, LayerSpec, ModelSpec

__all__ = ["CROSS_ENTROPY_MODES", "LOGIT_BYTES", "SAVED_BYTES", "eager_loss", "with_cross_entropy"]

# Bytes each mode's forward and backward move per logit (16-bit logits; fp32 under autocast
# is the compute model's, from cluster.amp).
LOGIT_BYTES: dict[str, tuple[float, float]] = {"eager": (4.0, 8.0), "fp32": (38.0, 14.0), "fused": (2.0, 4.0)}
# Bytes a logit each mode keeps for backward.
SAVED_BYTES: dict[str, float] = {"eager": 2.0, "fp32": 4.0, "fused": 2.0}


def eager_loss(logits: float) -> Kernel:
    """The loss over `logits` values a sample as the builders make it: PyTorch's cross
    entropy, vocab-parallel (split with TP's column split of the head)."""
    forward, backward = LOGIT_BYTES["eager"]
    return Kernel("loss", "memory", bytes=logits * forward, tp_split="n", backward_moves=backward / forward, cross_entropy="eager")


def with_cross_entropy(spec: ModelSpec, mode: str) -> ModelSpec:
    """The model with its losses computed as `mode` (the builders compute them eagerly).
    Repeated layers stay one object: consumers cache by identity."""
    return spec if mode == "eager" else spec.map_layers(lambda layer: _computed_as(layer, mode))


def _computed_as(layer: LayerSpec, mode: str) -> LayerSpec:
    losses = [kernel for kernel in layer.kernels if kernel.cross_entropy]
    if not losses:
        return layer
    saved = sum(_logits(kernel) * (SAVED_BYTES[mode] - SAVED_BYTES[kernel.cross_entropy]) for kernel in losses)
    return replace(
        layer,
        kernels=tuple(_kernel(kernel, mode) for kernel in layer.kernels),
        activations=replace(layer.activations, split=layer.activations.split + saved),
    )


def _logits(kernel: Kernel) -> float:
    return kernel.bytes / LOGIT_BYTES[kernel.cross_entropy][0]


def _kernel(kernel: Kernel, mode: str) -> Kernel:
    if not kernel.cross_entropy:
        return kernel
    forward, backward = LOGIT_BYTES[mode]
    return replace(kernel, bytes=_logits(kernel) * forward, backward_moves=backward / forward, cross_entropy=mode)
