"""The 3D-parallel linear layer of a tensor grid (docs/strategies.md), one autograd Function per layer.

A rank g(i, j, k) of a (G_x, G_y, G_z) tensor grid holds, for O = I·W with W (k x n):
the weight block W[j, i] (rows split over y, columns over x), itself sharded over z so
each rank stores one unique piece Ŵ (rows of the block split over z; its columns where
z does not divide its rows). The input I[k, j] has its rows split over z and its columns
over y; the output O[k, i] its rows over z and its columns over x. A transposed layer swaps the roles of x and y, so a layer
reads the layout the previous one wrote.

Forward: W = all-gather_z(Ŵ); O = all-reduce_y(I·W) (+ bias, once after the sum).
Backward: dI = all-reduce_x(dO·Wᵀ); dŴ = reduce-scatter_z(Iᵀ·dO).
The four overlaps (`Grid3D.overlap`): all_reduce (A) issues dI's all-reduce before the
weight-gradient GEMM and waits after it; reduce_scatter (B) leaves dŴ's reduce-scatter
in flight until `Grid3D.finish_backward()`; all_gather (C) prefetches the next layer's
weights during this layer's forward; cache (D) keeps the gathered weights from the
forward for a recomputed forward (activation checkpointing) instead of gathering again.
`finish_backward()` sums the gradients of what the grid replicates over z (biases, norms:
each z rank saw its own rows) over z, and every gradient over data parallelism (`dp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from src.program import GRID_OVERLAPS, GridLayer
from src.runtime.comm import CLOCK, all_gather_single, reduce_scatter_single
from src.runtime.grad_reduce import all_reduce_grads
from src.runtime.modules.parallel import linear_shard


@dataclass(frozen=True)
class Axis:
    """This rank's place along one grid axis (size 1: no group, no communication)."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None


@dataclass
class Grid3D:
    """This rank's groups on the (x, y, z, data) grid, the overlaps that are on, and the
    collectives left in flight until the end of the backward."""

    x: Axis = Axis()
    y: Axis = Axis()
    z: Axis = Axis()
    dp: Axis = Axis()
    overlap: frozenset[str] = frozenset()
    cached_layers: frozenset[int] | None = None  # with cache (D): the layers that cache (None: every one)
    layers: tuple[GridLayer, ...] = ()  # how the plan lays each layer of the unit out
    pending: list = field(default_factory=list)
    gathers: int = 0  # z all-gathers issued, for tests of prefetching and caching
    listed: int = 0  # of them, gathered where needed into a list of the shards (_gather's listed)
    # How the weights are gathered (TensorGrid.gathers): paper, each layer prefetching the next
    # (C); lightning, AxoNN's Lightning strategy's cache and iterator (start, take, close).
    gather_order: str = "paper"
    module_order: list = field(default_factory=list)  # lightning: the Linear layers in registration order
    iterator: list = field(default_factory=list)
    position: int = 0
    held: dict = field(default_factory=dict)  # lightning: id(layer) -> its gather in flight

    @classmethod
    def build(
        cls,
        degrees: tuple[int, int, int, int],
        overlap: frozenset[str] = frozenset(),
        cached_layers: frozenset[int] | None = None,
        layers: tuple[GridLayer, ...] = (),
        gather_order: str = "paper",
    ) -> Grid3D:
        """Every group of the grid (X innermost, then Y, Z, data: rank = i + G_x(j + G_y(k +
        G_z d))), made collectively by every rank; this rank's own axes."""
        unknown = set(overlap) - set(GRID_OVERLAPS)
        if unknown:
            raise ValueError(f"unknown overlaps {sorted(unknown)}; choose from {list(GRID_OVERLAPS)}")
        rank, strides = dist.get_rank(), []
        stride = 1
        for degree in degrees:
            strides.append(stride)
            stride *= degree
        if stride != dist.get_world_size():
            raise ValueError(f"grid {degrees} holds {stride} ranks but the world has {dist.get_world_size()}")
        axes = []
        for degree, stride in zip(degrees, strides):
            mine = Axis()
            for start in range(dist.get_world_size()):
                if (start // stride) % degree:  # not the group's first member
                    continue
                members = [start + stride * t for t in range(degree)]
                group = dist.new_group(members) if degree > 1 else None
                if rank in members:
                    mine = Axis(degree, members.index(rank), group)
            axes.append(mine)
        x, y, z, dp = axes
        return cls(x, y, z, dp, frozenset(overlap), cached_layers, layers, gather_order=gather_order)

    def with_overlap(self, overlap: frozenset[str]) -> Grid3D:
        """The same groups with other overlaps on (nothing in flight, no gathers counted)."""
        return Grid3D(
            self.x, self.y, self.z, self.dp, frozenset(overlap), self.cached_layers, self.layers, gather_order=self.gather_order
        )

    def replicated(self) -> Grid3D:
        """The grid as a layer replicated on the tensor grid sees it (a U-Net's stem: rows
        still split over z, weights z-sharded): no x or y, the same reduce-scatters in flight."""
        return Grid3D(
            Axis(),
            Axis(),
            self.z,
            self.dp,
            self.overlap,
            self.cached_layers,
            self.layers,
            self.pending,
            gather_order=self.gather_order,
        )

    def axis(self, name: str) -> Axis:
        return getattr(self, name)

    def start(self, order: list[ZSharded]) -> None:
        """gather_order=lightning: a new iterator over `order`, which issues its first gather
        at once (AxoNN's optimize_communication and overlap_all_gathers_for_checkpointed_forward)."""
        if "all_gather" in self.overlap:
            self.iterator, self.position = order, 0
            self._advance()

    def _advance(self) -> None:
        if self.position >= len(self.iterator):
            return
        layer = self.iterator[self.position]
        self.position += 1
        if id(layer) not in self.held:
            self.held[id(layer)] = self.gather(layer.shard)

    def gather(self, shard: torch.Tensor, listed: bool = False) -> _InFlight:
        """Start a weight's z all-gather (counted)."""
        self.gathers += self.z.size > 1
        self.listed += listed and self.z.size > 1
        return _gather(shard, self.z, listed)

    def take(self, layer: ZSharded) -> _InFlight | None:
        """The layer's gather the iterator issued, if it did (the iterator then issues its next)."""
        inflight = self.held.pop(id(layer), None)
        if inflight is not None:
            self._advance()
        return inflight

    def close(self) -> None:
        """The end of a pass: what is in flight is waited and dropped (AxoNN synchronizes the device)."""
        for inflight in self.held.values():
            inflight.result()
        self.held.clear()

    def finish_pending(self) -> None:
        """Wait for the reduce-scatters left in flight (B) and add them to the shards' gradients."""
        for inflight, param in self.pending:
            _accumulate(param, inflight.result())
        self.pending.clear()

    def finish_backward(self, modules: list[nn.Module]) -> None:
        """Finish the reduce-scatters in flight (B), sum the z-replicated parameters'
        gradients over z, and every gradient over data parallelism; drop any weights a
        recomputation prefetched (C) but did not use, so the next step gathers the updated ones."""
        unique: set[int] = set()
        for module in modules:
            for layer in module.modules():
                if isinstance(layer, ZSharded):
                    layer.drop_prefetch()
                    unique.add(id(layer.shard))
        self.finish_pending()
        grads = {id(p): p.grad for module in modules for p in module.parameters() if p.grad is not None}
        if self.z.size > 1:
            with CLOCK.timed("tp"):
                all_reduce_grads([grad for key, grad in grads.items() if key not in unique], self.z.group)
        if self.dp.size > 1:
            with CLOCK.timed("dp"):
                all_reduce_grads(list(grads.values()), self.dp.group)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad + grad


class _InFlight:
    """A collective issued asynchronously and how to read its result once waited."""

    def __init__(self, handle, finish) -> None:
        self.handle, self.finish = handle, finish

    def result(self) -> torch.Tensor:
        if self.handle is not None:
            with CLOCK.timed("tp"):
                self.handle.wait()
        return self.finish()


def _nccl(axis: Axis) -> bool:
    return dist.get_backend(axis.group) == "nccl"


def _gather(shard: torch.Tensor, axis: Axis, listed: bool = False) -> _InFlight:
    """Start the z all-gather of a weight shard (rows concatenated): into one tensor, or
    (`listed`, a gather where the weight is needed) into a list of the shards then
    concatenated, as AxoNN's `_gather` does (Collective.listed); gloo gathers into a list."""
    local = shard.detach().contiguous()
    if axis.size == 1:
        return _InFlight(None, lambda: local)
    if _nccl(axis) and not listed:
        out = torch.empty((axis.size * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
        return _InFlight(all_gather_single(out, local, group=axis.group, async_op=True), lambda: out)
    parts = [torch.empty_like(local) for _ in range(axis.size)]
    return _InFlight(dist.all_gather(parts, local, group=axis.group, async_op=True), lambda: torch.cat(parts))


def _reduce_scatter(full: torch.Tensor, axis: Axis, async_op: bool) -> _InFlight:
    """Start the z reduce-scatter of a weight gradient (this rank keeps its rows)."""
    full = full.contiguous()
    rows = full.shape[0] // axis.size
    if _nccl(axis):
        out = torch.empty((rows,) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device)
        handle = reduce_scatter_single(out, full, group=axis.group, async_op=async_op)
        return _InFlight(handle if async_op else None, lambda: out)
    # gloo has no reduce-scatter: all-reduce, then keep this rank's rows.
    handle = dist.all_reduce(full, group=axis.group, async_op=async_op)
    return _InFlight(handle if async_op else None, lambda: full[axis.rank * rows : (axis.rank + 1) * rows])


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast gives this GEMM (a custom Function's backward runs outside
    autocast, so the forward records it)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, bias: torch.Tensor | None, layer: Linear3D) -> torch.Tensor:
        dtype = _gemm_dtype(x)
        x_gemm, weight = x.to(dtype), layer.block().to(dtype)
        if layer.grid.gather_order == "lightning":
            ctx.save_for_backward(x_gemm)  # the shard only: the backward gathers the block again
        else:
            ctx.save_for_backward(x_gemm, weight)
        ctx.layer, ctx.has_bias, ctx.input_dtype = layer, bias is not None, x.dtype
        out = x_gemm @ weight
        rows = layer.grid.axis(layer.rows_axis)
        if rows.size > 1:
            with CLOCK.timed("tp"):
                dist.all_reduce(out, group=rows.group)
        return out + bias.to(dtype) if bias is not None else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layer: Linear3D = ctx.layer
        x, *kept = ctx.saved_tensors
        weight = kept[0] if kept else layer.block().to(x.dtype)
        grid = layer.grid
        cols = grid.axis(layer.cols_axis)
        grad = grad.to(weight.dtype)
        grad_x = grad @ weight.t()
        handle = None
        if cols.size > 1:
            with CLOCK.timed("tp"):
                handle = dist.all_reduce(grad_x, group=cols.group, async_op="all_reduce" in grid.overlap)
        flat_x, flat_grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_w = flat_x.t() @ flat_grad  # overlapped with dI's all-reduce under A
        if handle is not None and "all_reduce" in grid.overlap:
            with CLOCK.timed("tp"):
                handle.wait()
        # This z rank's rows' bias gradient (Grid3D.finish_backward sums them); fp32 master gradients.
        grad_bias = flat_grad.sum(0).to(layer.shard.dtype) if ctx.has_bias else None
        layer.reduce_weight_grad(grad_w.to(layer.shard.dtype))
        layer.release()
        return grad_x.to(ctx.input_dtype), None, grad_bias, None


class ZSharded(nn.Module):
    """A weight block stored sharded over z (rows of the block split over z, `shard`),
    all-gathered before use and its gradient reduce-scattered back: an FC's block or an
    embedding table's. Subclasses set `shard`."""

    shard: nn.Parameter

    def __init__(self, grid: Grid3D) -> None:
        super().__init__()
        self.grid = grid
        self.caches = "cache" in grid.overlap  # units.build_units narrows it to the plan's cached layers
        self.next: ZSharded | None = None  # the layer whose weights C prefetches (see prefetches())
        self._inflight: _InFlight | None = None
        self._cached: torch.Tensor | None = None

    def prefetches(self, layer: ZSharded) -> None:
        """Make `layer` the one whose weights this layer's forward prefetches (C); kept out
        of the module tree, so neither its parameters nor its state repeat under this one."""
        object.__setattr__(self, "next", layer)

    def prefetch(self, listed: bool = False) -> None:
        if self._inflight is None and self._cached is None:
            self._inflight = self.grid.gather(self.shard, listed)

    def gathered_weight(self) -> torch.Tensor:
        """This rank's whole block: cached (D), prefetched (C) or gathered now."""
        if self.grid.gather_order == "lightning":
            inflight = self.grid.take(self)
            if inflight is None:  # not the one the iterator issued: gathered on the spot
                inflight = self.grid.gather(self.shard, listed=True)
            return inflight.result()
        if self._cached is not None:
            weight = self._cached
        else:
            # Without C the weight is gathered where it is needed; with C the chain issued it,
            # or issues the first of its order now.
            self.prefetch(listed="all_gather" not in self.grid.overlap)
            assert self._inflight is not None
            weight = self._inflight.result()
            self._inflight = None
            if self.caches:
                self._cached = weight
        if "all_gather" in self.grid.overlap and self.next is not None:
            self.next.prefetch()
        return weight

    def drop_prefetch(self) -> None:
        if self._inflight is not None:
            self._inflight.result()
        self._inflight, self._cached = None, None

    def release(self) -> None:
        """The backward is done with the gathered weights."""
        self._cached = None

    def reduce_weight_grad(self, grad_w: torch.Tensor) -> None:
        z = self.grid.z
        if z.size == 1:
            _accumulate(self.shard, grad_w)
            return
        overlapped = "reduce_scatter" in self.grid.overlap
        with CLOCK.timed("tp"):
            inflight = _reduce_scatter(grad_w, z, overlapped)
        if overlapped:
            self.grid.pending.append((inflight, self.shard))
        else:
            _accumulate(self.shard, inflight.result())


class Weighted(Protocol):
    """A whole linear layer to slice a grid layer from (nn.Linear, a TP layer at tp 1)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...


class Linear3D(ZSharded):
    """nn.Linear(d_in, d_out) on a 3D grid. Initialised as nn.Linear from the global RNG
    (runtime.modules.parallel.linear_shard, drawing only this rank's block), or sliced from
    a whole `init` layer, so every grid starts from the weights of one process. `outputs`
    and `inputs`: the output features this rank holds and the input features it reads
    (default: its contiguous parts), e.g. whole heads of a fused q|k|v projection, or the
    two concatenated parts of a U-Net's decoder input."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        grid: Grid3D,
        transposed: bool = False,
        bias: bool = True,
        outputs: torch.Tensor | None = None,
        inputs: torch.Tensor | None = None,
        init: Weighted | None = None,
    ) -> None:
        super().__init__(grid)
        self.transposed = transposed
        self.cols_axis, self.rows_axis = fc_axes(transposed)
        cols, rows, z = grid.axis(self.cols_axis), grid.axis(self.rows_axis), grid.z
        where = f"Linear3D({d_in}, {d_out}) on G_{self.cols_axis}={cols.size}, G_{self.rows_axis}={rows.size}, G_z={z.size}"
        if d_out % cols.size or d_in % rows.size:
            raise ValueError(f"{where}: the grid does not divide it")
        if outputs is None:
            outputs = torch.arange(d_out)[axis_part(d_out, cols)]
        if inputs is None:
            inputs = torch.arange(d_in)[axis_part(d_in, rows)]
        # The block is stored (k x n) with its rows split over z, or, where z does not divide
        # its k rows (a stem's 27 = 3 channels x 3 x 3), as (n x k) with its n rows split.
        self.outputs_major = len(inputs) % z.size != 0
        if self.outputs_major and len(outputs) % z.size:
            raise ValueError(f"{where}: G_z divides neither the block's {len(inputs)} rows nor its {len(outputs)} columns")
        if not self.outputs_major:
            inputs = inputs[axis_part(len(inputs), z)]
        # Only this rank's block is drawn (its z part, and whole output rows for the bias).
        if init is None:
            weight, full_bias = linear_shard(d_in, d_out, outputs, inputs)
            self.bias = nn.Parameter(full_bias) if bias else None
        else:
            weight = init.weight.detach()[outputs][:, inputs]
            self.bias = nn.Parameter(init.bias.detach()[outputs].clone()) if bias and init.bias is not None else None
        if self.outputs_major:
            weight = weight[axis_part(len(outputs), z)]
        self.shard = nn.Parameter((weight if self.outputs_major else weight.t()).contiguous())

    def block(self) -> torch.Tensor:
        """This rank's whole (k x n) block, gathered over z."""
        weight = self.gathered_weight()
        return weight.t() if self.outputs_major else weight

    def reduce_weight_grad(self, grad_w: torch.Tensor) -> None:
        super().reduce_weight_grad(grad_w.t() if self.outputs_major else grad_w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear3D.apply(x, self.shard, self.bias, self)


class Conv3D(nn.Module):
    """A convolution on the grid as 3D tensor parallelism (AxoNN's) parallelises it, like a linear layer over its
    weight: input channels as k (over the rows axis), output channels as n (over the
    columns axis), each sample's pixels on the z rank that holds the sample. Unfolding a
    rank's input channels gives their patches channel-major, i.e. the rank's contiguous
    k slice of the whole conv's (C_in·kh·kw) GEMM, so the GEMM is a Linear3D sliced from
    the whole `init` conv. `inputs`: the input channels this rank reads, in its input's
    order (default: its contiguous part)."""

    def __init__(self, init: nn.Conv2d, grid: Grid3D, transposed: bool = False, inputs: torch.Tensor | None = None) -> None:
        super().__init__()
        kh, kw = init.kernel_size
        # Its weights are copied in, so it skips drawing its own (and the RNG stays as it was).
        as_linear = nn.utils.skip_init(nn.Linear, init.in_channels * kh * kw, init.out_channels, bias=init.bias is not None)
        with torch.no_grad():
            as_linear.weight.copy_(init.weight.reshape(init.out_channels, -1))
            if init.bias is not None:
                as_linear.bias.copy_(init.bias)
        taps = kh * kw
        rows = None if inputs is None else (inputs[:, None] * taps + torch.arange(taps)).flatten()
        self.gemm = Linear3D(as_linear.in_features, as_linear.out_features, grid, transposed, inputs=rows, init=as_linear)
        padding = init.padding
        if isinstance(padding, str):
            raise ValueError(f"Conv3D takes explicit padding, not {padding!r}")
        self.kernel_size, self.stride, self.padding = init.kernel_size, init.stride, padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        patches = F.unfold(x, self.kernel_size, padding=self.padding, stride=self.stride)
        out = self.gemm(patches.transpose(1, 2))
        rows = (height + 2 * self.padding[0] - self.kernel_size[0]) // self.stride[0] + 1
        return out.transpose(1, 2).reshape(batch, out.shape[-1], rows, -1)


def fc_axes(transposed: bool) -> tuple[str, str]:
    """The axes splitting an FC's output columns (n) and its input columns (k)."""
    return ("y", "x") if transposed else ("x", "y")


def link_prefetches(layers: nn.ModuleList, grid: Grid3D) -> None:
    """Each z-sharded weight prefetches the next one in forward order (overlap C); under
    gather_order=lightning the grid's iterator walks the Linear layers in LitGPT's
    registration order instead, its output head's before its blocks'."""
    sharded = [m for m in layers.modules() if isinstance(m, ZSharded)]
    for layer, following in zip(sharded, sharded[1:]):
        layer.prefetches(following)

    def linears(module: nn.Module) -> list[ZSharded]:
        return [m for m in module.modules() if isinstance(m, Linear3D)]

    grid.module_order = linears(layers[-1]) + [m for layer in layers[:-1] for m in linears(layer)]


def narrow_cache(layer: nn.Module, index: int, grid: Grid3D) -> None:
    """With the cache (D) on, only the plan's cached layers keep their gathered weights."""
    if grid.cached_layers is not None:
        for sharded in layer.modules():
            if isinstance(sharded, ZSharded):
                sharded.caches = sharded.caches and index in grid.cached_layers


def axis_part(size: int, axis: Axis) -> slice:
    """This rank's contiguous part of `size` items split evenly along `axis`."""
    step = size // axis.size
    return slice(axis.rank * step, (axis.rank + 1) * step)
