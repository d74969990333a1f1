"""Model specs against the papers' stated sizes, FLOPs identities, configs and errors.

Paper numbers here are reference data (docs/design.md): nothing in src/ reads them. Where a
paper's size cannot be reached by the architecture it describes, the test compares the
paper with the part it evidently counted and pins the rest separately; each such gap is
explained where it is asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.errors import ConfigError
from src.models import MODEL_NAMES, build_model
from src.models.layers import transformer_layer
from src.metrics import unit_flops
from src.models.spec import ModelSpec, UnitSpec
from tests.composing import composed

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"
SCALES = ("single_device", "single_node", "multi_node", "tiny")


def near(ours: float, paper: float, rel: float = 0.05) -> bool:
    return abs(ours - paper) <= rel * paper


def params_of(unit: UnitSpec, *, named: str | None = None, prefix: str | None = None, exclude_prefix: tuple[str, ...] = ()) -> int:
    return sum(
        layer.params
        for layer in unit.layers
        if (named is None or layer.name == named)
        and (prefix is None or layer.name.startswith(prefix))
        and not layer.name.startswith(exclude_prefix)
    )


# ---------------------------------------------------------------------------------------
# DistMM Table 2. Its sizes are GPT-3's (Brown et al. 2020, Table 2.1, same layers and
# widths): 12·L·h² of blocks + GPT-3's token (50257) and position (2048) embeddings.
# That is what the paper counted for every tower, vision included, and CoCa's text tower
# without its cross-attention. We compare the paper with exactly that part of our towers
# (our blocks with their biases and norms + a GPT-3 embedding of the tower's width), then
# check the whole text towers directly (their own 49408x h embedding is close to GPT-3's)
# and pin what the paper left out: a ViT's real size is below its label, by the missing
# token embedding (760M -> 0.68B, 350M -> 0.31B, 2.7B -> 2.53B), and CoCa's
# cross-attention adds 2h² + 2·h·h_vision per multimodal layer.
GPT3_EMBEDDING_ROWS = 50257 + 2048
DISTMM_TABLE2 = {  # (vision, text, total) as printed
    ("clip", "single_device"): (760e6, 350e6, 1.1e9),
    ("clip", "single_node"): (6.7e9, 2.7e9, 9.3e9),
    ("clip", "multi_node"): (13e9, 6.7e9, 19.7e9),
    ("coca", "single_device"): (760e6, 760e6, 1.52e9),
    ("coca", "single_node"): (6.7e9, 6.7e9, 13.4e9),
    ("coca", "multi_node"): (13e9, 13e9, 26e9),
    ("lit", "single_device"): (350e6, 760e6, 1.1e9),
    ("lit", "single_node"): (2.7e9, 6.7e9, 9.4e9),
    ("lit", "multi_node"): (6.7e9, 13e9, 19.7e9),
}


def distmm_counted(unit: UnitSpec) -> int:
    """The part of a tower DistMM's Table 2 counts: its transformer blocks without
    cross-attention, plus a GPT-3 embedding of the tower's width."""
    block = next(layer for layer in unit.layers if layer.name == "block")
    blocks = sum(1 for layer in unit.layers if layer.name in ("block", "xblock"))
    return blocks * block.params + GPT3_EMBEDDING_ROWS * unit.hidden


@pytest.mark.parametrize("family,scale", list(DISTMM_TABLE2))
def test_distmm_table2_sizes(family: str, scale: str) -> None:
    vision_paper, text_paper, total_paper = DISTMM_TABLE2[family, scale]
    spec = build_model({"name": family, "scale": scale})
    vision, text = spec.unit("vision"), spec.unit("text")
    assert near(distmm_counted(vision), vision_paper)
    assert near(distmm_counted(text), text_paper)
    assert near(distmm_counted(vision) + distmm_counted(text), total_paper)
    # What the paper did not count in a ViT: the token embedding it does not have.
    assert vision.params < distmm_counted(vision)
    if family != "coca":
        assert near(text.params, text_paper)


@pytest.mark.parametrize("scale", SCALES)
def test_coca_cross_attention_is_the_uncounted_extra(scale: str) -> None:
    spec = build_model({"name": "coca", "scale": scale})
    vision, text = spec.unit("vision"), spec.unit("text")
    h, hv = text.hidden, vision.hidden
    plain = next(layer for layer in text.layers if layer.name == "block")
    cross = next(layer for layer in text.layers if layer.name == "xblock")
    # q and output projections, k/v from the vision width, their biases, one more norm.
    assert cross.params - plain.params == 2 * h * h + 2 * hv * h + 4 * h + 2 * h
    names = [layer.name for layer in text.layers]
    assert names.count("block") + names.count("xblock") == {"single_device": 24, "single_node": 32, "multi_node": 40, "tiny": 2}[scale]
    assert names.count("xblock") == names.count("block")
    assert names.index("projection") < names.index("xblock") < names.index("caption_head")
    assert ("vision", "text") in spec.flows
    assert spec.extras["cross_attention_elems"] == vision.seq_len * hv


# ---------------------------------------------------------------------------------------
# DistTrain §8 and Table 1.
def test_disttrain_llm_backbones() -> None:
    # Table 1's "Llama3-7B/13B/70B" (Llama 2 shapes, 32000-token vocabulary).
    for model, paper in (("mllm_9b", 7e9), ("mllm_15b", 13e9), ("mllm_72b", 70e9)):
        assert near(build_model({"name": model}).unit("llm").params, paper)


@pytest.mark.parametrize("model", ["mllm_9b", "mllm_15b", "mllm_72b"])
def test_disttrain_encoder_generator_and_total(model: str) -> None:
    spec = build_model({"name": model})
    encoder, generator = spec.unit("encoder"), spec.unit("generator")
    # ViT-Huge "0.63B" (§8): the encoder without the input projector.
    assert near(params_of(encoder, exclude_prefix=("input_projector",)), 0.63e9)
    assert encoder.layers[-1].name == "input_projector"
    assert generator.layers[0].name == "output_projector"
    # SD-2.1: our U-Net and VAE encoder reproduce the published SD-2.1 checkpoint
    # (865,910,724 U-Net parameters; we carry 74,880 more, the q/k/v biases SD does not
    # have, because layers.transformer_layer has one bias switch for all projections;
    # VAE encoder 34,163,592 + 72 for the quant conv).
    unet = params_of(generator, exclude_prefix=("output_projector", "vae."))
    vae_encoder = params_of(generator, prefix="vae.")
    assert unet == 865_910_724 + 74_880
    assert vae_encoder == 34_163_592 + 72
    # DistTrain's "1B" is SD-2.1 without its text encoder (replaced by the LLM): U-Net +
    # the whole VAE (83,653,863, of which the decoder, not run in training, is not
    # modelled) = 0.95B, stated as a round 1B: 5.0% below, hence the 6% tolerance.
    assert near(unet + 83_653_863, 1e9, rel=0.06)
    # The MLLM names round up LLM nominal + 0.63B + 1B (8.63 -> "9B", 14.63 -> "15B",
    # 71.63 -> "72B"); our totals are within 5% of those sums (not of 9B: 8.31B, -7.6%).
    nominal = {"mllm_9b": 7e9, "mllm_15b": 13e9, "mllm_72b": 70e9}[model] + 0.63e9 + 1e9
    assert near(spec.params, nominal)


def test_mllm_structure() -> None:
    spec = build_model({"name": "mllm_72b"})
    assert [u.name for u in spec.units] == ["encoder", "llm", "generator"]
    assert spec.flows == (("encoder", "llm"), ("llm", "generator"))
    llm = spec.unit("llm")
    assert llm.seq_len == 8192 and llm.hidden == 8192
    assert spec.unit("encoder").output_elems == 256 * 8192
    assert llm.output_elems == 77 * 8192
    assert spec.unit("generator").seq_len == (1024 // 8) ** 2
    block = next(layer for layer in llm.layers if layer.name == "block")
    qkv = next(kern for kern in block.kernels if kern.name == "attn_qkv")
    assert qkv.n == 8192 + 2 * 8 * 128  # GQA: 8 KV groups of head dim 128
    generator = spec.unit("generator")
    vae = [layer for layer in generator.layers if layer.forward_only]
    assert vae and all(layer.name.startswith("vae.") for layer in vae)
    assert generator.trainable_params() == generator.params - sum(layer.params for layer in vae)
    no_vae = build_model({"name": "mllm_72b", "vae_encode": False})
    assert not any(layer.forward_only for layer in no_vae.unit("generator").layers)
    assert build_model({"name": "mllm_9b"}).unit("generator").seq_len == 64 * 64


def test_mllm_refuses_more_images_than_its_sequence_holds() -> None:
    # 31 images of 256 tokens leave text room in 8192 tokens; 32 fill it.
    assert build_model({"name": "mllm_9b", "images_per_sequence": 31}).extras["images_per_sequence"] == 31
    with pytest.raises(ConfigError, match=r"images_per_sequence=32: 32 images of 256 tokens \(8192\) .*at most 31"):
        build_model({"name": "mllm_9b", "images_per_sequence": 32})
    with pytest.raises(ConfigError, match="at most 7"):
        build_model({"name": "mllm_9b", "images_per_sequence": 8}, seq_len=2048)


@pytest.mark.parametrize("spread", [-0.1, 1.5, float("nan"), float("inf"), "wide", True])
def test_mllm_image_size_spread_is_a_finite_sigma_from_0_to_1(spread) -> None:
    assert build_model({"name": "mllm_9b", "image_size_spread": 0}).extras["image_size_spread"] == 0.0
    assert build_model({"name": "mllm_9b", "image_size_spread": 1}).extras["image_size_spread"] == 1.0
    with pytest.raises(ConfigError) as refused:
        build_model({"name": "mllm_9b", "image_size_spread": spread})
    assert str(refused.value) == (
        f"model.image_size_spread={spread!r} must be a number from 0 to 1 (sigma of log image side; sides are clipped "
        f"to half and twice the nominal, so beyond 1 most land on a bound)"
    )


# ---------------------------------------------------------------------------------------
# Optimus Tables 8 and 9.
@pytest.mark.parametrize(
    "encoder,paper",
    [
        ("vit_3b", 3e9),
        ("vit_5b", 5.5e9),
        ("vit_11b", 10e9),  # Table 8's "ViT-10B" row
        ("vit_22b", 22e9),
    ],
)
def test_optimus_table8_encoders(encoder: str, paper: float) -> None:
    unit = build_model({"name": "optimus", "encoders": [encoder]}).unit("encoder")
    assert near(params_of(unit, exclude_prefix=("input_projector",)), paper)


@pytest.mark.parametrize("llm,paper", [("llama_70b", 70e9), ("gpt_175b", 175e9)])
def test_optimus_table9_llms(llm: str, paper: float) -> None:
    assert near(build_model({"name": "optimus", "llm": llm}).unit("llm").params, paper)


def test_optimus_gpt_11b_gap() -> None:
    # Table 9's GPT-11B (80 layers, width 3072, 24 heads) is 9.2B as any GPT: 12·L·h² =
    # 9.06B of blocks + 0.16B of embeddings; 11B would need e.g. 96 layers (10.9B). We keep
    # the table's shape and pin the gap (-16%) rather than change it.
    llm = build_model({"name": "optimus", "llm": "gpt_11b"}).unit("llm")
    blocks = 12 * 80 * 3072**2 + 13 * 80 * 3072
    assert near(llm.params, blocks + (51200 + 2048) * 3072, rel=0.001)
    assert 0.82 < llm.params / 11e9 < 0.86


def test_optimus_dual_encoder() -> None:
    spec = build_model({"name": "optimus", "encoders": ["vit_22b", "vit_5b"], "llm": "gpt_175b"})
    assert [u.name for u in spec.units] == ["encoder0", "encoder1", "llm"]
    assert spec.flows == (("encoder0", "llm"), ("encoder1", "llm"))
    assert spec.unit("encoder0").hidden == 6144 and spec.unit("encoder1").hidden == 3072
    assert spec.unit("encoder1").output_elems == 256 * 12288
    assert spec.unit("llm").seq_len == 2048


# ---------------------------------------------------------------------------------------
# Par4D Tables I and II.
@pytest.mark.parametrize(
    "preset,paper", [("gpt_5b", 5e9), ("gpt_10b", 10e9), ("gpt_20b", 20e9), ("gpt_40b", 40e9), ("gpt_80b", 80e9), ("gpt_175b", 175e9)]
)
def test_par4d_table1_gpts(preset: str, paper: float) -> None:
    spec = build_model({"name": "gpt", "preset": preset})
    assert near(spec.params, paper)
    assert spec.unit("llm").seq_len == 2048


# Table II's sizes are the nominal labels of a weak-scaling series doubling with the GPU
# count. The architecture is pinned by Par4D's "50M parameter U-Net on CIFAR-10", which
# is Nichol et al.'s CIFAR-10 configuration at 128 channels: 52.5M, stated as a round
# 50M (+5.1%, hence 6%). Table II then varies only the width, so params grow as C²;
# against the labels that gives 0.84x (250M, 1B, 4B), 1.11x (500M) and 0.94x (2B).
UNET_TABLE2 = {
    "unet_250m": (256, 250e6),
    "unet_500m": (416, 500e6),
    "unet_1b": (512, 1e9),
    "unet_2b": (768, 2e9),
    "unet_4b": (1024, 4e9),
}


def test_par4d_unet_sizes() -> None:
    small = build_model({"name": "unet", "preset": "unet_50m"}).params
    assert near(small, 50e6, rel=0.06)
    for preset, (channels, label) in UNET_TABLE2.items():
        params = build_model({"name": "unet", "preset": preset}).params
        assert near(params / channels**2, small / 128**2, rel=0.02)
        assert near(params, label, rel=0.17)


def test_unet_convolutions_are_implicit_gemms() -> None:
    unit = build_model({"name": "unet", "preset": "unet_1b"}).unit("unet")
    conv_in = next(layer for layer in unit.layers if layer.name == "conv_in")
    (kern,) = conv_in.kernels
    assert (kern.m, kern.k, kern.n, kern.tp_split) == (32 * 32, 3 * 3 * 3, 512, "n")
    res = next(layer for layer in unit.layers if layer.name == "down1.0_res")
    conv1 = next(k for k in res.kernels if k.name == "conv1")
    assert (conv1.m, conv1.k, conv1.n) == (16 * 16, 512 * 9, 1024)
    resblocks = [layer for layer in unit.layers if any(k.name == "conv1" for k in layer.kernels)]
    assert len(resblocks) == 4 * 3 + 2 + 4 * 4  # four levels of 3 down, 2 in the middle, 4 up per level
    assert unit.heads == 4 and unit.kind == "unet"


# ---------------------------------------------------------------------------------------
# FLOPs: a plain GPT layer is 24·s·h² + 4·s²·h forward per sample.
@pytest.mark.parametrize("seq,hidden,heads", [(2048, 4096, 32), (512, 1024, 16), (77, 1536, 24), (8192, 12288, 96), (1, 64, 4)])
def test_gpt_layer_flops(seq: int, hidden: int, heads: int) -> None:
    expected = 24 * seq * hidden**2 + 4 * seq**2 * hidden
    assert transformer_layer(seq, hidden, heads).matmul_flops() == expected
    spec = build_model({"name": "gpt", "preset": None, "layers": 2, "hidden": hidden, "heads": heads, "vocab": 1000}, seq_len=seq)
    block = next(layer for layer in spec.unit("llm").layers if layer.name == "block")
    assert block.matmul_flops() == expected


# ---------------------------------------------------------------------------------------
# Configs.
@pytest.mark.parametrize("name", sorted(path.stem for path in CONF_MODEL.glob("*.yaml")))
def test_every_model_config_composes_and_builds(name: str) -> None:
    config = composed([f"model={name}"])
    model_cfg = config["model"]
    assert model_cfg["name"] in MODEL_NAMES
    spec = build_model(model_cfg, config["train"]["seq_len"])
    assert isinstance(spec, ModelSpec) and spec.params > 0


def test_every_registered_model_has_a_config() -> None:
    names = {OmegaConf.load(path).name for path in CONF_MODEL.glob("*.yaml")}
    assert names == set(MODEL_NAMES)


@pytest.mark.parametrize("family", ["clip", "coca", "lit"])
def test_every_scale_builds_and_tiny_keeps_the_structure(family: str) -> None:
    specs = {scale: build_model({"name": family, "scale": scale}) for scale in SCALES}
    tiny = specs["tiny"]
    assert tiny.params * 4 < 10 * 2**20
    for spec in specs.values():
        assert [u.name for u in spec.units] == ["vision", "text", "interaction"]
        assert spec.flows == tiny.flows and spec.interaction == "interaction"
        assert [u.frozen for u in spec.units] == [u.frozen for u in tiny.units]
        assert {layer.name for u in spec.units for layer in u.layers} == {layer.name for u in tiny.units for layer in u.layers}
        assert spec.unit("interaction").seq_len == 1
        embed = spec.unit("interaction").hidden
        assert spec.unit("vision").output_elems == spec.unit("text").output_elems == embed


def test_distmm_inputs_and_heads() -> None:
    spec = build_model({"name": "clip", "scale": "multi_node"})
    vision = spec.unit("vision")
    # 80 heads: DistMM's TP 16 for the 5120-wide towers needs heads divisible by 16.
    assert vision.seq_len == (336 // 14) ** 2 + 1 and vision.hidden == 5120 and vision.heads == 80
    assert spec.unit("text").seq_len == 77 and spec.unit("text").heads == 32
    assert build_model({"name": "clip", "scale": "single_device"}).unit("vision").heads == 24
    bigger = build_model({"name": "clip", "image_size": 448})
    assert bigger.unit("vision").seq_len == 32**2 + 1


def test_lit_vision_frozen_by_default() -> None:
    spec = build_model({"name": "lit"})
    assert spec.unit("vision").frozen and not spec.needs_backward("vision")
    assert spec.needs_backward("text") and spec.needs_backward("interaction")
    assert not build_model(composed(["model=lit"])["model"]).needs_backward("vision")
    assert build_model({"name": "lit", "frozen": []}).needs_backward("vision")


def test_frozen_any_unit() -> None:
    spec = build_model({"name": "mllm_9b", "frozen": ["encoder", "llm"]})
    assert [u.frozen for u in spec.units] == [True, True, False]
    assert not spec.needs_backward("encoder") and not spec.needs_backward("llm")
    clip = build_model({"name": "clip", "frozen": ["text"]})
    assert clip.unit("text").frozen and not clip.unit("vision").frozen


def test_seq_len_overrides_llm_units_only() -> None:
    assert build_model({"name": "gpt"}, seq_len=4096).unit("llm").seq_len == 4096
    spec = build_model({"name": "mllm_15b"}, seq_len=4096)
    assert spec.unit("llm").seq_len == 4096 and spec.unit("encoder").seq_len == 257
    assert build_model({"name": "optimus"}, seq_len=1024).unit("llm").seq_len == 1024


@pytest.mark.parametrize(
    "cfg,seq_len,words",
    [
        ({"name": "bert"}, None, ["model.name", "'bert'", "clip"]),
        ({"name": "clip", "scale": "huge"}, None, ["model.scale", "'huge'", "single_device", "tiny"]),
        ({"name": "coca", "vision": {"hidden": 1000}}, None, ["model.vision.hidden=1000", "model.vision.heads=15"]),
        ({"name": "clip", "text": {"hidden": 1024, "heads": 7}}, None, ["model.text.hidden=1024", "heads=7"]),
        ({"name": "lit", "text": {"layers": 0}}, None, ["model.text.layers=0", "positive"]),
        ({"name": "clip", "vision": {"layers": -2}}, None, ["model.vision.layers=-2"]),
        ({"name": "lit", "frozen": ["image"]}, None, ["model.frozen", "'image'", "vision, text, interaction"]),
        ({"name": "clip", "image_size": 300}, None, ["model.image_size=300", "model.patch_size=14"]),
        ({"name": "clip", "imagesize": 224}, None, ["model.imagesize", "clip"]),
        ({"name": "clip"}, 2048, ["train.seq_len=2048", "model.text_len"]),
        ({"name": "gpt"}, 0, ["train.seq_len=0"]),
        ({"name": "gpt", "preset": "gpt_7b"}, None, ["model.preset", "'gpt_7b'", "gpt_80b"]),
        ({"name": "gpt", "preset": None, "layers": 4}, None, ["model.preset=null", "model.hidden", "model.vocab"]),
        ({"name": "gpt", "hidden": 4100}, None, ["model.hidden=4100", "model.heads=32"]),
        ({"name": "optimus", "encoders": ["vit_1b"]}, None, ["model.encoders", "'vit_1b'", "vit_22b"]),
        ({"name": "optimus", "encoders": ["vit_3b"] * 3}, None, ["model.encoders", "1 to 2"]),
        ({"name": "optimus", "llm": "gpt_3"}, None, ["model.llm", "'gpt_3'", "llama_70b"]),
        ({"name": "mllm_72b", "image_size": 1000}, None, ["model.image_size=1000", "64"]),
        ({"name": "mllm_9b", "frozen": ["vision"]}, None, ["model.frozen", "encoder, llm, generator"]),
        ({"name": "unet", "preset": "unet_3b"}, None, ["model.preset", "'unet_3b'", "unet_4b"]),
        ({"name": "unet", "channels": 100}, None, ["model.channels=100", "32"]),
        ({"name": "unet", "channel_mult": []}, None, ["model.channel_mult"]),
        ({"name": "unet", "preset": None}, None, ["model.channels", "required"]),
    ],
)
def test_bad_configs_raise_one_line(cfg: dict, seq_len: int | None, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build_model(cfg, seq_len)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_mllm_images_per_sequence_scale_encoder_and_generator_work_not_weights() -> None:
    one, four = build_model({"name": "mllm_9b"}), build_model({"name": "mllm_9b", "images_per_sequence": 4})
    for name in ("encoder", "generator"):
        assert four.unit(name).params == one.unit(name).params
        assert unit_flops(four, four.unit(name)).fwd == pytest.approx(4 * unit_flops(one, one.unit(name)).fwd)
    assert unit_flops(four, four.unit("llm")).fwd == unit_flops(one, one.unit("llm")).fwd
    assert four.unit("encoder").output_elems == 4 * one.unit("encoder").output_elems
    assert four.unit("llm").output_elems == 4 * one.unit("llm").output_elems


def test_optimus_images_per_sample_scale_every_encoders_work_not_its_weights() -> None:
    # Every encoder reads each of a sequence's images; the LLM's sequence is as long whatever
    # they are (their tokens are inside it).
    one = build_model({"name": "optimus", "encoders": ["vit_22b", "vit_5b"]})
    three = build_model({"name": "optimus", "encoders": ["vit_22b", "vit_5b"], "images_per_sample": 3})
    for name in ("encoder0", "encoder1"):
        assert three.unit(name).params == one.unit(name).params
        assert unit_flops(three, three.unit(name)).fwd == pytest.approx(3 * unit_flops(one, one.unit(name)).fwd)
        assert three.unit(name).output_elems == 3 * one.unit(name).output_elems
        assert three.unit(name).arch.images == 3
    assert unit_flops(three, three.unit("llm")).fwd == unit_flops(one, one.unit("llm")).fwd
    assert three.unit("llm").arch.image_tokens == 3 * one.unit("llm").arch.image_tokens


def test_frozen_mllm_units_keep_their_projectors_training() -> None:
    spec = build_model({"name": "mllm_9b", "frozen": ["encoder", "llm", "generator"], "train_projectors": True})
    encoder, llm, generator = (spec.unit(n) for n in ("encoder", "llm", "generator"))
    assert encoder.trainable_params() == encoder.layers[-1].params  # only the input projector
    assert generator.trainable_params() == generator.layers[0].params  # only the output projector
    assert llm.frozen and spec.needs_backward("llm")  # the input projector's gradient crosses the LLM
    # The frozen ViT before the trained projector runs no backward; the frozen U-Net after
    # the output projector passes input gradients back to it but computes no weight gradient.
    assert not spec.needs_input_grad("encoder", 5) and spec.needs_input_grad("encoder", encoder.num_layers - 1)
    assert spec.needs_input_grad("generator", generator.num_layers - 1)
    full = build_model({"name": "mllm_9b"})
    for name, unit in (("encoder", encoder), ("generator", generator)):
        frozen_bwd, trained_bwd = unit_flops(spec, unit).bwd, unit_flops(full, full.unit(name)).bwd
        assert 0 < frozen_bwd < trained_bwd
    assert unit_flops(spec, encoder).bwd < 0.1 * unit_flops(full, full.unit("encoder")).bwd
    # Without train_projectors a frozen unit is frozen whole, as for every other model.
    assert build_model({"name": "mllm_9b", "frozen": ["encoder"]}).unit("encoder").frozen
