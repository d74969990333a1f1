"""model.unfused: a Llama block's RMSNorm, rotary embedding and SwiGLU and eager attention's
softmax, fused as Megatron-Core with Transformer Engine (and Megatron-LM's fused softmax)
runs them, or step by step as PyTorch code runs them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.cluster import cluster_from_config
from src.config import composed
from src.costmodel.compute import ComputeModel, layer_launches
from src.errors import ConfigError
from src.mesh import Sharding, tensor_parallel
from src.models.registry import build_model
from src.models.spec import Kernel, LayerSpec
from src.setup import validate

SEQ, HIDDEN, HEADS, KV_HEADS, FFN = 1024, 1024, 16, 4, 2816
LLAMA = {"name": "gpt", "preset": None, "layers": 2, "hidden": HIDDEN, "heads": HEADS, "vocab": 32000}
LLAMA |= {"style": "llama", "ffn": FFN, "kv_heads": KV_HEADS}
KV_DIM = KV_HEADS * HIDDEN // HEADS
# The values each operation works on, per sample: the normalised ones, the rotated queries
# and keys, the MLP's output.
VALUES = {"ln1": SEQ * HIDDEN, "attn_rope_q": SEQ * HIDDEN, "attn_rope_k": SEQ * KV_DIM, "act": SEQ * FFN}


def block(unfused: list[str]) -> LayerSpec:
    return build_model({**LLAMA, "unfused": unfused}, SEQ).unit("llm").layers[1]


def kernel(layer: LayerSpec, name: str) -> Kernel:
    return next(k for k in layer.kernels if k.name == name)


def priced(k: Kernel, amp: bool, sharding: Sharding = Sharding()) -> tuple[float, float]:
    """A kernel's (forward, backward) bytes per value on hopper, read back from its times (each
    of its launches one kernel gap)."""
    cluster = replace(cluster_from_config(composed(["cluster=hopper"])["cluster"]), amp=amp)
    times = ComputeModel(cluster, "bf16").kernel_times(k, 1, sharding, 1)
    hbm, gap = cluster.memory_bandwidth * cluster.memory_efficiency, cluster.kernel_overhead_s
    forward, backward = times.fwd - k.launches * gap, times.bwd_input - (k.backward_launches or k.launches) * gap
    return forward * hbm / VALUES[k.name], backward * hbm / VALUES[k.name]


@pytest.mark.parametrize(
    ("name", "op", "fused", "unfused", "launches"),
    [
        ("ln1", "rmsnorm", (4, 8), (36, 84), (8, 14)),
        ("attn_rope_q", "rope", (4, 4), (20, 30), (5, 9)),
        ("attn_rope_k", "rope", (4, 4), (20, 30), (5, 9)),
        ("act", "swiglu", (6, 12), (10, 18), (2, 3)),
    ],
)
def test_each_operation_moves_its_bytes_a_value_in_its_kernels(
    name: str, op: str, fused: tuple[int, int], unfused: tuple[int, int], launches: tuple[int, int]
) -> None:
    """Fused: one kernel each way. Unfused: every step a kernel of its own reading and writing
    the whole tensor, as autograd runs them backward, counted in the dtypes its steps run, so
    autocast adds nothing."""
    one, many = kernel(block([]), name), kernel(block([op]), name)
    assert (one.elementwise, one.launches, one.backward_launches) == (op, 1, 0)
    assert (many.launches, many.backward_launches) == launches
    assert priced(one, amp=False) == pytest.approx(fused)
    assert priced(many, amp=False) == pytest.approx(unfused)
    assert priced(many, amp=True) == pytest.approx(unfused)


def test_the_rotary_embedding_is_a_kernel_for_the_queries_and_one_for_the_keys_split_by_heads() -> None:
    names = [k.name for k in block([]).kernels]
    assert names[names.index("attn_qkv") + 1 : names.index("attn_qkv") + 3] == ["attn_rope_q", "attn_rope_k"]
    tp = priced(kernel(block(["rope"]), "attn_rope_k"), amp=False, sharding=tensor_parallel(4))
    assert (tp[0] * 4, tp[1] * 4) == pytest.approx((20, 30))


GPT = {**LLAMA, "style": "gpt", "kv_heads": None, "ffn": None}


def test_a_gpt_block_has_no_rotary_embedding_and_only_its_softmax_to_unfuse() -> None:
    gpt = build_model(GPT, SEQ).unit("llm")
    assert {k.elementwise for layer in gpt.layers for k in layer.kernels} == {"", "softmax"}
    assert not any("rope" in k.name for layer in gpt.layers for k in layer.kernels)


def test_an_unfused_softmax_fills_the_mask_in_a_kernel_of_its_own_each_way() -> None:
    """masked_fill_ then softmax: 8 bytes a score in 2 kernels forward (fused: 4 in 1), the
    softmax's gradient then the mask filled into it backward, 12 in 2 (fused: 8 in 1); the
    scores are HEADS x SEQ x SEQ a sample, nothing more kept."""
    fused = build_model({**GPT, "unfused": []}, SEQ).unit("llm").layers[1]
    unfused = build_model({**GPT, "unfused": ["softmax"]}, SEQ).unit("llm").layers[1]
    cluster = cluster_from_config(composed(["cluster=hopper"])["cluster"])
    hbm, gap = cluster.memory_bandwidth * cluster.memory_efficiency, cluster.kernel_overhead_s
    scores = HEADS * SEQ * SEQ
    for layer, launches, moved in ((fused, (1, 0), (4, 8)), (unfused, (2, 2), (8, 12))):
        softmax = kernel(layer, "attn_softmax")
        times = ComputeModel(cluster, "bf16").kernel_times(softmax, 1, Sharding(), 1)
        assert (softmax.launches, softmax.backward_launches) == launches
        forward, backward = times.fwd - launches[0] * gap, times.bwd_input - (launches[1] or launches[0]) * gap
        assert (forward * hbm / scores, backward * hbm / scores) == pytest.approx(moved)
    assert unfused.activations == fused.activations


def test_flash_attention_runs_no_softmax_of_its_own_to_unfuse() -> None:
    with pytest.raises(ConfigError, match="only eager attention a softmax of its own"):
        build_model({**GPT, "attention": "flash", "unfused": ["softmax"]}, SEQ)
    # A codebase's own setting holds for what the model runs: nothing, under FlashAttention.
    flash = build_model({**GPT, "attention": "flash", "unfused": None}, SEQ, unfused=("softmax",)).unit("llm").layers[1]
    assert kernel(flash, "attn_softmax").launches == 1


def test_deepspeed3d_runs_its_codebases_softmax_unfused_unless_the_model_says() -> None:
    """Megatron-LM v1.1.5's scale-mask-softmax fusion is off by default and takes fp16 only."""
    base = ["model=gpt", "model.preset=gpt_5b", "cluster=perlmutter", "strategy=deepspeed3d", "train.precision=bf16"]
    for extra, launches in (([], 2), (["model.unfused=[]"], 1), (["strategy.unfused=[]"], 1), (["strategy=megatron"], 1)):
        layers = validate(composed([*base, *extra])).model.unit("llm").layers
        softmax = next((k for k in layers[1].kernels if k.name == "attn_softmax"), None)
        assert softmax is not None and softmax.launches == launches, extra
    with pytest.raises(ConfigError, match=r"strategy.unfused=\['gelu'\] names \['gelu'\]"):
        validate(composed([*base, "strategy.unfused=[gelu]"]))


def test_unfused_operations_keep_more_for_backward_and_launch_their_steps() -> None:
    """RMSNorm keeps its fp32 input (4 bytes a value, replicated across TP ranks as the norm's
    input is), SwiGLU the SiLU's output (2 bytes a value of the MLP's output, split), RoPE
    nothing (its factors are constants). The host issues every step: 7 more kernels a norm
    forward and 13 more backward, 4 and 8 more a rotation, 1 and 2 more for SwiGLU."""
    fused, every = block([]), block(["rmsnorm", "rope", "swiglu"])
    a, b = fused.activations, every.activations
    assert b.replicated - a.replicated == pytest.approx(2 * 4 * SEQ * HIDDEN)
    assert b.split - a.split == pytest.approx(2 * SEQ * FFN)
    assert (b.attention, b.checkpoint, b.flash_attention) == (a.attention, a.checkpoint, a.flash_attention)
    assert layer_launches(every).fwd - layer_launches(fused).fwd == 2 * 7 + 2 * 4 + 1
    assert layer_launches(every).bwd_input - layer_launches(fused).bwd_input == 2 * 13 + 2 * 8 + 2
    assert block(["rope"]).activations == a


def test_an_unfused_norm_reduces_its_weight_gradient_in_two_kernels_of_its_own_whatever_the_preset() -> None:
    """Autograd multiplies the output's gradient by the cast-back output and sums it over the
    rows (6 and 2 bytes a value), where the fused kernel folds it in (hopper: fused) or reduces
    the gradient and the input in one kernel (separate: 4)."""
    cluster = cluster_from_config(composed(["cluster=hopper"])["cluster"])
    hbm, gap = cluster.memory_bandwidth * cluster.memory_efficiency, cluster.kernel_overhead_s
    for grad_kernels in ("fused", "separate"):
        norm = kernel(
            build_model({**LLAMA, "unfused": ["rmsnorm"], "param_grad_kernels": grad_kernels}, SEQ).unit("llm").layers[1], "ln1"
        )
        weight = ComputeModel(cluster, "bf16").kernel_times(norm, 1, Sharding(), 1).bwd_weight
        assert (weight - gap) * hbm / VALUES["ln1"] == pytest.approx(8)


def test_the_final_norm_is_unfused_with_the_blocks() -> None:
    head = build_model({**LLAMA, "unfused": ["rmsnorm"]}, SEQ).unit("llm").layers[-1]
    assert kernel(head, "final_norm").launches == 8


@pytest.mark.parametrize(
    ("model", "refusal"),
    [
        ({**LLAMA, "unfused": ["layernorm"]}, r"names \['layernorm'\]: the operations are rmsnorm, rope, swiglu"),
        ({**LLAMA, "style": "gpt", "unfused": ["rope"]}, r"model.unfused names rope, which model gpt does not run"),
        ({**LLAMA, "unfused": "rope"}, r"model.unfused='rope' must be a list of names"),
    ],
)
def test_an_operation_nobody_runs_is_refused_in_one_line(model: dict, refusal: str) -> None:
    with pytest.raises(ConfigError, match=refusal):
        build_model(model, SEQ)


def test_the_front_door_takes_it_from_the_models_that_have_llama_blocks() -> None:
    layers = validate(composed(["model=mllm_9b", "model.scale=tiny", "model.unfused=[swiglu]"])).model.unit("llm").layers
    assert kernel(layers[1], "act").launches == 2
    with pytest.raises(ConfigError, match="which model clip does not run"):
        validate(composed(["model=clip", "+model.unfused=[rmsnorm]"]))
