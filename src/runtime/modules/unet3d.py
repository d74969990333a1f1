"""An ADM U-Net on the tensor grid (x, y, z, data): runtime.modules.generator's layers with
every convolution a Conv3D and every FC a Linear3D (runtime.modules.grid3d), oriented as the
plan lays the unit out (UnitPlan.grid's layers). Each grid layer is sliced from its whole layer,
built first from the layer's seed, so every grid starts from the weights of one process.

Layout between layers: a feature map holds this rank's z part of the micro-batch's
samples, its channels split over the axis its next FC reads them over (x or y) and
replicated over the other. A residual block's two convs alternate orientation, so it
leaves its output where its input lay; a down- or upsampling conv moves it to the other
axis; a skip lies where the up path pops it (docs/strategies.md, "The tensor grid in a plan").

Besides the FCs' own collectives:
  stem, timestep    replicated on the tensor grid (rows over z, weights z-sharded): a
  embedding         reader takes its slice of their whole outputs (`split`), whose
                    gradient is all-gathered back, so every replica holds whole gradients
  GroupNorm         where its groups lie whole on a rank, none; else (a decoder block's
                    concatenated input) its groups' statistics all-reduced
  skip projection   where its output lies over the other axis than the block's
                    (FC.resplit): all-gathered over its columns axis, sliced over the block's
  output conv       replicated (the grid does not divide its channels): its input all-gathered
  loss              the noise channels split over the output conv's columns axis: the
                    squared errors' sums all-reduced over it
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from src.models.spec import LayerSpec, UnitSpec
from src.program import GridLayer
from src.runtime.comm import CLOCK
from src.runtime.modules.blocks import State
from src.runtime.modules.generator import (
    EMB,
    Conv,
    ResBlock,
    SpatialAttention,
    TimeEmbedding,
    Upsample,
    generator_layer,
    push_skip,
    sinusoids,
)
from src.runtime.modules.gpt3d import Attention3D, samples_of, sum_over
from src.runtime.modules.grid3d import Axis, Conv3D, Grid3D, Linear3D, axis_part, fc_axes


class _Split(torch.autograd.Function):
    """This rank's part along `dim` of a tensor every rank of `axis` holds whole; its
    gradient, a part per rank, is all-gathered whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
        ctx.axis, ctx.dim = axis, dim
        part = axis_part(x.shape[dim], axis)
        return x.narrow(dim, part.start, part.stop - part.start).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.axis, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    """The whole of a tensor split along `dim` over `axis`; every rank's gradient of the
    whole is the same, so each keeps its part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
        ctx.axis, ctx.dim = axis, dim
        return _all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        part = axis_part(grad.shape[ctx.dim], ctx.axis)
        return grad.narrow(ctx.dim, part.start, part.stop - part.start).contiguous(), None, None


def _all_gather(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(axis.size)]
    with CLOCK.timed("tp"):
        dist.all_gather(parts, x, group=axis.group)
    return torch.cat(parts, dim)


def split(x: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    return _Split.apply(x, axis, dim) if axis.size > 1 else x


def gather(x: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    return _Gather.apply(x, axis, dim) if axis.size > 1 else x


def _part(size: int, axis: Axis) -> torch.Tensor:
    return torch.arange(size)[axis_part(size, axis)]


class GroupNorm3D(nn.Module):
    """nn.GroupNorm on this rank's `channels` of the whole norm's, split over `axis`. Where
    they are whole groups it needs no communication; where a group straddles ranks (a
    decoder block's input, its feature map's and its skip's parts side by side, whose
    group boundaries need not fall where the parts do) each group's sum and sum of squares
    are all-reduced over `axis`, forward and backward, as LayerNorm3D's statistics are."""

    group_of: torch.Tensor  # each channel's group

    def __init__(self, whole: nn.GroupNorm, channels: torch.Tensor, axis: Axis) -> None:
        super().__init__()
        self.width, self.num_groups, self.eps, self.axis = whole.num_channels // whole.num_groups, whole.num_groups, whole.eps, axis
        runs = channels.reshape(-1, self.width) if len(channels) % self.width == 0 else None
        self.whole_groups = runs is not None and torch.equal(runs, runs[:, :1] // self.width * self.width + torch.arange(self.width))
        self.register_buffer("group_of", channels // self.width, persistent=False)
        self.weight = nn.Parameter(whole.weight.detach()[channels].clone())
        self.bias = nn.Parameter(whole.bias.detach()[channels].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole_groups:
            return F.group_norm(x, len(self.weight) // self.width, self.weight, self.bias, self.eps)
        values = x.float()  # as autocast runs group_norm
        per_channel = torch.stack([values.sum((2, 3)), (values * values).sum((2, 3))], dim=-1)
        per_group = per_channel.new_zeros(x.shape[0], self.num_groups, 2).index_add(1, self.group_of, per_channel)
        stats = sum_over(per_group, self.axis, replicated=False)[:, self.group_of] / (self.width * x.shape[2] * x.shape[3])
        mean, square = stats[..., 0, None, None], stats[..., 1, None, None]
        normalised = (values - mean) * torch.rsqrt(square - mean * mean + self.eps)
        return normalised * self.weight[:, None, None] + self.bias[:, None, None]


def _axes(grid: Grid3D, transposed: bool) -> tuple[Axis, Axis]:
    """(a, b): the axes an FC splits its output and its input columns over."""
    a, b = fc_axes(transposed)
    return grid.axis(a), grid.axis(b)


class _SlicesInput(nn.Module):
    """A layer reading its slice (over `axis`, along the last dim) of a whole input."""

    def __init__(self, layer: nn.Module, axis: Axis) -> None:
        super().__init__()
        self.layer, self.axis = layer, axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(split(x, self.axis, -1))


class _Resplit(nn.Module):
    """A layer whose output's channels, split over `writes`, are re-split over `lies`."""

    def __init__(self, layer: nn.Module, writes: Axis, lies: Axis) -> None:
        super().__init__()
        self.layer, self.writes, self.lies = layer, writes, lies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split(gather(self.layer(x), self.writes), self.lies)


# The grid layers below subclass their whole layers for the forward alone: they skip the
# whole __init__ and register their own (sliced) modules under the same names.


class ResBlock3D(ResBlock):
    """generator.ResBlock on the grid: conv1 (and the timestep embedding's projection)
    write over a, conv2 reads there and writes over b, where the block's input lies. A
    decoder block's input is its feature map's and its skip's parts, side by side: its
    conv1, norm and skip conv read those channels of the whole conv."""

    def __init__(self, whole: ResBlock, grid: Grid3D, placement: GridLayer, feature_channels: int) -> None:
        nn.Module.__init__(self)
        transposed = placement.transposed  # conv1's
        a, b = _axes(grid, transposed)
        c_in, c_out = whole.conv1.in_channels, whole.conv1.out_channels
        reads = _part(c_in, b)
        if whole.pop:
            popped = c_in - feature_channels
            reads = torch.cat([_part(feature_channels, b), feature_channels + _part(popped, b)])
        writes = _part(c_out, a)
        emb = None
        if whole.emb is not None:
            outputs = torch.cat([writes, c_out + writes]) if whole.scale_shift else writes
            emb_in, emb_out = whole.emb.in_features, whole.emb.out_features
            emb = _SlicesInput(Linear3D(emb_in, emb_out, grid, transposed, outputs=outputs, init=whole.emb), b)
        skip: nn.Module | None = None
        if whole.skip is not None:
            skip = Conv3D(whole.skip, grid, transposed, inputs=reads)
            if placement.resplit:
                skip = _Resplit(skip, a, b)
        modules = {
            "norm1": GroupNorm3D(whole.norm1, reads, b),
            "conv1": Conv3D(whole.conv1, grid, transposed, inputs=reads),
            "emb": emb,
            "norm2": GroupNorm3D(whole.norm2, writes, a),
            "conv2": Conv3D(whole.conv2, grid, not transposed),
            "skip": skip,
        }
        for name, module in modules.items():  # in forward order: each z-sharded weight prefetches the next
            self.add_module(name, module)
        self.pop, self.push, self.scale_shift = whole.pop, whole.push, whole.scale_shift


class SpatialAttention3D(SpatialAttention):
    """generator.SpatialAttention on the grid: its norm on the channels it reads, heads over a."""

    def __init__(self, whole: SpatialAttention, grid: Grid3D, placement: GridLayer) -> None:
        nn.Module.__init__(self)
        reads = _axes(grid, placement.transposed)[1]
        self.add_module("norm", GroupNorm3D(whole.norm, _part(whole.norm.num_channels, reads), reads))
        channels = whole.norm.num_channels
        self.add_module("attn", Attention3D(channels, whole.attn.heads, grid, placement.transposed, causal=False, init=whole.attn))
        self.push = whole.push


class Upsample3D(Upsample):
    def __init__(self, whole: Upsample, grid: Grid3D, placement: GridLayer) -> None:
        nn.Module.__init__(self)
        self.add_module("conv", Conv3D(whole.conv, grid, placement.transposed))


class TimeEmbedding3D(nn.Module):
    """generator.TimeEmbedding for this rank's samples, replicated on the tensor grid
    (its weights z-sharded): every block's projection reads its slice of the whole."""

    def __init__(self, whole: TimeEmbedding, grid: Grid3D) -> None:
        super().__init__()
        self.channels, self.z = whole.channels, grid.z
        replicated = grid.replicated()
        self.fc1 = Linear3D(whole.fc1.in_features, whole.fc1.out_features, replicated, init=whole.fc1)
        self.fc2 = Linear3D(whole.fc2.in_features, whole.fc2.out_features, replicated, init=whole.fc2)

    def forward(self, state: State) -> State:
        features = sinusoids(samples_of(state["timestep"], self.z), self.channels)
        return {**state, EMB: self.fc2(F.silu(self.fc1(features)))}


class Conv3DLayer(nn.Module):
    """generator.Conv on the grid: a stem that noises its samples, a downsampling conv,
    or the output conv that scores the noise; as an FC of the chain, or replicated on the
    tensor grid (the grid does not divide its channels): a replicated stem hands the next
    FC its slice, a replicated output conv gathers its input first."""

    outputs: torch.Tensor  # the output channels this rank writes

    def __init__(self, whole: Conv, grid: Grid3D, placement: GridLayer) -> None:
        super().__init__()
        if whole.role not in ("unet_in", "down", "unet_out"):
            raise ValueError(f"the real backend has no tensor grid module for a {whole.role!r} convolution")
        self.role, self.z = whole.role, grid.z
        self.gathers = grid.axis(placement.gathers) if placement.gathers else Axis()
        self.scatters = grid.axis(placement.scatters) if placement.scatters else Axis()
        if placement.replicated:
            self.reads, self.writes = Axis(), Axis()
            self.conv = Conv3D(whole.conv, grid.replicated())
        else:
            self.writes, self.reads = _axes(grid, placement.transposed)
            self.conv = Conv3D(whole.conv, grid, placement.transposed)
        channels = whole.conv.in_channels
        self.norm = None if whole.norm is None else GroupNorm3D(whole.norm, _part(channels, self.reads), self.reads)
        self.register_buffer("outputs", _part(whole.conv.out_channels, self.writes), persistent=False)

    def forward(self, state: State) -> State:
        if self.role == "unet_in":
            alpha = samples_of(state["alpha"], self.z).reshape(-1, 1, 1, 1)
            noised = alpha.sqrt() * samples_of(state["latent"], self.z) + (1 - alpha).sqrt() * samples_of(state["noise"], self.z)
            x = noised[:, _part(noised.shape[1], self.reads)]
        else:
            x = gather(state["x"], self.gathers)
        if self.norm is not None:
            x = F.silu(self.norm(x))
        x = self.conv(x)
        if self.role == "unet_out":
            return {**state, "x": x, "loss": self._loss(x, samples_of(state["noise"], self.z))}
        return push_skip(state, split(x, self.scatters))

    def _loss(self, out: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """generator.Conv's mean squared error over the noise channels, as this rank's
        share: its output channels' part of the sum, summed over the axis splitting them;
        its z rows' part of the mean."""
        held = self.outputs < noise.shape[1]
        errors = ((out[:, held] - noise[:, self.outputs[held]]) ** 2).sum()
        total = sum_over(errors, self.writes, replicated=True)
        return total / (noise.numel() * self.z.size)


def _feature_channels(layer: LayerSpec) -> int | None:
    """Channels of the feature map a U-Net layer writes (None: it writes none)."""
    names = {k.name: k for k in layer.kernels}
    for name in ("conv2", "conv", "proj"):
        if name in names:
            return names[name].n
    return None


class UNetOnGrid:
    """Builds a U-Net unit's layers on a grid, each as the plan lays it out (grid.layers)."""

    def __init__(self, unit: UnitSpec, grid: Grid3D) -> None:
        if len(grid.layers) != unit.num_layers:
            raise ValueError(f"the plan lays out {len(grid.layers)} layers of the grid, unit {unit.name} has {unit.num_layers}")
        self.unit, self.grid = unit, grid

    def layer(self, index: int) -> nn.Module:
        layers = self.unit.layers
        whole = generator_layer(layers, index)
        placement = self.grid.layers[index]
        if isinstance(whole, ResBlock):
            previous = next(c for c in map(_feature_channels, reversed(layers[:index])) if c is not None)
            return ResBlock3D(whole, self.grid, placement, previous)
        if isinstance(whole, SpatialAttention):
            return SpatialAttention3D(whole, self.grid, placement)
        if isinstance(whole, Upsample):
            return Upsample3D(whole, self.grid, placement)
        if isinstance(whole, TimeEmbedding):
            return TimeEmbedding3D(whole, self.grid)
        if isinstance(whole, Conv):
            return Conv3DLayer(whole, self.grid, placement)
        raise ValueError(f"the real backend has no tensor grid module for layer {layers[index].name!r} of unit {self.unit.name}")
