"""A tensor grid's end-of-backward sums go in flattened buckets (src.runtime.grad_reduce):
one collective a bucket, not one a parameter, and the same sums."""

from __future__ import annotations

import torch
from torch import nn

from src.runtime import grad_reduce
from src.runtime.modules.grid3d import Axis, Grid3D


class _Done:
    def wait(self) -> None:
        pass


def _doubling(calls: list[tuple[torch.dtype, int]]):
    """An all-reduce over two ranks that hold the same tensor: the sum doubles it."""

    def all_reduce(tensor: torch.Tensor, group=None, async_op: bool = False):
        calls.append((tensor.dtype, tensor.numel()))
        tensor.mul_(2)
        return _Done() if async_op else None

    return all_reduce


def test_a_grid_sums_its_gradients_over_data_parallelism_in_one_collective(monkeypatch) -> None:
    calls: list[tuple[torch.dtype, int]] = []
    monkeypatch.setattr(grad_reduce.dist, "all_reduce", _doubling(calls))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(15)])  # 30 tensors
    model(torch.randn(4, 8)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    Grid3D(dp=Axis(2, 0, None)).finish_backward([model])
    assert calls == [(torch.float32, sum(p.numel() for p in model.parameters()))]
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), before))


def test_buckets_hold_one_dtype_up_to_their_size_and_a_larger_tensor_alone(monkeypatch) -> None:
    calls: list[tuple[torch.dtype, int]] = []
    monkeypatch.setattr(grad_reduce.dist, "all_reduce", _doubling(calls))
    monkeypatch.setattr(grad_reduce, "BUCKET_BYTES", 1000)
    small = [torch.full((100,), float(i)) for i in range(5)]  # 400 bytes each: two a bucket
    half = [torch.ones(10, dtype=torch.bfloat16) for _ in range(2)]
    large = torch.ones(300)  # 1200 bytes: alone
    grad_reduce.all_reduce_grads([small[0], half[0], small[1], large, small[2], small[3], half[1], small[4]], None)
    assert sorted(calls, key=str) == sorted(
        [(torch.float32, 200), (torch.float32, 300), (torch.float32, 200), (torch.float32, 100), (torch.bfloat16, 20)], key=str
    )
    assert all(torch.equal(t, torch.full((100,), 2.0 * i)) for i, t in enumerate(small))
    assert torch.equal(large, torch.full((300,), 2.0))
    assert all(torch.equal(h, torch.full((10,), 2.0, dtype=torch.bfloat16)) for h in half)
