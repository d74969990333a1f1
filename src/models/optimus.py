"""Optimus's MLLMs: one or two ViT encoders feeding an LLM backbone (Optimus Appendix A).

Units: `encoder` (or `encoder0`, `encoder1` with two encoders) and `llm`; every encoder
flows into the LLM. Encoders are ViTs of Table 8 with a two-layer GELU MLP projector to
the LLM width as their last layer (Optimus does not describe its projector; the same
LLaVA-1.5-style projector as mllm.py). LLMs are Table 9's, on 2048-token sequences
("In all experiments, we use sequence length 2048").

Optimus does not give the image resolution: we use ViT-22B's own (224x224, patch 14:
256 patch tokens + CLS), and one image per sequence (`images_per_sample`): every encoder
reads each of a sequence's images (its layers run on all of them at once, as mllm.py's
per-image units do), and their tokens are the first of the LLM's sequence.

The data (train.data) is uniform by default: every sequence holds `images_per_sample` images
at the nominal side, as the paper's experiments are priced. It can be interleaved, the
MLLMs' LAION-like sequences (src/data/interleaved.py): images_per_sample images a sequence
on average, their sides spread by `image_size_spread`, each read by every encoder, so that
an encoder's load differs from sequence to sequence (by its own FLOPs per token and per
token squared) while the LLM's 2048 tokens do not.

`model.scale=tiny` keeps this structure (ViT blocks + the projector as the encoder's last
layer, a GPT- or Llama-style LLM) at a few hundred KB for CPU runs of the real backend:
every encoder a 2-layer ViT of width 64 on 32px images (patch 8: 16 image tokens), every
LLM 4 layers of width 64 (four pipeline stages on four CPU workers) with a 128-token
vocabulary, on 64-token sequences.

Naming: Table 8 calls the 4096-wide ViT "ViT-10B" while §5 and Tables 3/6 call it
"ViT-11B"; the key is `vit_11b` (what the experiments use), its size is Table 8's 10B.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from src.errors import ConfigError
from src.models.blocks import DecoderPreset, decoder_unit, mlp_projector, scaled_per_images, vit_layers
from src.models.gpt import GPT_PRESETS, GPT_VOCAB
from src.models.mllm import image_size_spread
from src.models.options import Options, divisible
from src.models.spec import PER_IMAGE, Architecture, ModelSpec, UnitSpec


# Table 8: width, depth, MLP dimension, heads (head dim 128).
ENCODERS: dict[str, dict[str, int]] = {
    "vit_3b": {"hidden": 2304, "layers": 48, "ffn": 9216, "heads": 18},
    "vit_5b": {"hidden": 3072, "layers": 48, "ffn": 12288, "heads": 24},
    "vit_11b": {"hidden": 4096, "layers": 48, "ffn": 16384, "heads": 32},
    "vit_22b": {"hidden": 6144, "layers": 48, "ffn": 24576, "heads": 48},
}
# Table 9: width, depth, heads (head dim 128). GPT-11B is a Megatron GPT like gpt.py's;
# Table 9 gives LLAMA-70B only width/depth/heads: FFN 28672, 8 KV groups and the 32000
# vocabulary are Llama 2 70B's (Touvron et al. 2023), the same as DistTrain Table 1's 70B.
LLMS: dict[str, DecoderPreset] = {
    "gpt_11b": DecoderPreset(80, 3072, 24, GPT_VOCAB),
    "llama_70b": DecoderPreset(80, 8192, 64, 32000, "llama", ffn=28672, kv_heads=8),
    "gpt_175b": GPT_PRESETS["gpt_175b"],
}
OPTIMUS_SEQ_LEN = 2048
IMAGE_SIZE = 224
PATCH_SIZE = 14
MAX_ENCODERS = 2  # Optimus evaluates single- and dual-encoder MLLMs (Table 6)
SCALES = ("paper", "tiny")


@dataclass(frozen=True)
class Scale:
    """Every size of one scale; `tiny` keeps the paper's structure at a few hundred KB."""

    encoders: dict[str, dict[str, int]]
    llms: dict[str, DecoderPreset]
    image: int
    patch: int
    seq_len: int
    batch: int


PAPER = Scale(ENCODERS, LLMS, IMAGE_SIZE, PATCH_SIZE, OPTIMUS_SEQ_LEN, 1536)  # Table 5's strong-scaling batch
TINY_VIT = {"hidden": 64, "layers": 2, "ffn": 256, "heads": 4}
TINY = Scale(
    {name: TINY_VIT for name in ENCODERS},
    {
        "gpt_11b": DecoderPreset(4, 64, 4, 128),
        "llama_70b": DecoderPreset(4, 64, 4, 128, "llama", ffn=160, kv_heads=2),
        "gpt_175b": DecoderPreset(4, 64, 4, 128),
    },
    32,
    8,
    64,
    8,
)


def build_optimus(opts: Options, seq_len: int | None) -> ModelSpec:
    scale_name = opts.choice("scale", SCALES, "paper")
    scale = TINY if scale_name == "tiny" else PAPER
    names = opts.names("encoders", ["vit_22b"]) or []
    if not 1 <= len(names) <= MAX_ENCODERS:
        raise ConfigError(f"model.encoders={names} must name 1 to {MAX_ENCODERS} encoders from: {', '.join(ENCODERS)}")
    for name in names:
        if name not in ENCODERS:
            raise ConfigError(f"model.encoders contains {name!r}, not one of: {', '.join(ENCODERS)}")
    llm_name = opts.choice("llm", LLMS, "gpt_175b")
    llm_preset = scale.llms[llm_name]
    image = opts.positive_int("image_size", scale.image)
    patch = opts.positive_int("patch_size", scale.patch)
    images_per_sample = opts.positive_int("images_per_sample", 1)
    spread = image_size_spread(opts)
    divisible(opts, "image_size", image, "model.patch_size", patch)
    seq = scale.seq_len if seq_len is None else seq_len

    image_tokens = (image // patch) ** 2
    if len(names) * images_per_sample * image_tokens > seq:
        raise ConfigError(
            f"{len(names)} encoder(s) x {images_per_sample} image(s) x {image_tokens} image tokens do not fit the "
            f"LLM's {seq}-token sequence (model.image_size, model.patch_size or train.seq_len)"
        )
    unit_names = ["encoder"] if len(names) == 1 else [f"encoder{i}" for i in range(len(names))]
    encoders = []
    for unit_name, name in zip(unit_names, names):
        vit = scale.encoders[name]
        layers = vit_layers(image, patch, vit["layers"], vit["hidden"], vit["heads"], vit["ffn"])
        layers.append(mlp_projector(image_tokens, vit["hidden"], llm_preset.hidden, llm_preset.hidden, "input_projector"))
        encoders.append(
            UnitSpec(
                name=unit_name,
                layers=scaled_per_images(layers, images_per_sample),
                hidden=vit["hidden"],
                heads=vit["heads"],
                seq_len=images_per_sample * (image_tokens + 1),
                output_elems=images_per_sample * image_tokens * llm_preset.hidden,
                arch=Architecture(image_size=image, patch_size=patch, images=images_per_sample),
            )
        )
    llm = decoder_unit(llm_preset, seq, output_elems=0, dropout=opts.optional_flag("dropout"))
    tokens = len(names) * images_per_sample * image_tokens  # every encoder's tokens of every image, first in the sequence
    llm = replace(llm, arch=replace(llm.arch, images=images_per_sample, image_tokens=tokens))
    return ModelSpec(
        name="optimus",
        units=(*encoders, llm),
        default_global_batch=scale.batch,
        flows=tuple((unit_name, "llm") for unit_name in unit_names),
        description=f"Optimus MLLM ({scale_name}): {' + '.join(names)} at {image}px/{patch} -> {llm_name} on {seq} tokens",
        extras={
            "scale": scale_name,
            "encoders": dict(zip(unit_names, names)),
            "image_tokens": image_tokens,
            "per_sample": {**{unit_name: PER_IMAGE for unit_name in unit_names}, "llm": "sequence"},
            # What the sequences can hold (train.data), the default first; interleaved data's
            # sampler reads the mean and the spread (every encoder reads each image).
            "data": ("uniform", "interleaved"),
            "images_per_sequence": images_per_sample,  # model.images_per_sample: the mean interleaved data draws around
            "image_size_spread": spread,
        },
    )
