"""Stable Diffusion 2.1 (DistTrain's modality generator), per generated image, forward.

Architecture from the published SD-2.1 configuration (diffusers UNet2DConditionModel and
AutoencoderKL), not from DistTrain, which only names the model and its size (1B):
U-Net: block channels (320, 640, 1280, 1280), 2 residual blocks per down level and 3 per
up level, a cross-attention transformer after each residual block of the first three
levels and in the middle, head dim 64, linear proj_in/proj_out, GEGLU feed-forward of
4x width, 1024-wide conditioning, timestep embedding 320 -> 1280, 4 latent channels.
VAE: the image is encoded to a latent of side image/8 by the KL autoencoder's encoder
(channels 128, 256, 512, 512; 2 residual blocks per level; one single-head attention in
the middle) followed by its 1x1 quant conv. The VAE is frozen in SD training; its decoder
is not run during training, so only the encoder is modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from src.models.conv import conv_layer, resblock_layer, spatial_attention_layer, time_embedding_layer, upsample_layer
from src.models.layers import ACT_BYTES, gemm, memory, residual, transformer_layer
from src.models.spec import LayerSpec

UNET_CHANNELS = (320, 640, 1280, 1280)
UNET_ATTENTION_LEVELS = 3  # CrossAttn{Down,Up}Block2D on every level but the deepest
UNET_HEAD_DIM = 64  # SD 2.x: heads = channels / 64 (5, 10, 20, 20)
UNET_TIME_EMBED = 1280
LATENT_CHANNELS = 4
VAE_FACTOR = 8  # latent side = image side / 8
VAE_CHANNELS = (128, 256, 512, 512)
CONTEXT_DIM = 1024  # SD 2.x conditions on OpenCLIP-H text features: 77 x 1024


@dataclass(frozen=True)
class SDShape:
    """The widths of an SD-style generator: SD 2.1's by default; a tiny one keeps the
    structure (levels, blocks, attention placement) and shrinks every width."""

    unet_channels: tuple[int, ...] = UNET_CHANNELS
    head_dim: int = UNET_HEAD_DIM
    time_embed: int = UNET_TIME_EMBED
    context_dim: int = CONTEXT_DIM
    vae_channels: tuple[int, ...] = VAE_CHANNELS


SD21 = SDShape()
SD_TINY = SDShape(unet_channels=(16, 16, 32, 32), head_dim=8, time_embed=32, context_dim=32, vae_channels=(8, 8, 16, 16))


def spatial_transformer_layer(size: int, channels: int, context_tokens: int, name: str, shape: SDShape = SD21) -> LayerSpec:
    """SD's Transformer2DModel: GN, linear proj_in, one block (self-attention,
    cross-attention to the condition, GEGLU MLP), linear proj_out. proj_in/out are
    replicated under TP (they sit outside the Megatron-split block)."""
    pixels = size * size
    block = transformer_layer(
        pixels,
        channels,
        channels // shape.head_dim,
        4 * channels,
        gated=True,
        cross_seq=context_tokens,
        cross_hidden=shape.context_dim,
    )
    return LayerSpec(
        name=name,
        kernels=(memory("groupnorm", pixels * channels, norm=channels), gemm("proj_in", pixels, channels, channels, "none", bias=True))
        + block.kernels
        + (gemm("proj_out", pixels, channels, channels, "none", bias=True), residual("residual", pixels * channels)),
        params=block.params + 2 * channels + 2 * (channels * channels + channels),
        activations=replace(
            block.activations,
            replicated=block.activations.replicated + ACT_BYTES * 3 * pixels * channels,
            checkpoint=ACT_BYTES * pixels * channels,
        ),
        tp_allreduces=block.tp_allreduces,
        tp_comm_elems=block.tp_comm_elems,
        block=True,
    )


def sd_unet_layers(latent: int, context_tokens: int, shape: SDShape = SD21) -> list[LayerSpec]:
    """The SD-2.1 U-Net on a `latent` x `latent` x 4 latent, in execution order."""
    emb = shape.time_embed
    first = shape.unet_channels[0]
    layers = [time_embedding_layer(first, emb), conv_layer(latent, LATENT_CHANNELS, first, name="conv_in")]
    skips = [first]
    ch, size = first, latent
    levels = len(shape.unet_channels)

    for level, out in enumerate(shape.unet_channels):
        for block in range(2):
            layers.append(resblock_layer(size, ch, out, emb, name=f"down{level}.{block}_res"))
            ch = out
            if level < UNET_ATTENTION_LEVELS:
                layers.append(spatial_transformer_layer(size, ch, context_tokens, f"down{level}.{block}_xfmr", shape))
            skips.append(ch)
        if level < levels - 1:
            layers.append(conv_layer(size, ch, ch, stride=2, name=f"down{level}.downsample"))
            size //= 2
            skips.append(ch)

    layers += [
        resblock_layer(size, ch, ch, emb, name="mid.res0"),
        spatial_transformer_layer(size, ch, context_tokens, "mid.xfmr", shape),
        resblock_layer(size, ch, ch, emb, name="mid.res1"),
    ]

    for level in reversed(range(levels)):
        out = shape.unet_channels[level]
        for block in range(3):
            layers.append(resblock_layer(size, ch + skips.pop(), out, emb, name=f"up{level}.{block}_res"))
            ch = out
            if level < UNET_ATTENTION_LEVELS:
                layers.append(spatial_transformer_layer(size, ch, context_tokens, f"up{level}.{block}_xfmr", shape))
        if level:
            layers.append(upsample_layer(size, ch, name=f"up{level}.upsample"))
            size *= 2
    layers.append(conv_layer(size, ch, LATENT_CHANNELS, norm=True, name="conv_out"))
    return layers


def _frozen(layer: LayerSpec) -> LayerSpec:
    """The same layer, frozen and run forward only (it encodes the training image)."""
    return replace(
        layer, name=f"vae.{layer.name}", forward_only=True, kernels=tuple(replace(kern, has_weight=False) for kern in layer.kernels)
    )


def vae_encoder_layers(image: int, shape: SDShape = SD21) -> list[LayerSpec]:
    """The frozen KL-VAE encoder of SD on an `image` x `image` RGB image."""
    first = shape.vae_channels[0]
    layers = [conv_layer(image, 3, first, name="conv_in")]
    ch, size = first, image
    for level, out in enumerate(shape.vae_channels):
        for block in range(2):
            layers.append(resblock_layer(size, ch, out, name=f"down{level}.{block}_res"))
            ch = out
        if level < len(shape.vae_channels) - 1:
            layers.append(conv_layer(size, ch, ch, stride=2, name=f"down{level}.downsample"))
            size //= 2
    layers += [
        resblock_layer(size, ch, ch, name="mid.res0"),
        spatial_attention_layer(size, ch, 1, name="mid.attn"),
        resblock_layer(size, ch, ch, name="mid.res1"),
        # GN + SiLU + conv to mean and log-variance, then the 1x1 quant conv.
        conv_layer(size, ch, 2 * LATENT_CHANNELS, norm=True, name="conv_out"),
        conv_layer(size, 2 * LATENT_CHANNELS, 2 * LATENT_CHANNELS, ksize=1, name="quant_conv"),
    ]
    return [_frozen(layer) for layer in layers]
