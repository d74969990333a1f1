"""Par4D's U-Nets (Table II): Nichol & Dhariwal's improved-DDPM U-Net ("ADM") on 32x32.

Par4D parallelised Nichol et al.'s sequential implementation with "four levels, three
residual blocks per level, 32x32 images, batch 2048". The knobs we take from Nichol's
published CIFAR-10 configuration (improved-diffusion: channel_mult (1,2,2,2) for 32x32,
attention at 16x16 and 8x8, 4 heads, use_scale_shift_norm, learn_sigma = 6 output
channels). With 128 base channels that is Par4D's "50M parameter U-Net on CIFAR-10"
(52.5M here), which pins the architecture; Table II then only varies the base channels.

Table II's sizes (250M, 500M, 1B, 2B, 4B) are the nominal names of a weak-scaling series
that doubles with the GPU count: this architecture gives 0.21, 0.55, 0.84, 1.89 and 3.36B
at 256/416/512/768/1024 channels. We keep the architecture and report the gap
(tests/models/test_models.py), rather than invent a channel multiplier to hit the names.

The batch of 2048 images is a training setting (train.global_batch), not a model knob.
"""

from __future__ import annotations

from src.bounds import MAX_LAYERS, check_count
from src.errors import ConfigError
from src.models.conv import GROUPNORM_GROUPS, conv_layer, resblock_layer, spatial_attention_layer, time_embedding_layer, upsample_layer
from src.models.options import Options, divisible, no_seq_len
from src.models.spec import Architecture, LayerSpec, ModelSpec, UnitSpec

# Base channels per preset: Par4D Table II, plus the 50M CIFAR-10 validation model (§V-A).
UNET_CHANNELS: dict[str, int] = {
    "unet_50m": 128,
    "unet_250m": 256,
    "unet_500m": 416,
    "unet_1b": 512,
    "unet_2b": 768,
    "unet_4b": 1024,
}
DEFAULT_PRESET = "unet_1b"
IN_CHANNELS = 3
OUT_CHANNELS = 6  # learn_sigma: the noise and the variance interpolation, 3 channels each


def unet_layers(image: int, channels: int, mult: list[int], res_blocks: int, attention_res: set[int], heads: int) -> list[LayerSpec]:
    """The ADM U-Net as a layer list in execution order (encoder, middle, decoder);
    skip connections enter the decoder's residual blocks as extra input channels. The
    timestep embedding follows the stem, so the feature map crosses every layer boundary."""
    emb = 4 * channels
    layers = [conv_layer(image, IN_CHANNELS, channels, name="conv_in"), time_embedding_layer(channels, emb)]
    skips = [channels]
    ch, size = channels, image

    def res(c_in: int, c_out: int, tag: str) -> None:
        layers.append(resblock_layer(size, c_in, c_out, emb, scale_shift=True, name=f"{tag}_res"))
        if size in attention_res:
            layers.append(spatial_attention_layer(size, c_out, heads, name=f"{tag}_attn"))

    for level, factor in enumerate(mult):
        for block in range(res_blocks):
            res(ch, factor * channels, f"down{level}.{block}")
            ch = factor * channels
            skips.append(ch)
        if level < len(mult) - 1:
            layers.append(conv_layer(size, ch, ch, stride=2, name=f"down{level}.downsample"))
            size //= 2
            skips.append(ch)

    layers.append(resblock_layer(size, ch, ch, emb, scale_shift=True, name="mid.res0"))
    layers.append(spatial_attention_layer(size, ch, heads, name="mid.attn"))
    layers.append(resblock_layer(size, ch, ch, emb, scale_shift=True, name="mid.res1"))

    for level in reversed(range(len(mult))):
        for block in range(res_blocks + 1):
            res(ch + skips.pop(), mult[level] * channels, f"up{level}.{block}")
            ch = mult[level] * channels
        if level:
            layers.append(upsample_layer(size, ch, name=f"up{level}.upsample"))
            size *= 2
    layers.append(conv_layer(size, ch, OUT_CHANNELS, norm=True, name="conv_out"))
    return layers


def build_unet(opts: Options, seq_len: int | None) -> ModelSpec:
    no_seq_len("unet", seq_len, "model.image_size")
    preset = opts.preset("preset", UNET_CHANNELS, DEFAULT_PRESET)
    channels = opts.positive_int("channels", None if preset is None else UNET_CHANNELS[preset])
    image = opts.positive_int("image_size", 32)
    res_blocks = opts.positive_int("res_blocks", 3, MAX_LAYERS)
    heads = opts.positive_int("heads", 4)
    mult = opts.raw("channel_mult", [1, 2, 2, 2])
    attention_res = opts.raw("attention_resolutions", [16, 8])
    for key, values in (("channel_mult", mult), ("attention_resolutions", attention_res)):
        if (
            isinstance(values, (str, int))
            or not values
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
        ):
            raise ConfigError(f"{opts.key(key)}={values!r} must be a non-empty list of positive integers")
        for value in values:
            check_count(opts.key(key), value)
    divisible(opts, "channels", channels, "GroupNorm groups", GROUPNORM_GROUPS)
    divisible(opts, "image_size", image, "2^(levels-1) of model.channel_mult", 2 ** (len(mult) - 1))
    # Attention uses `heads` heads at every width (a multiple of the base channels).
    divisible(opts, "channels", channels, "model.heads", heads)

    layers = unet_layers(image, channels, list(mult), res_blocks, set(attention_res), heads)
    unit = UnitSpec(
        name="unet",
        layers=tuple(layers),
        hidden=channels,
        heads=heads,
        seq_len=image * image,
        output_elems=0,
        kind="unet",
        arch=Architecture(image_size=image),
    )
    return ModelSpec(
        name="unet",
        units=(unit,),
        default_global_batch=2048,  # Par4D Table II: batch 2048
        description=f"Par4D U-Net ({preset or 'custom'}): {channels} base channels, "
        f"mult {tuple(mult)}, {res_blocks} res blocks/level, {image}x{image} images",
        extras={"preset": preset},
    )
