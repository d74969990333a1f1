"""A GPT on the tensor grid (x, y, z, data): nanoGPT's layers with every FC a Linear3D
(runtime.modules.grid3d), each layer mapping a state dict to a state dict as
runtime.modules.blocks' do, and drawing the very weights of a one-process build.

Layout between layers (docs/strategies.md, "The tensor grid in a plan"): token
states hold this rank's z part of the micro-batch's samples (whole sequences, so
attention needs no communication) and the hidden columns over y, replicated over x.
A block's q|k|v FC writes its heads over x; the output projection (transposed) reads
them and writes the hidden over y again; fc1 and fc2 likewise.

Besides the FCs' own collectives (the plan's Program lists them all):
  LayerNorm    its rows' sum and sum of squares all-reduced over y, forward and backward
               (each rank's normalised columns feed only its own FC block: partial gradients)
  embedding    token and position rows of one table split over x, lookups summed over x
  loss         the vocabulary split over x: rows' maxima, then sums of exponentials and
               target logits, all-reduced over x
A result every replica computes whole (a lookup sum, the loss) gets the whole gradient on
every replica: its all-reduce's backward is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from src.models.spec import UnitSpec
from src.runtime.comm import CLOCK
from src.runtime.modules.blocks import Attention, qkv_rows
from src.runtime.modules.grid3d import Axis, Grid3D, Linear3D, ZSharded, axis_part, fc_axes
from src.runtime.modules.parallel import TP

State = dict[str, torch.Tensor]


def _all_reduce(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    x = x.clone()
    with CLOCK.timed("tp"):
        dist.all_reduce(x, group=axis.group)
    return x


class _Sum(torch.autograd.Function):
    """All-reduce over an axis. Its backward is the identity where every rank uses the
    result whole (each replica's gradient is whole), and sums the gradients over the axis
    where each rank uses it for its own columns only (each gradient is partial)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis, partial: bool) -> torch.Tensor:
        ctx.axis, ctx.partial = axis, partial
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_all_reduce(grad, ctx.axis) if ctx.partial else grad), None, None


def sum_over(x: torch.Tensor, axis: Axis, replicated: bool) -> torch.Tensor:
    return x if axis.size == 1 else _Sum.apply(x, axis, not replicated)


def samples_of(batch: torch.Tensor, z: Axis) -> torch.Tensor:
    """This z rank's samples of the micro-batch."""
    if batch.shape[0] % z.size:
        raise ValueError(f"a micro-batch of {batch.shape[0]} samples does not split over G_z={z.size}")
    return batch[axis_part(batch.shape[0], z)]


class LayerNorm3D(nn.Module):
    """nn.LayerNorm over a hidden width whose columns are split over y."""

    def __init__(self, hidden: int, grid: Grid3D, eps: float = 1e-5) -> None:
        super().__init__()
        self.grid, self.hidden, self.eps = grid, hidden, eps
        width = hidden // grid.y.size
        self.weight, self.bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = sum_over(torch.stack([x.sum(-1), (x * x).sum(-1)], dim=-1), self.grid.y, replicated=False) / self.hidden
        mean, square = stats[..., :1], stats[..., 1:]
        return (x - mean) * torch.rsqrt(square - mean * mean + self.eps) * self.weight + self.bias


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, shard: torch.Tensor, layer: Embedding3D) -> torch.Tensor:
        """Sum of the table rows `rows` (..., 2: token row, position row) this x rank holds."""
        table = layer.gathered_weight()
        local = rows - layer.first_row
        held = (local >= 0) & (local < table.shape[0])
        index = local.clamp(0, table.shape[0] - 1)
        out = (table[index] * held.unsqueeze(-1)).sum(-2)
        ctx.save_for_backward(index, held)
        ctx.layer, ctx.table_shape = layer, table.shape
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        index, held = ctx.saved_tensors
        grad_table = torch.zeros(ctx.table_shape, dtype=grad.dtype, device=grad.device)
        both = (grad.unsqueeze(-2) * held.unsqueeze(-1)).reshape(-1, grad.shape[-1])
        grad_table.index_add_(0, index.reshape(-1), both)
        ctx.layer.reduce_weight_grad(grad_table)
        ctx.layer.release()
        if ctx.layer.grid.gather_order == "lightning":
            ctx.layer.grid.close()  # the backward's end
        return None, None, None


class _BackwardStart(torch.autograd.Function):
    """gather_order=lightning: the loss's backward opens the backward's iterators, the
    forward-order one (which issues its first gather) replaced by the reverse-order one."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, grid: Grid3D) -> torch.Tensor:
        ctx.grid = grid
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.grid.start(ctx.grid.module_order)
        ctx.grid.start(ctx.grid.module_order[::-1])
        return grad, None


class Embedding3D(ZSharded):
    """Token and learned position embeddings (runtime.modules.blocks.TokenEmbedding) as
    one table of vocab + seq rows: rows split over x, columns over y, and this rank's
    block sharded over z."""

    def __init__(self, vocab: int, hidden: int, seq: int, grid: Grid3D) -> None:
        super().__init__(grid)
        tokens = nn.Embedding(vocab, hidden).weight.detach()  # drawn as TokenEmbedding draws them
        positions = torch.randn(1, seq, hidden)[0] * 0.02
        table = torch.cat([tokens, positions])
        if table.shape[0] % (grid.x.size * grid.z.size) or hidden % grid.y.size:
            raise ValueError(
                f"an embedding of {vocab} + {seq} rows and {hidden} columns on G_x={grid.x.size}, "
                f"G_y={grid.y.size}, G_z={grid.z.size}: the grid does not divide it"
            )
        rows = axis_part(table.shape[0], grid.x)
        block = table[rows, axis_part(hidden, grid.y)]
        self.vocab, self.first_row = vocab, rows.start
        self.shard = nn.Parameter(block[axis_part(block.shape[0], grid.z)].clone())

    def forward(self, state: State) -> State:
        if self.grid.gather_order == "lightning":
            self.grid.start(self.grid.module_order)  # the forward's iterator
        ids = samples_of(state["ids"], self.grid.z)
        positions = self.vocab + torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        lookups = _Lookup.apply(torch.stack([ids, positions], dim=-1), self.shard, self)
        return {**state, "x": sum_over(lookups, self.grid.x, replicated=True)}


class Attention3D(nn.Module):
    """Self-attention (runtime.modules.blocks.Attention): q|k|v's output columns over its
    columns axis by whole heads, the output projection the other way round, so it writes
    where it read. `transposed`: q|k|v's heads over y (a U-Net layer's orientation);
    `init`: the whole layer to slice (else each block is drawn as the whole one's)."""

    def __init__(
        self, hidden: int, heads: int, grid: Grid3D, transposed: bool = False, causal: bool = True, init: Attention | None = None
    ) -> None:
        super().__init__()
        heads_axis = fc_axes(transposed)[0]
        split = grid.axis(heads_axis)
        if heads % split.size:
            raise ValueError(f"G_{heads_axis}={split.size} does not divide the {heads} attention heads")
        self.head_dim, self.heads, self.causal = hidden // heads, heads // split.size, causal
        rows = qkv_rows(heads, heads, self.head_dim, TP(split.size, split.rank))
        self.qkv = Linear3D(hidden, 3 * hidden, grid, transposed, outputs=rows, init=init.qkv if init else None)
        self.proj = Linear3D(hidden, hidden, grid, not transposed, init=init.proj if init else None)
        self.recompute_core = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = (z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(F.scaled_dot_product_attention, q, k, v, is_causal=self.causal, use_reentrant=False)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Block3D(nn.Module):
    """GPT's pre-norm block (runtime.modules.blocks.Block) on the grid."""

    def __init__(self, hidden: int, heads: int, grid: Grid3D) -> None:
        super().__init__()
        self.ln1 = LayerNorm3D(hidden, grid)
        self.attn = Attention3D(hidden, heads, grid)
        self.ln2 = LayerNorm3D(hidden, grid)
        self.fc1 = Linear3D(hidden, 4 * hidden, grid)
        self.fc2 = Linear3D(4 * hidden, hidden, grid, transposed=True)

    def forward(self, state: State) -> State:
        x = state["x"]
        x = x + self.attn(self.ln1(x))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return {**state, "x": x}


class Head3D(nn.Module):
    """Final norm, the vocabulary projection (its columns over x) and next-token
    cross-entropy over the split vocabulary: this z rank's part of the micro-batch's mean."""

    def __init__(self, hidden: int, vocab: int, grid: Grid3D) -> None:
        super().__init__()
        self.grid = grid
        self.ln = LayerNorm3D(hidden, grid)
        self.proj = Linear3D(hidden, vocab, grid, init=nn.Linear(hidden, vocab))  # drawn as LMHead's
        self.first = grid.x.rank * (vocab // grid.x.size)

    def forward(self, state: State) -> State:
        logits = self.proj(self.ln(state["x"])).float()
        targets = samples_of(state["targets"], self.grid.z)
        peak = logits.detach().amax(-1, keepdim=True)
        if self.grid.x.size > 1:
            with CLOCK.timed("tp"):
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.grid.x.group)
        local = targets - self.first
        held = (local >= 0) & (local < logits.shape[-1])
        target = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * held
        sums = sum_over(torch.stack([(logits - peak).exp().sum(-1), target], dim=-1), self.grid.x, replicated=True)
        losses = sums[..., 0].log() + peak.squeeze(-1) - sums[..., 1]
        loss = losses.sum() / (losses.numel() * self.grid.z.size)
        if self.grid.gather_order == "lightning":
            self.grid.close()  # the forward's end
            loss = _BackwardStart.apply(loss, self.grid)
        return {**state, "loss": loss}


GRID_LAYERS = ("embedding", "block", "head")  # the layers grid_layer builds


def grid_layer(unit: UnitSpec, index: int, grid: Grid3D, vocab: int) -> nn.Module:
    """Layer `index` of a GPT unit on the grid (runtime.modules.units builds the others)."""
    name = unit.layers[index].name
    module: nn.Module
    if name == "embedding":
        module = Embedding3D(vocab, unit.hidden, unit.seq_len, grid)
    elif name == "block":
        module = Block3D(unit.hidden, unit.heads, grid)
    elif name == "head":
        module = Head3D(unit.hidden, vocab, grid)
    else:
        raise ValueError(f"the real backend has no tensor grid module for layer {name!r} of unit {unit.name}")
    return module
