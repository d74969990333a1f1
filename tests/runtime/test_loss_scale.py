"""fp16's check for overflowed gradients and their unscaling, in one pass."""

from __future__ import annotations

import torch
from torch import nn

from src.runtime.loss_scale import LossScale, unscale_and_check

CPU = torch.device("cpu")


def _params(*grads: torch.Tensor) -> list[nn.Parameter]:
    params = []
    for grad in grads:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    return params


def test_finite_gradients_are_divided_by_the_scale_exactly() -> None:
    torch.manual_seed(0)
    grads = (torch.randn(37, 5) * 1e3, torch.randn(11, dtype=torch.float16) * 100, torch.randn(3))
    params = _params(*grads)
    params.append(nn.Parameter(torch.zeros(2)))  # no gradient: left alone
    flag = unscale_and_check(params, 2.0**16, CPU)
    assert flag.item() == 0.0
    for param, grad in zip(params, grads):
        assert param.grad is not None and param.grad.dtype == grad.dtype
        assert torch.equal(param.grad, grad / 2.0**16)  # a power-of-two scale: bit for bit the quotient
    assert params[-1].grad is None


def test_an_inf_or_a_nan_in_any_gradient_of_any_dtype_is_found() -> None:
    for bad in (float("inf"), float("-inf"), float("nan")):
        fine, broken = torch.ones(4), torch.ones(6, dtype=torch.float16)
        broken[3] = bad
        assert unscale_and_check(_params(fine, broken), 8.0, CPU).item() == 1.0


def test_no_gradients_at_all_is_no_overflow() -> None:
    assert unscale_and_check([nn.Parameter(torch.zeros(3))], 4.0, CPU).item() == 0.0


def test_the_scale_halves_on_an_overflow_and_doubles_after_its_window() -> None:
    scale = LossScale(2.0**4, window=2, minimum=4.0)
    scale.update(True)
    assert (scale.scale, scale.skipped) == (8.0, True)
    scale.update(True)
    scale.update(True)
    assert scale.scale == 4.0  # not below the minimum
    scale.update(False)
    scale.update(False)
    assert (scale.scale, scale.skipped) == (8.0, False)
