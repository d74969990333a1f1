"""DistTrain's multimodal LLMs: MLLM-9B, MLLM-15B, MLLM-72B (DistTrain §8).

Units, in data order: `encoder` (ViT-Huge, 0.63B, + the input projector), `llm` (the
Llama backbone of Table 1), `generator` (the output projector + Stable Diffusion 2.1).

Per-sample conventions (see extras["per_sample"]): the LLM's sample is one 8192-token
interleaved sequence; the encoder's and the generator's sample is that sequence's images,
`images_per_sequence` of them (default 1: one image in, one image out). Their layers are
built for that many images, so every planner prices the same mean work per sequence; how
the count and sizes vary from sequence to sequence (skewed, DistTrain Fig. 5) is the data
module's (src/data/interleaved.py), priced as Work.load; `image_size_spread` states how far
image sides spread around the encoder's nominal side (sigma of log side). Each encoded
image becomes `image_tokens` LLM tokens; each generated image is conditioned on
`cond_tokens` LLM hidden states, mapped by the output projector to SD's 77x1024 condition.

Choices DistTrain leaves open, and ours:
- Table 1 is named "Llama3" but its shapes are Llama 2's (FFN 11008/13824, no GQA below
  70B); the tokenizer is "the Llama tokenizer" (§2.3): we use Llama 2's 32000 tokens.
  RMSNorm, RoPE, SwiGLU, no biases, untied output layer.
- ViT-Huge/14 (google/vit-huge-patch14-224-in21k, the paper's reference [45]): 32 layers,
  1280 hidden, 16 heads, 5120 MLP, 224x224 input = 16x16 patches, matching §2.3 ("each
  image is segmented into 16x16 patches, each patch one image token"). The 512/1024
  resolution of §8 is the generated image's (`image_size`); `encoder_image_size` is a
  separate knob.
- Projectors are LLaVA-1.5-style two-layer GELU MLPs whose inner width is the LLM's:
  input 1280 -> h -> h on the 256 patch tokens (CLS dropped), output h -> h -> 1024.
- SD 2.1 = U-Net + the frozen VAE encoder that makes the training latents (sd21.py);
  `vae_encode: false` models latents precomputed offline. The VAE layers are
  forward_only: no gradient flows through them.
- `train_projectors: true` keeps the projectors training when their unit is in
  `model.frozen` (DistTrain §8.3's frozen settings: "We keep training the projectors"):
  the unit's other layers are frozen layer by layer instead of the whole unit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from src.errors import ConfigError
from src.models.blocks import DecoderPreset, decoder_unit, mlp_projector, scaled_per_images, vit_layers
from src.models.options import Options, divisible
from src.models.sd21 import SD21, SD_TINY, VAE_FACTOR, SDShape, sd_unet_layers, vae_encoder_layers
from src.models.spec import PER_IMAGE, Architecture, ModelSpec, UnitSpec

LLAMA_VOCAB = 32000
MLLM_SEQ_LEN = 8192

# DistTrain Table 1: layers, hidden, heads, FFN, KV groups.
LLMS: dict[str, DecoderPreset] = {
    "mllm_9b": DecoderPreset(32, 4096, 32, LLAMA_VOCAB, "llama", ffn=11008, kv_heads=32),  # Llama3-7B
    "mllm_15b": DecoderPreset(40, 5120, 40, LLAMA_VOCAB, "llama", ffn=13824, kv_heads=40),  # Llama3-13B
    "mllm_72b": DecoderPreset(80, 8192, 64, LLAMA_VOCAB, "llama", ffn=28672, kv_heads=8),  # Llama3-70B
}
# Generated image side (DistTrain §8: 1024x1024 for MLLM-72B, 512x512 for the others).
IMAGE_SIZE = {"mllm_9b": 512, "mllm_15b": 512, "mllm_72b": 1024}
# DistTrain §8's microbenchmarks (up to 98 GPUs): batch 128 / 64 / 40.
DEFAULT_BATCH = {"mllm_9b": 128, "mllm_15b": 64, "mllm_72b": 40}

VIT_HUGE = {"layers": 32, "hidden": 1280, "heads": 16}
ENCODER_IMAGE_SIZE = 224
PATCH_SIZE = 14
COND_TOKENS = 77
# The latent is image/8 and the U-Net halves it three times.
IMAGE_MULTIPLE = VAE_FACTOR * 2 ** (len(SD21.unet_channels) - 1)
SCALES = ("paper", "tiny")
# Sigma of log(image side) of the interleaved data's images (src/data/interleaved.py):
# sides of 64 to 1024 tokens around ViT-Huge's 256 (DistTrain Fig. 5(b)). The sampler clips
# sides to half and twice the nominal (log side within +-ln 2): at sigma 1 about half the
# draws (P(|Z| > 0.69) = 0.49) already land on a clip bound, beyond it the spread is two
# spikes at the bounds rather than a spread.
IMAGE_SIZE_SPREAD = 0.3
MAX_IMAGE_SIZE_SPREAD = 1.0


def image_size_spread(opts: Options) -> float:
    """model.image_size_spread: how far interleaved data's image sides spread (its sampler's
    sigma), for every model whose sequences hold images of drawn sizes."""
    return opts.number(
        "image_size_spread",
        IMAGE_SIZE_SPREAD,
        0.0,
        MAX_IMAGE_SIZE_SPREAD,
        " (sigma of log image side; sides are clipped to half and twice the nominal, so beyond 1 most land on a bound)",
    )


@dataclass(frozen=True)
class Scale:
    """Every width of one scale of an MLLM; `tiny` keeps the paper's structure (Llama style,
    GQA where the paper's LLM has it, ViT, SD's U-Net levels) at a few MB for CPU runs."""

    llm: DecoderPreset
    vit: dict
    encoder_image: int
    patch: int
    image: int
    cond_tokens: int
    seq_len: int
    batch: int
    sd: SDShape


def _paper(model: str) -> Scale:
    return Scale(
        LLMS[model], VIT_HUGE, ENCODER_IMAGE_SIZE, PATCH_SIZE, IMAGE_SIZE[model], COND_TOKENS, MLLM_SEQ_LEN, DEFAULT_BATCH[model], SD21
    )


# Tiny: 2-4 Llama layers of width 64 (MLLM-72B's keeps grouped-query attention), a 2-layer
# ViT on 32px images (16 image tokens), SD's U-Net and VAE at 1/20 of their widths on 64px.
TINY_LLMS = {
    "mllm_9b": DecoderPreset(2, 64, 4, 256, "llama", ffn=160, kv_heads=4),
    "mllm_15b": DecoderPreset(3, 64, 4, 256, "llama", ffn=160, kv_heads=4),
    "mllm_72b": DecoderPreset(4, 64, 4, 256, "llama", ffn=224, kv_heads=2),
}


def _tiny(model: str) -> Scale:
    return Scale(TINY_LLMS[model], {"layers": 2, "hidden": 64, "heads": 4}, 32, 8, 64, 4, 64, 8, SD_TINY)


PROJECTORS = {"encoder": ("input_projector",), "generator": ("output_projector",)}


def build_mllm(model: str, opts: Options, seq_len: int | None) -> ModelSpec:
    scale_name = opts.choice("scale", SCALES, "paper")
    preset = _tiny(model) if scale_name == "tiny" else _paper(model)
    llm_preset, vit, sd = preset.llm, preset.vit, preset.sd
    hidden = llm_preset.hidden
    image = opts.positive_int("image_size", preset.image)
    encoder_image = opts.positive_int("encoder_image_size", preset.encoder_image)
    patch = opts.positive_int("patch_size", preset.patch)
    cond_tokens = opts.positive_int("cond_tokens", preset.cond_tokens)
    vae_encode = opts.flag("vae_encode", True)
    images = opts.positive_int("images_per_sequence", 1)
    spread = image_size_spread(opts)
    train_projectors = opts.flag("train_projectors", False)
    divisible(opts, "encoder_image_size", encoder_image, "model.patch_size", patch)
    divisible(opts, "image_size", image, "the VAE and U-Net downsampling", IMAGE_MULTIPLE)
    seq = preset.seq_len if seq_len is None else seq_len

    image_tokens = (encoder_image // patch) ** 2
    if images * image_tokens >= seq:
        # The images are tokens of the LLM's sequence: beyond it, the encoder and generator
        # would be priced for images the sequence cannot hold (and the sampler trims them).
        raise ConfigError(
            f"{opts.key('images_per_sequence')}={images}: {images} images of {image_tokens} tokens "
            f"({images * image_tokens}) exceed what the LLM's {seq}-token sequence holds (at most "
            f"{(seq - 1) // image_tokens} with a text token after them)"
        )
    scale = partial(scaled_per_images, images=images)
    encoder = UnitSpec(
        name="encoder",
        layers=scale(
            vit_layers(encoder_image, patch, **vit) + [mlp_projector(image_tokens, vit["hidden"], hidden, hidden, "input_projector")]
        ),
        hidden=vit["hidden"],
        heads=vit["heads"],
        seq_len=images * (image_tokens + 1),
        output_elems=images * image_tokens * hidden,
        arch=Architecture(image_size=encoder_image, patch_size=patch, images=images),
    )
    llm = decoder_unit(llm_preset, seq, output_elems=images * cond_tokens * hidden)
    llm = replace(llm, arch=replace(llm.arch, images=images, image_tokens=images * image_tokens))
    vae = vae_encoder_layers(image, sd) if vae_encode else []
    latent = image // VAE_FACTOR
    generator = UnitSpec(
        name="generator",
        layers=scale(
            [mlp_projector(cond_tokens, hidden, hidden, sd.context_dim, "output_projector")]
            + vae
            + sd_unet_layers(latent, cond_tokens, sd)
        ),
        hidden=sd.unet_channels[0],
        heads=sd.unet_channels[0] // sd.head_dim,
        seq_len=images * latent * latent,
        output_elems=0,
        kind="unet",
        arch=Architecture(image_size=image, latent_size=latent, images=images),
    )
    return ModelSpec(
        name=model,
        units=(encoder, llm, generator),
        default_global_batch=preset.batch,
        flows=(("encoder", "llm"), ("llm", "generator")),
        description=f"{model} ({scale_name}): ViT-{vit['layers']}x{vit['hidden']}/{patch} at {encoder_image}px "
        f"+ Llama {llm_preset.layers}x{hidden} "
        f"on {seq} tokens + SD-2.1 at {image}px, {images} image(s) per sequence",
        extras={
            "per_sample": {"encoder": PER_IMAGE, "llm": "sequence", "generator": PER_IMAGE},
            "scale": scale_name,
            "images_per_sequence": images,
            "image_size_spread": spread,
            # The data an MLLM's sequences can hold (train.data), the default first: DistTrain's
            # LAION-like interleaved sequences (§2.3, Fig. 5), or every sequence alike.
            "data": ("interleaved", "uniform"),
            "image_tokens": image_tokens,
            "cond_tokens": cond_tokens,
            # model.frozen freezes these units layer by layer, keeping the projectors trained.
            "trained_when_frozen": PROJECTORS if train_projectors else {},
        },
    )


MLLM_BUILDERS = {model: partial(build_mllm, model) for model in LLMS}
