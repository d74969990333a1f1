"""Transformer layers, nanoGPT style. Every layer maps a state dict to a state dict, so a
unit is a plain list of layers that a pipeline stage can cut anywhere the ModelSpec can:

  images/ids -> embedding -> x -> blocks -> x -> head -> feature (or loss)

State keys: images, ids, targets (inputs); x (token states); memory (another unit's token
states, for cross-attention); feature (the pooled, projected embedding); tokens (a
tower's final token states, handed to another unit); loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from src.data.interleaved_mllm import token_mask
from src.models.flows import chain_key
from src.runtime.modules.parallel import TP, ColumnParallelLinear, RowParallelLinear, head_rows
from src.runtime.modules.sequence import reduce_grad, split_sequence, unsplit_sequence

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Llama:
    """A Llama block's differences from GPT's: RMSNorm, no biases, a SwiGLU MLP of width
    `ffn`, rotary positions, `kv_heads` key/value heads (grouped-query attention)."""

    ffn: int
    kv_heads: int


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE on (batch, heads, tokens, head_dim), the rotate-half form."""
    t, d = x.shape[-2], x.shape[-1]
    inverse = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inverse
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def qkv_rows(heads: int, kv_heads: int, head_dim: int, tp: TP) -> torch.Tensor:
    """This rank's rows of a fused q|k|v projection with fewer k/v heads than q heads."""
    q, kv = heads // tp.size * head_dim, kv_heads // tp.size * head_dim
    return torch.cat(
        [
            torch.arange(tp.rank * q, (tp.rank + 1) * q),
            heads * head_dim + torch.arange(tp.rank * kv, (tp.rank + 1) * kv),
            (heads + kv_heads) * head_dim + torch.arange(tp.rank * kv, (tp.rank + 1) * kv),
        ]
    )


def packed_lengths(state: State) -> list[int] | None:
    """The lengths of the images packed along the tokens of a ViT's state (each image's
    patches and CLS, runtime.inputs.unit_fields); None where its rows are whole images."""
    sides = state.get("patch_sides")
    return None if sides is None else [side * side + 1 for side in sides.tolist()]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Attention of each sequence packed along the tokens of q, k, v (1, heads, tokens,
    head_dim), `lengths` long in order, over itself alone: the sequences of one length at
    once, so the scores are each image's own (its tokens squared), as the plan prices them."""
    starts: dict[int, list[int]] = {}
    first = 0
    for length in lengths:
        starts.setdefault(length, []).append(first)
        first += length
    heads, dim = q.shape[1], q.shape[3]
    indices, outputs = [], []
    for length, firsts in starts.items():
        index = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(length, device=q.device)).reshape(-1)
        qs, ks, vs = (z[0][:, index].reshape(heads, len(firsts), length, dim).transpose(0, 1) for z in (q, k, v))
        y = F.scaled_dot_product_attention(qs, ks, vs)  # (images, heads, length, head_dim)
        indices.append(index)
        outputs.append(y.transpose(0, 1).reshape(heads, -1, dim))
    if not indices:  # no image: nothing to attend, q, k and v still in the graph (ZeRO-3 reduces their weights' gradients)
        return q + k + v
    return q.new_zeros(q.shape[1:]).index_copy(1, torch.cat(indices), torch.cat(outputs, dim=1))[None]


class Attention(nn.Module):
    """Multi-head attention; with `kv_dim` it is cross-attention over `memory`. TP splits
    the heads (q/k/v column-parallel by head, output projection row-parallel). `llama`:
    grouped-query attention with rotary positions and no biases."""

    def __init__(self, hidden: int, heads: int, tp: TP, causal: bool, kv_dim: int | None = None, llama: Llama | None = None) -> None:
        super().__init__()
        kv_heads = llama.kv_heads if llama is not None else heads
        if heads % tp.size or kv_heads % tp.size:
            raise ValueError(f"tp={tp.size} does not divide {heads} heads and {kv_heads} key/value heads")
        self.heads, self.head_dim, self.causal, self.cross = heads // tp.size, hidden // heads, causal, kv_dim
        self.kv_heads, self.rope = kv_heads // tp.size, llama is not None
        bias = llama is None
        if kv_dim is None:
            rows = qkv_rows(heads, kv_heads, self.head_dim, tp)
            self.qkv = ColumnParallelLinear(hidden, (heads + 2 * kv_heads) * self.head_dim, tp, rows, bias=bias)
        else:
            self.q = ColumnParallelLinear(hidden, hidden, tp, head_rows(heads, self.head_dim, 1, tp))
            self.kv = ColumnParallelLinear(kv_dim, 2 * hidden, tp, head_rows(heads, self.head_dim, 2, tp), token_states=False)
        local = torch.arange(tp.rank * self.heads * self.head_dim, (tp.rank + 1) * self.heads * self.head_dim)
        self.proj = RowParallelLinear(hidden, hidden, tp, local, bias=bias)
        self.recompute_core = False

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, packed: list[int] | None = None) -> torch.Tensor:
        """`packed`: the lengths of the sequences packed along x's tokens (a ViT's images at
        their own sides), each attending to itself alone."""
        if self.cross is None:
            kv = self.kv_heads * self.head_dim
            q, k, v = self.qkv(x).split([self.heads * self.head_dim, kv, kv], dim=-1)
        else:
            q = self.q(x)
            k, v = self.kv(memory).split(self.heads * self.head_dim, dim=-1)
        b, t = q.shape[:2]  # the whole sequence, also where x holds a part of it
        q, k, v = (z.reshape(b, z.shape[1], z.shape[2] // self.head_dim, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.rope:
            q, k = rotary(q), rotary(k)
        if self.kv_heads != self.heads and self.cross is None:
            k, v = (z.repeat_interleave(self.heads // self.kv_heads, dim=1) for z in (k, v))
        causal = self.causal and self.cross is None
        core: Callable[..., torch.Tensor]
        if packed is None:
            core = partial(F.scaled_dot_product_attention, is_causal=causal)
        else:
            core = partial(packed_attention, lengths=packed)
        if self.recompute_core and torch.is_grad_enabled():
            # Selective recomputation (Korthikanti et al.): keep q, k, v, re-run the core in backward.
            y = checkpoint(core, q, k, v, use_reentrant=False)
        else:
            y = core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm over token states that sequence parallelism may split: each TP rank
    then normalises 1/tp of the tokens, and the parameters' gradients are summed over TP."""

    def __init__(self, hidden: int, tp: TP) -> None:
        super().__init__(hidden)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = reduce_grad(self.weight, self.tp), reduce_grad(self.bias, self.tp)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """Llama's nn.RMSNorm, its gradient summed over TP as LayerNorm's."""

    def __init__(self, hidden: int, tp: TP) -> None:
        super().__init__(hidden)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, reduce_grad(self.weight, self.tp), self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, tp: TP) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, 4 * hidden, tp)
        self.fc2 = RowParallelLinear(4 * hidden, hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GatedMLP(nn.Module):
    """act(gate) * up, then down: SwiGLU (Llama, silu, no biases) or GEGLU (SD's
    transformers, gelu). fc1 holds [gate | up]; TP gives each rank matching slices of both."""

    def __init__(self, hidden: int, ffn: int, tp: TP, act: str, bias: bool) -> None:
        super().__init__()
        local = torch.arange(ffn).chunk(tp.size)[tp.rank]
        self.fc1 = ColumnParallelLinear(hidden, 2 * ffn, tp, torch.cat([local, ffn + local]), bias=bias)
        self.fc2 = RowParallelLinear(ffn, hidden, tp, local, bias=bias)
        self.act = F.silu if act == "silu" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.act(gate) * up)


class Block(nn.Module):
    """Pre-norm block; with `cross_dim` it also cross-attends to state['memory'] (CoCa's
    multimodal decoder layers, SD's spatial transformers). `llama`: Llama's block;
    `geglu`: a GEGLU MLP of width 4h (SD)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        tp: TP,
        causal: bool,
        cross_dim: int | None = None,
        llama: Llama | None = None,
        geglu: bool = False,
    ) -> None:
        super().__init__()
        norm = LayerNorm if llama is None else RMSNorm
        self.ln1 = norm(hidden, tp)
        self.attn = Attention(hidden, heads, tp, causal, llama=llama)
        if cross_dim is not None:
            self.ln_cross = LayerNorm(hidden, tp)
            self.cross = Attention(hidden, heads, tp, causal=False, kv_dim=cross_dim)
        self.ln2 = norm(hidden, tp)
        self.mlp: nn.Module
        if llama is not None:
            self.mlp = GatedMLP(hidden, llama.ffn, tp, "silu", bias=False)
        elif geglu:
            self.mlp = GatedMLP(hidden, 4 * hidden, tp, "gelu", bias=True)
        else:
            self.mlp = MLP(hidden, tp)

    def forward(self, state: State) -> State:
        x = state["x"]
        x = x + self.attn(self.ln1(x), packed=packed_lengths(state))
        if hasattr(self, "cross"):
            x = x + self.cross(self.ln_cross(x), state["memory"])
        x = x + self.mlp(self.ln2(x))
        return {**state, "x": x}


class PatchEmbedding(nn.Module):
    """ViT patchify + CLS token + learned positions (replicated over TP; under sequence
    parallelism each rank hands on its part of the sequence)."""

    def __init__(self, image: int, patch: int, hidden: int, tp: TP, channels: int = 3) -> None:
        super().__init__()
        self.patch, self.tp = patch, tp
        self.proj = nn.Linear(channels * patch * patch, hidden)
        self.cls = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, hidden) * 0.02)

    def forward(self, state: State) -> State:
        if "patches" in state:  # images at their own sides, their patches packed
            return {**state, "x": self._packed(state["patches"], state["patch_sides"])}
        images = state["images"]
        b, c, height, width = images.shape
        p = self.patch
        patches = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, height // p * (width // p), c * p * p)
        x = torch.cat([self.cls.expand(b, -1, -1), self.proj(patches)], dim=1) + self.pos
        return {**state, "x": split_sequence(x, self.tp)}

    def _packed(self, patches: torch.Tensor, sides: torch.Tensor) -> torch.Tensor:
        """(1, tokens, hidden): each image's CLS then its side^2 patches, image after image,
        its positions the learned grid's resized to its side."""
        tokens = self.proj(patches)
        cls = self.cls[0] + self.pos[0, :1]
        grids: dict[int, torch.Tensor] = {}
        # Every parameter in the graph, also on a rank whose micro-batch holds no image: ZeRO-3
        # reduces each one's gradient as autograd reaches it, on every rank alike.
        pieces, first = [cls[:0], tokens[:0]], 0
        for side in sides.tolist():
            if side not in grids:
                grids[side] = self._positions(side)
            pieces += [cls, tokens[first : first + side * side] + grids[side]]
            first += side * side
        return torch.cat(pieces)[None]

    def _positions(self, side: int) -> torch.Tensor:
        """The learned positions of the nominal side x side grid, bilinearly resized (as
        timm and OpenCLIP resize them for another resolution): (side^2, hidden)."""
        grid = self.pos[0, 1:]
        base = round(grid.shape[0] ** 0.5)
        if side == base:
            return grid
        square = grid.reshape(base, base, -1).permute(2, 0, 1)[None]
        resized = F.interpolate(square, size=(side, side), mode="bilinear", align_corners=False)
        return resized[0].permute(1, 2, 0).reshape(side * side, -1)


def with_images(x: torch.Tensor, state: State, sources: tuple[str, ...]) -> torch.Tensor:
    """Token embeddings x (batch, seq, hidden) whose first positions hold the image tokens
    that the units chained in (`sources`, in flow order) hand on flattened; x as it is
    when none are handed in (a unit run alone). On interleaved sequences (`image_slots`) the
    one encoder's projector hands each row's image tokens at their places, the rest zero: a
    row's first image_tokens positions take them, its text keeps its token embeddings."""
    keys = [chain_key(source) for source in sources]
    given = [key for key in keys if key in state]
    if not given:
        return x
    if len(given) < len(keys):
        raise ValueError(f"the embedding reads image tokens from {list(sources)} but got only {given}")
    if state.get("image_slots") is not None:
        (key,) = keys  # the real backend gives interleaved images to one encoder (runtime.inputs)
        mask = token_mask(state["image_tokens"], x.shape[1])
        return torch.where(mask[..., None], state[key].reshape(x.shape).to(x.dtype), x)
    images = torch.cat([state[key].reshape(x.shape[0], -1, x.shape[-1]).to(x.dtype) for key in keys], dim=1)
    return torch.cat([images, x[:, images.shape[1] :]], dim=1)


class TokenEmbedding(nn.Module):
    """Token + learned position embedding; `sources`: units whose image tokens take the
    first positions (an MLLM's encoders, with a GPT-style LLM)."""

    def __init__(self, vocab: int, hidden: int, seq: int, tp: TP, sources: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(1, seq, hidden) * 0.02)
        self.tp, self.sources = tp, sources

    def forward(self, state: State) -> State:
        x = with_images(self.tokens(state["ids"]), state, self.sources) + self.pos
        return {**state, "x": split_sequence(x, self.tp)}


class FeatureHead(nn.Module):
    """Final norm and projection of the pooled token (first: CLS; last: EOS) to the
    contrastive embedding. `keep_x`: the token states flow on (CoCa's decoder continues
    after its unimodal half); otherwise they are handed on as state['tokens']."""

    def __init__(self, hidden: int, embed_dim: int, pool: str, tp: TP, keep_x: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, embed_dim)
        self.index = 0 if pool == "first" else -1
        self.keep_x, self.tp = keep_x, tp

    def forward(self, state: State) -> State:
        whole = unsplit_sequence(state["x"], self.tp)
        out = {**state, "feature": self.proj(self.ln(whole[:, self.index]))}
        if not self.keep_x:  # the states flow on (split, as they came) or are handed on whole
            del out["x"]
            out["tokens"] = whole
        return out


class LMHead(nn.Module):
    """Final norm, vocabulary projection and next-token cross-entropy (mean over tokens).
    Untied from the embedding: the two sit on different pipeline stages."""

    def __init__(self, hidden: int, vocab: int, tp: TP) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab)
        self.tp = tp

    def forward(self, state: State) -> State:
        logits = self.proj(self.ln(unsplit_sequence(state["x"], self.tp)))
        # Targets of -100 (CoCa's last caption position, an image's tokens) are ignored.
        return {**state, "loss": next_token_loss(logits, state)}


def next_token_loss(logits: torch.Tensor, state: State) -> torch.Tensor:
    """The cross-entropy of `logits` against state['targets']: the mean over the scored
    tokens, or on interleaved sequences (whose micro-batches score different numbers of
    tokens) their sum over the step's mean scored tokens per row times the rows
    (state['loss_norm']), so that a micro-batch's loss is its share of the step's."""
    flat = logits.reshape(-1, logits.shape[-1]), state["targets"].reshape(-1)
    norm = state.get("loss_norm")
    return F.cross_entropy(*flat) if norm is None else F.cross_entropy(*flat, reduction="sum") / norm.sum()
