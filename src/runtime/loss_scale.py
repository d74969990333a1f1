"""Dynamic loss scaling for fp16 (as Megatron-LM, DeepSpeed and torch.amp do it).

fp16 gradients underflow where fp32 ones would not: the loss is multiplied by the scale
before the backward, so every gradient (parameters' and the payloads that cross ranks in
fp16) carries it; the parameters' gradients (fp32, as their fp32 master weights) are
divided by it before the optimizer steps. A step whose gradients hold an inf or a NaN on
any rank is skipped on every rank and the scale halves (down to `minimum`); after `window`
steps without one it doubles (backend.deepspeed.fp16, DeepSpeed's rule and names). The
single-process reference scales with the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from src.config import LossScaleSpec


@dataclass
class LossScale:
    scale: float
    window: int = 1000  # steps without an overflow before the scale doubles (DeepSpeed's loss_scale_window)
    minimum: float = 1.0  # DeepSpeed's min_loss_scale
    good_steps: int = 0
    skipped: bool = False  # whether the last step overflowed (and was skipped)

    @classmethod
    def of(cls, spec: LossScaleSpec) -> LossScale:
        return cls(2.0**spec.initial_scale_power, spec.loss_scale_window, spec.min_loss_scale)

    def update(self, overflow: bool) -> None:
        self.skipped = overflow
        if overflow:
            self.scale, self.good_steps = max(self.scale / 2, self.minimum), 0
            return
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2


def unscale_and_check(params: list[nn.Parameter], scale: float, device: torch.device) -> torch.Tensor:
    """Divide every gradient by the loss scale and return, on `device`, 1.0 where any of them
    held an inf or a NaN, else 0.0 (a step that overflowed drops its gradients: that they were
    divided too does not matter). One fused pass over each dtype's gradients, as torch's
    GradScaler checks and unscales: no wait on the device per tensor. Multiplying by the
    inverse of a power-of-two scale (what LossScale keeps, unless its minimum is not one) gives
    the quotient exactly."""
    found = torch.zeros(1, device=device)
    inverse = torch.full((1,), 1.0 / scale, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
    return found
