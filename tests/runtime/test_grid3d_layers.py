"""Par4D's 3D-parallel linear layer equals nn.Linear, and its convolution nn.Conv2d: on 8
processes as (G_x, G_y, G_z, G_data) = (2,2,2,1) and (2,2,1,2), two chained layers (the
second transposed, reading the first's output layout) give each rank its slice of the
whole outputs, input gradients and weight and bias gradients, with every overlap on and
off; under activation checkpointing caching the gathered weights (D) halves the z
all-gathers. A U-Net's GroupNorm whose groups straddle ranks equals nn.GroupNorm. A GPT
under AxoNN's Lightning gather order gathers as often as its plan says."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from src.runtime.driver import free_port
from src.runtime.modules.parallel import linear_shard
from src.program import GRID_OVERLAPS
from src.runtime.modules.gpt3d import Block3D, Embedding3D, Head3D
from src.runtime.modules.grid3d import Axis, Conv3D, Grid3D, Linear3D, axis_part, link_prefetches
from src.runtime.modules.unet3d import GroupNorm3D
from tests.runtime.support import run_forked

ROWS, D_IN, D_MID, D_OUT = 8, 8, 12, 8
C_IN, C_MID, C_OUT, SIDE = 4, 8, 4, 4  # channels of two convs (3x3, then 3x3 with stride 2) on 4x4 maps
GRIDS = ((2, 2, 2, 1), (2, 2, 1, 2))


def _rows(grid: Grid3D) -> slice:
    """Rows split by data parallelism (outermost), then by z."""
    step = ROWS // (grid.dp.size * grid.z.size)
    start = (grid.dp.rank * grid.z.size + grid.z.rank) * step
    return slice(start, start + step)


def _shard_of(weight_grad: torch.Tensor, rows: Axis, cols: Axis, z: Axis) -> torch.Tensor:
    """A rank's unique piece of an nn.Linear weight (d_out x d_in) in Linear3D's (k x n) layout."""
    block = weight_grad.t()[axis_part(weight_grad.shape[1], rows), axis_part(weight_grad.shape[0], cols)]
    return block[axis_part(block.shape[0], z)]


def _check(grid: Grid3D, recompute: bool) -> None:
    # The whole layers drawn as Linear3D draws its shards (same seed, same order).
    reference = nn.Sequential(nn.Linear(D_IN, D_MID), nn.Linear(D_MID, D_OUT))
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in reference:
            weight, bias = linear_shard(
                layer.in_features, layer.out_features, torch.arange(layer.out_features), torch.arange(layer.in_features)
            )
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
    torch.manual_seed(0)
    first, second = Linear3D(D_IN, D_MID, grid), Linear3D(D_MID, D_OUT, grid, transposed=True)
    first.prefetches(second)
    generator = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(ROWS, D_IN, generator=generator), torch.randn(ROWS, D_OUT, generator=generator)

    whole_x = x.clone().requires_grad_()
    reference(whole_x).backward(grad_out)

    rows = _rows(grid)
    local_x = x[rows, axis_part(D_IN, grid.y)].clone().requires_grad_()

    def run(inp: torch.Tensor) -> torch.Tensor:
        return second(first(inp))

    out = checkpoint(run, local_x, use_reentrant=False) if recompute else run(local_x)
    # The first layer writes columns over x; the transposed second reads them and writes over y.
    out.backward(grad_out[rows, axis_part(D_OUT, grid.y)])
    grid.finish_backward([first, second])

    expected_out = reference(x)[rows, axis_part(D_OUT, grid.y)]
    torch.testing.assert_close(out.detach(), expected_out)
    torch.testing.assert_close(local_x.grad, whole_x.grad[rows, axis_part(D_IN, grid.y)])
    torch.testing.assert_close(first.shard.grad, _shard_of(reference[0].weight.grad, grid.y, grid.x, grid.z))
    torch.testing.assert_close(second.shard.grad, _shard_of(reference[1].weight.grad, grid.x, grid.y, grid.z))
    torch.testing.assert_close(first.bias.grad, reference[0].bias.grad[axis_part(D_MID, grid.x)])
    torch.testing.assert_close(second.bias.grad, reference[1].bias.grad[axis_part(D_OUT, grid.y)])
    assert not grid.pending


def _check_conv(grid: Grid3D) -> None:
    """Channels as k and n, samples over data parallelism and z; the second conv halves the map."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(C_IN, C_MID, 3, padding=1), nn.Conv2d(C_MID, C_OUT, 3, stride=2, padding=1))
    first, second = Conv3D(reference[0], grid), Conv3D(reference[1], grid, transposed=True)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(ROWS, C_IN, SIDE, SIDE, generator=generator)
    grad_out = torch.randn(ROWS, C_OUT, SIDE // 2, SIDE // 2, generator=generator)
    whole_x = x.clone().requires_grad_()
    reference(whole_x).backward(grad_out)

    rows = _rows(grid)
    local_x = x[rows, axis_part(C_IN, grid.y)].clone().requires_grad_()
    out = second(first(local_x))
    out.backward(grad_out[rows, axis_part(C_OUT, grid.y)])
    grid.finish_backward([first, second])

    torch.testing.assert_close(out.detach(), reference(x)[rows, axis_part(C_OUT, grid.y)])
    torch.testing.assert_close(local_x.grad, whole_x.grad[rows, axis_part(C_IN, grid.y)])
    for layer, whole, (k_axis, n_axis) in ((first, reference[0], (grid.y, grid.x)), (second, reference[1], (grid.x, grid.y))):
        weight_grad = whole.weight.grad.reshape(whole.out_channels, -1)
        torch.testing.assert_close(layer.gemm.shard.grad, _shard_of(weight_grad, k_axis, n_axis, grid.z))
        torch.testing.assert_close(layer.gemm.bias.grad, whole.bias.grad[axis_part(whole.out_channels, n_axis)])


def _check_split_group_norm(grid: Grid3D) -> None:
    """A decoder block's norm: its input is a feature map's and a skip's channels, each
    split over y, so some of GroupNorm(4, 12)'s groups of 3 straddle two ranks."""
    torch.manual_seed(0)
    whole = nn.GroupNorm(4, 12)
    with torch.no_grad():
        whole.weight.normal_()
        whole.bias.normal_()
    features, skip = torch.arange(8), 8 + torch.arange(4)
    channels = torch.cat([features[axis_part(8, grid.y)], skip[axis_part(4, grid.y)]])
    norm = GroupNorm3D(whole, channels, grid.y)
    assert not norm.whole_groups
    generator = torch.Generator().manual_seed(3)
    x, grad_out = torch.randn(2, 12, 3, 3, generator=generator), torch.randn(2, 12, 3, 3, generator=generator)
    whole_x = x.clone().requires_grad_()
    whole(whole_x).backward(grad_out)
    local_x = x[:, channels].clone().requires_grad_()
    out = norm(local_x)
    out.backward(grad_out[:, channels])
    torch.testing.assert_close(out.detach(), whole(x)[:, channels])
    torch.testing.assert_close(local_x.grad, whole_x.grad[:, channels])
    torch.testing.assert_close(norm.weight.grad, whole.weight.grad[channels])
    torch.testing.assert_close(norm.bias.grad, whole.bias.grad[channels])


def _lightning_gathers(degrees: tuple[int, int, int, int]) -> tuple[int, int]:
    """A two-block GPT's step (blocks checkpointed, as full recomputation runs them) under
    gather_order=lightning: the z all-gathers it issued, and of them those gathered where
    needed into a list."""
    grid = Grid3D.build(degrees, frozenset(GRID_OVERLAPS) - {"cache"}, gather_order="lightning")
    torch.manual_seed(0)
    layers = nn.ModuleList([Embedding3D(128, 64, 16, grid), Block3D(64, 4, grid), Block3D(64, 4, grid), Head3D(64, 128, grid)])
    link_prefetches(layers, grid)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    state = layers[0]({"ids": ids, "targets": ids})
    for block in layers[1:3]:
        state = checkpoint(block, state, use_reentrant=False)
    layers[3](state)["loss"].backward()
    grid.finish_pending()
    return grid.gathers, grid.listed


def _worker(rank: int, port: int, lightning_gathers: tuple[int, int]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=8)
    try:
        grids = [Grid3D.build(degrees) for degrees in GRIDS]
        for grid in grids:
            for overlap in (frozenset(), frozenset(GRID_OVERLAPS)):
                checked = grid.with_overlap(overlap)
                _check(checked, recompute=False)
                # Without C each weight is gathered where it is needed, into a list of the shards.
                assert checked.listed == (0 if "all_gather" in overlap else checked.gathers), (overlap, checked.listed)
                _check_conv(grid.with_overlap(overlap))
        # Checkpointed: each layer's forward runs twice; D serves the second from its cache.
        gathers = {}
        for overlap in (frozenset(GRID_OVERLAPS) - {"cache"}, frozenset(GRID_OVERLAPS)):
            grid = grids[0].with_overlap(overlap)
            _check(grid, recompute=True)
            gathers["cache" in overlap] = grid.gathers
        assert gathers == {False: 4, True: 2}, gathers
        _check_split_group_norm(grids[0])
        assert _lightning_gathers(GRIDS[0]) == lightning_gathers
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_linear3d_and_conv3d_equal_nn_linear_and_conv2d_on_two_grids_with_overlaps_on_and_off() -> None:
    run_forked(_worker, (free_port(), _planned_lightning_gathers()), 8)


def _planned_lightning_gathers() -> tuple[int, int]:
    """The z all-gathers of the same GPT's plan on G = (2,2,2,1), one micro-batch, and of
    them those gathered where needed into a list (Collective.listed)."""
    from src.program import Collective
    from src.setup import plan_run, validate
    from tests.test_configs import compose_config

    overrides = [
        *("model=gpt", "model.preset=null", "model.layers=2", "model.hidden=64", "model.heads=4", "model.vocab=128"),
        *("train.seq_len=16", "train.global_batch=4", "cluster=perlmutter", "cluster.nodes=2", "strategy=par4d"),
        *("strategy.grid=[2,2,2,1]", "strategy.recompute=full", "strategy.gathers=lightning"),
        "strategy.overlap=[all_reduce,reduce_scatter,all_gather]",
    ]
    plan = plan_run(validate(compose_config(*overrides)))
    assert plan.units[0].num_microbatches == 1
    instructions = plan.program.classes[0].instructions
    gathers = [i for i in instructions if isinstance(i, Collective) and i.op == "all_gather" and i.group == "z"]
    return len(gathers), sum(g.listed for g in gathers)
