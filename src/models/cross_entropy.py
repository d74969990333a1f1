"""How the loss over the vocabulary's logits is computed (model.cross_entropy).

A language model's loss reads a logit per token and vocabulary entry: 4096 tokens of a
131,072-entry vocabulary are 537 M values a sequence, whose passes move as many bytes as a
small model's other memory-bound kernels together. What it costs is the bytes its kernels
move per logit, which depend on the software, not on the model:

eager: PyTorch's `F.cross_entropy` on the 16-bit logits, `log_softmax` then `nll_loss`
  (pytorch/pytorch at 000cace: aten/src/ATen/native/cuda/SoftMax.cu's host_softmax and
  host_softmax_backward). A block of threads takes a row. Where the row fits the block's
  shared memory (cluster.shared_memory_per_block, CUDA's 48 KiB; and its length divides
  into 16-byte vectors) or is short (up to 1024 values in 4 KiB: a warp's), forward reads
  it once and writes the log-probabilities (4 bytes a 16-bit logit); where it does not (a
  vocabulary of 131,072 16-bit logits is 256 KiB), the kernel reads it for its maximum,
  again for its sum of exponentials and a third time for its output (8). Backward writes
  `nll_loss`'s dense gradient (zero-filled, then the targets'), and `log_softmax`'s
  backward reads it for its row sum, reads it and the saved output again and writes the
  input's gradient, whatever the row: 5 passes (10 bytes; pytorch/pytorch#145866, January
  2025, a change that would cache it: "before this PR we were reading gradOutput twice").
  The forward's shared-memory path is the one #145866 names as #122970's (2024); releases
  before it read every row longer than a warp's three times, which only changes rows that
  would fit (CoCa's captioning rows on `p3_16xlarge`, PyTorch 2.0.1, are too wide for it).
  Under PyTorch AMP autocast runs both in fp32, the row twice as wide in bytes: the cast up
  (read 2, write 4) and 8 or 16 forward, 20 and the cast back (read 4, write 2) backward.
  PyTorch's public kernel campaign (Liger-Kernel's benchmark data, fp32 rows of
  4096-131,072 logits: src.heldout) moves those bytes at 0.82-0.88 of the A100's and the
  H100 NVL's datasheet forward, about a copy's rate, and 0.49-0.56 backward, from 16,384
  logits a row up; the compute model prices both at the preset's memory_efficiency.
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

__all__ = ["CROSS_ENTROPY_MODES", "LOGIT_BYTES", "SAVED_BYTES", "eager_logit_bytes", "eager_loss", "with_cross_entropy"]

# Passes over a row of logits of PyTorch's log_softmax forward (a read and a write where the
# row stays on chip; three reads and a write where not) and of its loss's backward.
ON_CHIP_PASSES, OFF_CHIP_PASSES, BACKWARD_PASSES = 2, 4, 5
WARP_ROW = (1024, 4096)  # the longest row a warp takes whole: values, bytes
VECTOR_BYTES = 16  # the shared-memory kernel loads a row in float4 vectors
# Bytes each mode's forward and backward move per logit (16-bit logits; for eager a row on
# chip: eager_logit_bytes prices the others and fp32 under autocast).
LOGIT_BYTES: dict[str, tuple[float, float]] = {
    "eager": (2.0 * ON_CHIP_PASSES, 2.0 * BACKWARD_PASSES),
    "fp32": (38.0, 14.0),
    "fused": (2.0, 4.0),
}
# Bytes a logit each mode keeps for backward.
SAVED_BYTES: dict[str, float] = {"eager": 2.0, "fp32": 4.0, "fused": 2.0}


def eager_loss(logits: float, vocab: int) -> Kernel:
    """The loss over `logits` values a sample, in rows of `vocab`, as the builders make it:
    PyTorch's cross entropy, vocab-parallel (split with TP's column split of the head)."""
    forward, backward = LOGIT_BYTES["eager"]
    return Kernel(
        "loss", "memory", bytes=logits * forward, tp_split="n", backward_moves=backward / forward, cross_entropy="eager", vocab=vocab
    )


def eager_logit_bytes(row: float, shared_memory: float, amp: bool) -> tuple[float, float]:
    """Bytes a logit PyTorch's cross entropy moves forward and backward over rows of `row`
    logits, on a device whose thread block takes `shared_memory` bytes (0: a CPU, whose
    caches hold a row); `amp`: autocast runs it in fp32 on 16-bit logits."""
    value = 4.0 if amp else 2.0
    warp = row <= WARP_ROW[0] and row * value <= WARP_ROW[1]
    block = row * value < shared_memory and (row * value) % VECTOR_BYTES == 0
    forward = (ON_CHIP_PASSES if not shared_memory or warp or block else OFF_CHIP_PASSES) * value
    backward = BACKWARD_PASSES * value
    cast = 6.0 if amp else 0.0  # autocast's copy up (read 2, write 4) and the gradient's back
    return forward + cast, backward + cast


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
