"""The gradient norm a ZeRO-0 engine's pre-step hook takes (src.runtime.optimizer.grad_norm)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn


def _params(count: int) -> list[nn.Parameter]:
    torch.manual_seed(0)
    params = []
    for index in range(count):
        param = nn.Parameter(torch.randn(3 + index % 5))
        param.grad = None if index % 7 == 3 else torch.randn_like(param)  # a frozen one now and then
        params.append(param)
    return params


def test_the_norm_is_the_global_norm_of_the_gradients_there_are() -> None:
    from src.runtime.optimizer import grad_norm

    params = _params(40)
    expected = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    assert grad_norm(params, None, 1) == pytest.approx(float(expected), rel=1e-6)  # summed in fp64, torch in fp32
    assert grad_norm([p for p in params if p.grad is None], None, 1) == 0.0


def test_a_tensor_parallel_slice_counts_whole_and_a_replicated_parameter_once_over_its_ranks(monkeypatch) -> None:
    from src.runtime.optimizer import grad_norm

    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: reduced.append(float(tensor)))
    params = _params(12)
    for param in params[::2]:
        param.tensor_model_parallel = True  # type: ignore[attr-defined]
    squares = [float(p.grad.norm()) ** 2 / (1 if i % 2 == 0 else 4) for i, p in enumerate(params) if p.grad is not None]
    assert grad_norm(params, "tp group", 4) == pytest.approx(sum(squares) ** 0.5, rel=1e-12)
    assert reduced == pytest.approx([sum(squares)], rel=1e-12)  # this rank's share, summed over the group
