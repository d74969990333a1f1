"""DistMM's two-tower models: CLIP, CoCa and LiT at the scales of DistMM Table 2.

Units: `vision` (a ViT), `text` (a transformer), `interaction` (the contrastive loss over
the contrastive batch). Each tower ends with the projection of its pooled token (CLS for
vision, EOS for text) to the embedding it hands to the interaction.

Table 2 gives layers and hidden sizes per tower. Its parameter counts are GPT-3's model
sizes (Brown et al. 2020, Table 2.1: 350M = 24x1024, 760M = 24x1536, 2.7B = 32x2560,
6.7B = 32x4096, 13B = 40x5140), i.e. 12·L·h² plus GPT-3's 50257-token and 2048-position
embeddings, even for vision towers, which have no token embedding. A ViT with those
layers is therefore smaller than its label (760M -> 0.68B); the tests compare the paper
with the part it counted. Table 2's "5140" (GPT-3's 13B width) is divisible by no
sensible head count (5140 = 4·5·257): we use 5120.

Inputs follow DistMM §7: 336x336 images with patch 14 (CLIP ViT-L/14@336: 576 patches
+ CLS), 77-token text, CLIP's 49408-token BPE vocabulary. Heads: head dim 128 at 4096
hidden (GPT-3 6.7B's 32 heads), 64 otherwise, so 5120-wide towers have 80 heads: DistMM
§7.1 runs CoCa(13B,13B) with TP 16, which needs a head count divisible by 16 (GPT-3 13B's
40 heads are not).
The contrastive embedding defaults to the text tower's width (CLIP's convention, e.g.
RN50x64 1024/1024, ViT-L/14 768/768).
"""

from __future__ import annotations

from dataclasses import dataclass

from src.bounds import MAX_LAYERS
from src.errors import ConfigError
from src.models.blocks import feature_head, text_layers, vit_layers
from src.models.layers import contrastive_layer, embedding_layer, head_layer, transformer_layer
from src.models.options import Options, divisible, no_seq_len
from src.models.spec import Architecture, ModelSpec, UnitSpec

SCALES = ("single_device", "single_node", "multi_node", "tiny")


@dataclass(frozen=True)
class Tower:
    layers: int
    hidden: int


# (vision, text) per scale: DistMM Table 2, hidden 5140 read as 5120 (see above). `tiny` is
# ours: the same structure at a few MB, for CPU runs and tests.
TOWERS: dict[str, dict[str, tuple[Tower, Tower]]] = {
    "clip": {
        "single_device": (Tower(24, 1536), Tower(24, 1024)),  # 760M, 350M
        "single_node": (Tower(32, 4096), Tower(32, 2560)),  # 6.7B, 2.7B
        "multi_node": (Tower(40, 5120), Tower(32, 4096)),  # 13B, 6.7B
        "tiny": (Tower(2, 64), Tower(2, 64)),
    },
    "coca": {
        "single_device": (Tower(24, 1536), Tower(24, 1536)),  # 760M, 760M
        "single_node": (Tower(32, 4096), Tower(32, 4096)),  # 6.7B, 6.7B
        "multi_node": (Tower(40, 5120), Tower(40, 5120)),  # 13B, 13B
        "tiny": (Tower(2, 64), Tower(2, 64)),
    },
    "lit": {
        "single_device": (Tower(24, 1024), Tower(24, 1536)),  # 350M, 760M
        "single_node": (Tower(32, 2560), Tower(32, 4096)),  # 2.7B, 6.7B
        "multi_node": (Tower(32, 4096), Tower(40, 5120)),  # 6.7B, 13B
        "tiny": (Tower(2, 64), Tower(2, 64)),
    },
}


# The global batch per scale when train.global_batch is null. DistMM states no global batch:
# at single-device scale its Megatron-LM baseline runs 8 samples per GPU (§7.2.2: "the text
# submodule's batch size is increased from 8 to 150"), 512 on its 64 GPUs; at the larger
# scales, the most Megatron-LM fits for CoCa (sweeps/distmm_fig7_end_to_end.yaml's notes).
DEFAULT_BATCH = {"single_device": 512, "single_node": 192, "multi_node": 48, "tiny": 16}


@dataclass(frozen=True)
class Inputs:
    image_size: int
    patch_size: int
    text_len: int
    vocab: int


PAPER_INPUTS = Inputs(image_size=336, patch_size=14, text_len=77, vocab=49408)
TINY_INPUTS = Inputs(image_size=32, patch_size=8, text_len=16, vocab=512)
TINY_HEADS = 4


def default_heads(hidden: int) -> int:
    """Head dim 128 at 4096 hidden, 64 otherwise (see the module docstring)."""
    return hidden // (128 if hidden == 4096 else 64)


def _tower(opts: Options, preset: Tower, tiny: bool) -> tuple[int, int, int]:
    """(layers, hidden, heads) of one tower: the preset unless model.<tower>.* overrides."""
    layers = opts.positive_int("layers", preset.layers, MAX_LAYERS)
    hidden = opts.positive_int("hidden", preset.hidden)
    heads = opts.positive_int("heads", TINY_HEADS if tiny else default_heads(hidden))
    divisible(opts, "hidden", hidden, opts.key("heads"), heads)
    return layers, hidden, heads


def _build(family: str, opts: Options, seq_len: int | None) -> ModelSpec:
    no_seq_len(family, seq_len, "model.text_len")
    scale = opts.choice("scale", SCALES, "single_device")
    tiny = scale == "tiny"
    base = TINY_INPUTS if tiny else PAPER_INPUTS
    image = opts.positive_int("image_size", base.image_size)
    patch = opts.positive_int("patch_size", base.patch_size)
    text_len = opts.positive_int("text_len", base.text_len)
    vocab = opts.positive_int("vocab", base.vocab)
    divisible(opts, "image_size", image, "model.patch_size", patch)
    vision_preset, text_preset = TOWERS[family][scale]
    v_layers, v_hidden, v_heads = _tower(opts.sub("vision"), vision_preset, tiny)
    t_layers, t_hidden, t_heads = _tower(opts.sub("text"), text_preset, tiny)
    embed_dim = opts.positive_int("embed_dim", t_hidden)

    vision = UnitSpec(
        name="vision",
        layers=tuple(vit_layers(image, patch, v_layers, v_hidden, v_heads) + [feature_head(v_hidden, embed_dim)]),
        hidden=v_hidden,
        heads=v_heads,
        seq_len=(image // patch) ** 2 + 1,
        output_elems=embed_dim,
        frozen=family == "lit",  # LiT: "locked" (pre-trained, frozen) image tower
        arch=Architecture(image_size=image, patch_size=patch),
    )
    extras: dict = {"scale": scale}
    flows = [("vision", "interaction"), ("text", "interaction")]
    if family == "coca":
        text = _coca_text(
            opts, t_layers, t_hidden, t_heads, text_len, vocab, embed_dim, image_tokens=vision.seq_len, vision_hidden=v_hidden
        )
        flows.append(("vision", "text"))
        extras["cross_attention_elems"] = vision.seq_len * v_hidden
    else:
        text = UnitSpec(
            name="text",
            layers=tuple(text_layers(text_len, vocab, t_layers, t_hidden, t_heads) + [feature_head(t_hidden, embed_dim)]),
            hidden=t_hidden,
            heads=t_heads,
            seq_len=text_len,
            output_elems=embed_dim,
            arch=Architecture(vocab=vocab),
        )
    interaction = UnitSpec(
        name="interaction",
        layers=(contrastive_layer(embed_dim),),
        hidden=embed_dim,
        heads=1,
        seq_len=1,
        output_elems=0,
        kind="contrastive",
    )
    return ModelSpec(
        name=family,
        units=(vision, text, interaction),
        flows=tuple(flows),
        interaction="interaction",
        default_global_batch=DEFAULT_BATCH[scale],
        description=f"{family} ({scale}): vision {v_layers}x{v_hidden} on {image}px/{patch}, "
        f"text {t_layers}x{t_hidden} on {text_len} tokens, embed {embed_dim}",
        extras=extras,
    )


def _coca_text(
    opts: Options,
    layers: int,
    hidden: int,
    heads: int,
    text_len: int,
    vocab: int,
    embed_dim: int,
    image_tokens: int,
    vision_hidden: int,
) -> UnitSpec:
    """CoCa's text decoder: the first half unimodal (causal self-attention; its EOS feature
    is projected for the contrastive loss), the second half multimodal (each block adds
    cross-attention to the image tokens), then the captioning LM head and its loss.

    CoCa's attentional poolers are not modelled (DistMM does not describe them): the
    multimodal layers attend to all ViT output tokens. The captioning head is tied to the
    token embedding, as in GPT-style decoders (FLOPs counted, no extra parameters).
    """
    if layers < 2:
        raise ConfigError(f"{opts.key('text')}.layers={layers} must be at least 2 for coca (half unimodal, half multimodal)")
    unimodal = layers // 2
    plain = transformer_layer(text_len, hidden, heads, name="block")
    cross = transformer_layer(text_len, hidden, heads, cross_seq=image_tokens, cross_hidden=vision_hidden, name="xblock")
    stack = (
        [embedding_layer(vocab, hidden, text_len, positions=text_len)]
        + [plain] * unimodal
        + [feature_head(hidden, embed_dim)]
        + [cross] * (layers - unimodal)
        + [head_layer(text_len, hidden, vocab, tied=True, name="caption_head")]
    )
    return UnitSpec(
        name="text",
        layers=tuple(stack),
        hidden=hidden,
        heads=heads,
        seq_len=text_len,
        output_elems=embed_dim,
        arch=Architecture(vocab=vocab),
    )


def build_clip(opts: Options, seq_len: int | None) -> ModelSpec:
    return _build("clip", opts, seq_len)


def build_coca(opts: Options, seq_len: int | None) -> ModelSpec:
    return _build("coca", opts, seq_len)


def build_lit(opts: Options, seq_len: int | None) -> ModelSpec:
    return _build("lit", opts, seq_len)
