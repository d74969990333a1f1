"""The real layers of a diffusion U-Net: an SD-style generator's (src/models/sd21.py's
LayerSpecs: the frozen VAE encoder that turns the target image into a latent, and the
conditional U-Net) and the ADM U-Nets on pixels (src/models/unet.py: scale-shift
residual blocks, self-attention blocks). Each learns to predict the noise added to its
input (the epsilon objective of DDPM/SD; an ADM U-Net's variance channels, which Improved
DDPM trains with its variational bound, are not scored, so they learn nothing here).

Every layer maps a state dict to a state dict, so the unit stays a list of layers:

  target -> vae.* -> x (the latent);  timestep -> time_embedding -> emb;
  latent (or x), noise, alpha -> conv_in -> x -> down/mid/up blocks -> conv_out -> loss

The U-Net's skip connections travel in the state as 'skip.<n>' (pushed by the down path,
popped by the up path's residual blocks), so the unit cannot be cut into pipeline stages
(the runtime refuses pp > 1 for it). Widths are read off each LayerSpec's kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from src.models.spec import Kernel, LayerSpec
from src.runtime.modules.blocks import Attention, Block, State
from src.runtime.modules.parallel import TP

GROUPS = 32  # SD's GroupNorm(32)
GROUP_WIDTH = 4  # channels per group at least: SD's narrowest (its VAE's 128 channels in 32 groups)
LATENT_SCALE = 0.18215  # SD's VAE latent scaling
# State keys: the skips the down path pushed, the timestep embedding, the condition that
# the output projector makes of the LLM's states (its cross-attention's memory).
SKIP, EMB, COND = "skip.", "emb", "condition"


def _norm(channels: int) -> nn.GroupNorm:
    """SD's 32 groups; a tiny width gets fewer, of GROUP_WIDTH channels (its deepest level
    is 1x1 pixel, where a group of two values would normalise to +-1)."""
    groups = max(1, min(GROUPS, channels // GROUP_WIDTH))
    while channels % groups:
        groups -= 1
    return nn.GroupNorm(groups, channels)


def push_skip(state: State, x: torch.Tensor) -> State:
    count = sum(key.startswith(SKIP) for key in state)
    return {**state, "x": x, f"{SKIP}{count}": x}


def handed_on(state: State) -> State:
    """What a U-Net's layers hand each other besides the feature map 'x': the timestep
    embedding, the skips the down path pushed and the condition."""
    return {key: value for key, value in state.items() if key in (EMB, COND) or key.startswith(SKIP)}


def pop_skip(state: State) -> tuple[torch.Tensor, State]:
    key = f"{SKIP}{sum(k.startswith(SKIP) for k in state) - 1}"
    return state[key], {k: v for k, v in state.items() if k != key}


class Conv(nn.Module):
    """A lone convolution, optionally after GroupNorm + SiLU (stems, downsampling, output).
    role: 'vae_in' reads the target image; 'latent' turns the VAE's moments into the
    scaled latent mean; 'unet_in' noises the latent first; 'unet_out' predicts the noise
    and scores it; 'down' pushes a skip."""

    def __init__(self, c_in: int, c_out: int, ksize: int, stride: int, norm: bool, role: str) -> None:
        super().__init__()
        self.norm = _norm(c_in) if norm else None
        self.conv = nn.Conv2d(c_in, c_out, ksize, stride=stride, padding=ksize // 2)
        self.role = role

    def forward(self, state: State) -> State:
        if self.role == "vae_in":
            x = state["target"]
        elif self.role == "unet_in":
            alpha = state["alpha"].reshape(-1, 1, 1, 1)
            latent = state["latent"] if "latent" in state else state["x"]  # precomputed, or the VAE's
            x = alpha.sqrt() * latent + (1 - alpha).sqrt() * state["noise"]
        else:
            x = state["x"]
        if self.norm is not None:
            x = F.silu(self.norm(x))
        x = self.conv(x)
        if self.role == "latent":
            # The latent goes on as 'x': a plan that runs each layer alone (ZeRO-3's) hands it on.
            return {**state, "x": x[:, : x.shape[1] // 2] * LATENT_SCALE}
        if self.role == "unet_out":
            noise = state["noise"]
            norm = state.get("loss_norm")  # interleaved sequences: the step's mean images, per row
            if norm is None:
                return {**state, "x": x, "loss": F.mse_loss(x[:, : noise.shape[1]], noise)}
            per_image = F.mse_loss(x[:, : noise.shape[1]], noise, reduction="sum") / math.prod(noise.shape[1:])
            return {**state, "x": x, "loss": per_image / norm.sum().clamp_min(1e-12)}
        if self.role in ("unet_in", "down"):
            return push_skip(state, x)
        return {**state, "x": x}


class ResBlock(nn.Module):
    """GN, SiLU, conv3x3 (+ the timestep embedding's projection), GN, SiLU, conv3x3, plus
    a 1x1 skip conv when the width changes. `scale_shift` (ADM's use_scale_shift_norm):
    the projection emits a scale and a shift applied after the second GN instead of a sum
    before it. `pop`: the up path's block first concatenates the skip its down path left;
    `push`: a down-path block with no attention after it."""

    def __init__(self, c_in: int, c_out: int, emb: int, pop: bool, push: bool, scale_shift: bool = False) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(emb, (2 if scale_shift else 1) * c_out) if emb else None
        self.norm2, self.conv2 = _norm(c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None
        self.pop, self.push, self.scale_shift = pop, push, scale_shift

    def forward(self, state: State) -> State:
        x = state["x"]
        if self.pop:
            skip, state = pop_skip(state)
            x = torch.cat([x, skip], dim=1)
        h = self.conv1(F.silu(self.norm1(x)))
        emb = self.emb(F.silu(state[EMB]))[:, :, None, None] if self.emb is not None else None
        if self.scale_shift and emb is not None:
            scale, shift = emb.chunk(2, dim=1)
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h if emb is None else h + emb)
        h = self.conv2(F.silu(h))
        out = h + (x if self.skip is None else self.skip(x))
        return push_skip(state, out) if self.push else {**state, "x": out}


class SpatialTransformer(nn.Module):
    """SD's Transformer2DModel: GN, proj_in, one block (self-attention, cross-attention to
    the condition in state['memory'], GEGLU), proj_out, residual. `push`: down path."""

    def __init__(self, channels: int, heads: int, context: int, push: bool) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.proj_in = nn.Linear(channels, channels)
        self.block = Block(channels, heads, TP(), causal=False, cross_dim=context, geglu=True)
        self.proj_out = nn.Linear(channels, channels)
        self.push = push

    def forward(self, state: State) -> State:
        x = state["x"]
        b, c, h, w = x.shape
        tokens = self.proj_in(self.norm(x).flatten(2).transpose(1, 2))
        tokens = self.block({"x": tokens, "memory": state[COND]})["x"]
        out = x + self.proj_out(tokens).transpose(1, 2).reshape(b, c, h, w)
        return push_skip(state, out) if self.push else {**state, "x": out}


class SpatialAttention(nn.Module):
    """Self-attention over the pixels, residual (the VAE's mid block, ADM's
    AttentionBlock). `push`: on the down path."""

    def __init__(self, channels: int, heads: int, push: bool = False) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.attn = Attention(channels, heads, TP(), causal=False)
        self.push = push

    def forward(self, state: State) -> State:
        x = state["x"]
        b, c, h, w = x.shape
        y = self.attn(self.norm(x).flatten(2).transpose(1, 2))
        out = x + y.transpose(1, 2).reshape(b, c, h, w)
        return push_skip(state, out) if self.push else {**state, "x": out}


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, state: State) -> State:
        return {**state, "x": self.conv(F.interpolate(state["x"], scale_factor=2.0, mode="nearest"))}


class TimeEmbedding(nn.Module):
    """Sinusoidal features of the timestep (cos first, as SD), Linear, SiLU, Linear."""

    def __init__(self, channels: int, emb: int) -> None:
        super().__init__()
        self.channels = channels
        self.fc1, self.fc2 = nn.Linear(channels, emb), nn.Linear(emb, emb)

    def forward(self, state: State) -> State:
        return {**state, EMB: self.fc2(F.silu(self.fc1(sinusoids(state["timestep"], self.channels))))}


def sinusoids(timestep: torch.Tensor, channels: int) -> torch.Tensor:
    """`channels` sinusoidal features of each timestep, cosines first."""
    half = channels // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    args = timestep.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


def _gemm(layer: LayerSpec, name: str) -> Kernel:
    return next(k for k in layer.kernels if k.name == name)


def generator_layer(layers: tuple[LayerSpec, ...], index: int) -> nn.Module | None:
    """The module of an SD generator's layer `index`, or None if the name is not one of
    SD's (a U-Net of another family)."""
    layer = layers[index]
    name = layer.name
    vae = name.startswith("vae.")
    base = name.removeprefix("vae.")
    nxt = layers[index + 1].name if index + 1 < len(layers) else ""
    if base == "time_embedding":
        fc1 = _gemm(layer, "fc1")
        return TimeEmbedding(fc1.k, fc1.n)
    if base.endswith("_res") or base.startswith("mid.res"):
        conv1 = _gemm(layer, "conv1")
        proj = next((k for k in layer.kernels if k.name == "emb_proj"), None)
        down = base.startswith("down") and not vae
        pop = base.startswith("up") and not vae
        push = down and not nxt.endswith(("_xfmr", "_attn"))
        scale_shift = proj is not None and proj.n == 2 * conv1.n
        return ResBlock(conv1.k // 9, conv1.n, proj.k if proj else 0, pop=pop, push=push, scale_shift=scale_shift)
    if base.endswith("_xfmr") or base == "mid.xfmr":
        heads = _gemm(layer, "attn_scores").batch
        return SpatialTransformer(_gemm(layer, "proj_in").n, heads, _gemm(layer, "xattn_kv").k, push=base.startswith("down"))
    if base == "mid.attn" or base.endswith("_attn"):
        return SpatialAttention(_gemm(layer, "qkv").k, _gemm(layer, "scores").batch, push=base.startswith("down"))
    if base.endswith("upsample"):
        return Upsample(_gemm(layer, "conv").n)
    if base in ("conv_in", "conv_out", "quant_conv") or base.endswith("downsample"):
        conv = _gemm(layer, "conv")
        ksize = 1 if base == "quant_conv" else 3
        norm = any(k.name == "groupnorm" for k in layer.kernels)
        if vae:
            role = {"conv_in": "vae_in", "quant_conv": "latent"}.get(base, "plain")
        else:
            role = {"conv_in": "unet_in", "conv_out": "unet_out"}.get(base, "down")
        return Conv(conv.k // ksize**2, conv.n, ksize, 2 if base.endswith("downsample") else 1, norm, role)
    return None
