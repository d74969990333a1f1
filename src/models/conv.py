"""Convolutional layers (U-Nets, VAE), counted per image, forward.

A convolution is priced as an implicit GEMM: m = output pixels, k = C_in·kh·kw,
n = C_out. Tensor parallelism splits a convolution like a linear layer over its weight
matrix, as Par4D/AxoNN parallelise it: over its output channels (tp_split 'n'), except a
residual block's second conv, which reads the first's channel split (row-parallel, 'k',
as Megatron-LM pairs a column- and a row-parallel GEMM; on Par4D's grid the pair
alternates orientation, so a block leaves its output on its input's layout). Its 1x1 skip
conv reads the block's input (Kernel.skip_projection). With 1D TP each conv of a layer
still counts one TP collective of its output size in `tp_allreduces`, its output
re-assembled before the next kernel (an upper bound for a paired block, whose row-parallel
conv needs the only all-reduce and whose skip an all-gather of half those bytes; LayerSpec
has only the all-reduce count), and the kernels between the convs run on whole channels.

Activations (16-bit): a layer keeps its input (`replicated`: whole on every TP rank) and
the tensors its backward needs inside it (`split`: channel-split by TP); attention keeps
its score and softmax tensors (`attention`, 2+2 bytes per score, no dropout).
"""

from __future__ import annotations

from dataclasses import replace

from src.models.layers import ACT_BYTES, gemm, memory, residual
from src.models.spec import ActivationBytes, Kernel, LayerSpec, TPSplit

GROUPNORM_GROUPS = 32  # every U-Net here (ADM, SD, its VAE) uses GroupNorm(32)


def conv_gemm(name: str, size_out: int, c_in: int, c_out: int, ksize: int, split: TPSplit = "n") -> Kernel:
    return gemm(name, size_out * size_out, c_in * ksize * ksize, c_out, split, bias=True)


def conv_params(c_in: int, c_out: int, ksize: int) -> int:
    return c_in * c_out * ksize * ksize + c_out


def conv_layer(
    size: int, c_in: int, c_out: int, *, ksize: int = 3, stride: int = 1, norm: bool = False, name: str = "conv"
) -> LayerSpec:
    """A lone convolution (stem, stride-2 downsample, output conv), with an optional
    GroupNorm + SiLU before it. `size` is the input side in pixels."""
    size_out = size // stride
    pixels = size * size
    kernels = [memory("groupnorm", pixels * c_in, norm=c_in), memory("silu", pixels * c_in)] if norm else []
    kernels.append(conv_gemm("conv", size_out, c_in, c_out, ksize))
    kept = (3 if norm else 1) * pixels * c_in
    return LayerSpec(
        name=name,
        kernels=tuple(kernels),
        params=conv_params(c_in, c_out, ksize) + (2 * c_in if norm else 0),
        activations=ActivationBytes(replicated=ACT_BYTES * kept, checkpoint=ACT_BYTES * pixels * c_in),
        tp_allreduces=1,
        tp_comm_elems=size_out * size_out * c_out,
    )


def upsample_layer(size: int, channels: int, name: str = "upsample") -> LayerSpec:
    """Nearest-neighbour 2x upsampling then a 3x3 conv at the new resolution."""
    size_out = 2 * size
    pixels_out = size_out * size_out
    return LayerSpec(
        name=name,
        kernels=(memory("nearest", pixels_out * channels), conv_gemm("conv", size_out, channels, channels, 3)),
        params=conv_params(channels, channels, 3),
        activations=ActivationBytes(replicated=ACT_BYTES * pixels_out * channels, checkpoint=ACT_BYTES * size * size * channels),
        tp_allreduces=1,
        tp_comm_elems=pixels_out * channels,
    )


def resblock_layer(
    size: int, c_in: int, c_out: int, emb_dim: int = 0, *, scale_shift: bool = False, name: str = "resblock"
) -> LayerSpec:
    """A residual block: GN, SiLU, conv3x3, (+ timestep-embedding projection), GN, SiLU,
    conv3x3, plus a 1x1 skip conv when the channel count changes.

    emb_dim: width of the timestep embedding (0 = none, as in the VAE). scale_shift: the
    projection emits a scale and a shift (ADM's use_scale_shift_norm), i.e. 2·c_out.
    """
    pixels = size * size
    emb_out = (2 if scale_shift else 1) * c_out if emb_dim else 0
    kernels = [
        memory("groupnorm1", pixels * c_in, norm=c_in),
        memory("silu1", pixels * c_in),
        conv_gemm("conv1", size, c_in, c_out, 3),
    ]
    if emb_dim:
        kernels.append(replace(gemm("emb_proj", 1, emb_dim, emb_out, "n", bias=True), reads_embedding=True))
    kernels += [
        memory("groupnorm2", pixels * c_out, norm=c_out),
        memory("silu2", pixels * c_out),
        conv_gemm("conv2", size, c_out, c_out, 3, "k"),
    ]
    params = 2 * c_in + conv_params(c_in, c_out, 3) + 2 * c_out + conv_params(c_out, c_out, 3)
    params += emb_dim * emb_out + emb_out
    if c_in != c_out:
        kernels.append(replace(conv_gemm("skip", size, c_in, c_out, 1), skip_projection=True))
        params += conv_params(c_in, c_out, 1)
    kernels.append(residual("residual", pixels * c_out))
    convs = sum(1 for kern in kernels if kern.kind == "gemm" and kern.name != "emb_proj")
    return LayerSpec(
        name=name,
        kernels=tuple(kernels),
        params=params,
        activations=ActivationBytes(
            replicated=ACT_BYTES * 3 * pixels * c_in, split=ACT_BYTES * 3 * pixels * c_out, checkpoint=ACT_BYTES * pixels * c_in
        ),
        tp_allreduces=convs,
        tp_comm_elems=pixels * c_out,
        block=True,
    )


def spatial_attention_layer(size: int, channels: int, heads: int, name: str = "attention") -> LayerSpec:
    """Self-attention over the pixels of a feature map (ADM's AttentionBlock, the VAE's
    mid-block attention): GN, qkv (1x1 conv), softmax(QK^T)V per head, output 1x1 conv.
    TP as in a transformer: qkv column-parallel (heads), output row-parallel."""
    pixels = size * size
    head_dim = channels // heads
    return LayerSpec(
        name=name,
        kernels=(
            memory("groupnorm", pixels * channels, norm=channels),
            gemm("qkv", pixels, channels, 3 * channels, "n", bias=True),
            gemm("scores", pixels, head_dim, pixels, "batch", weight=False, batch=heads),
            memory("softmax", heads * pixels * pixels, "batch"),
            gemm("context", pixels, pixels, head_dim, "batch", weight=False, batch=heads),
            gemm("proj", pixels, channels, channels, "k", bias=True),
            residual("residual", pixels * channels),
        ),
        params=2 * channels + conv_params(channels, 3 * channels, 1) + conv_params(channels, channels, 1),
        activations=ActivationBytes(
            replicated=ACT_BYTES * 2 * pixels * channels,
            split=ACT_BYTES * 4 * pixels * channels,
            attention=4 * heads * pixels * pixels,
            checkpoint=ACT_BYTES * pixels * channels,
        ),
        tp_allreduces=1,
        tp_comm_elems=pixels * channels,
        block=True,
    )


def time_embedding_layer(channels: int, emb_dim: int, name: str = "time_embedding") -> LayerSpec:
    """Sinusoidal timestep features of width `channels` -> Linear -> SiLU -> Linear to
    `emb_dim`; one row per image, replicated on every TP rank (it is tiny)."""
    return LayerSpec(
        name=name,
        kernels=(
            gemm("fc1", 1, channels, emb_dim, "none", bias=True),
            memory("silu", emb_dim),
            gemm("fc2", 1, emb_dim, emb_dim, "none", bias=True),
        ),
        params=channels * emb_dim + emb_dim + emb_dim * emb_dim + emb_dim,
        activations=ActivationBytes(replicated=ACT_BYTES * (channels + 2 * emb_dim), checkpoint=ACT_BYTES * channels),
    )
