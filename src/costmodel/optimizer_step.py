"""The bytes an Adam step moves per parameter, pass by pass, as mixed-precision frameworks
run it (the step is bandwidth-bound; src.costmodel.compute prices the bytes at the
preset's HBM rate).

Megatron-LM's mixed-precision optimizer (megatron/optimizer/optimizer.py,
Float16OptimizerWithFloat16Params.step, NVIDIA/Megatron-LM de7dc40, 2021; Megatron-Core's
DistributedOptimizer at 937571c, 2024), DeepSpeed's fp16 optimizers and PyTorch AMP's
GradScaler and clip_grad_norm_ around an Adam kernel all run it as separate passes.

Over the gradient buffer a rank holds (all of its parameters' gradients; under ZeRO-2/3 its
partition), `g` bytes an element (memory.grad_bytes: fp16 models' gradients in fp16,
bf16 models' in fp32, as Megatron-LM accumulates them; fp32 under AMP):
  - the average over the data-parallel replicas before their reduction, in place: read and
    write g (Megatron-LM of 2021, `allreduce_gradients`'s `buffer_.data /= dp`, even at
    dp 1; Megatron-Core's `start_grad_sync`, `grad_data *= gradient_scaling_factor`;
    PyTorch DDP's bucket division);
  - the buffer zeroed for the next step's accumulation: write g (`zero_grad_buffer`).
Over the optimizer's shard (all of it without a distributed optimizer):
  - 16-bit gradients copied to fp32 main gradients: read 2, write 4 (`main_grad.float()`;
    a view where they are fp32 already);
  - under fp16's loss scaling, unscaled and checked for overflow in place: read and write
    4 (`_amp_foreach_non_finite_check_and_unscale_`; bf16 and fp32 runs have no scaler);
  - the gradients' norm for clipping: read 4 (`multi_tensor_l2norm`; the scaling that
    follows runs only on a step whose norm exceeds the bound, and is left out);
  - Adam: read the fp32 gradient (4), read and write the fp32 weight and both moments (24);
  - 16-bit weights copied from the fp32 main weights: read 4, write 2
    (`_copy_main_params_to_model_params`; none where the weights are fp32: AMP, fp32 runs).
fp16 without AMP: 6 bytes over the gradients and 52 over the shard; bf16: 12 and 38, where
one kernel fusing the update and the 16-bit copy would move 30.
"""

from __future__ import annotations

from dataclasses import dataclass

from src.costmodel.memory import grad_bytes

ADAM_BYTES = 28.0  # read the fp32 gradient, read and write the fp32 weight and two moments
NORM_BYTES = 4.0  # the clipping norm reads each fp32 gradient


@dataclass(frozen=True)
class StepBytes:
    """Bytes per parameter of one optimizer step: `grads` over the gradient buffer a rank
    holds, `shard` over the optimizer state it steps."""

    grads: float
    shard: float


def step_bytes(precision: str, amp: bool) -> StepBytes:
    """The step's bytes at a training precision (fp16 | bf16 | fp32); `amp`: PyTorch AMP's
    fp32 weights under 16-bit GEMMs (cluster.amp)."""
    fp32_weights = amp or precision == "fp32"
    g = 4 if fp32_weights else grad_bytes(precision)
    to_main = 6.0 if g == 2 else 0.0
    unscale = 8.0 if precision == "fp16" else 0.0
    to_model = 0.0 if fp32_weights else 6.0
    return StepBytes(grads=3.0 * g, shard=to_main + unscale + NORM_BYTES + ADAM_BYTES + to_model)
