"""model.attention_copies: the tensor copies software makes around a self-attention core,
each a kernel reading and writing every 16-bit value, and its backward the same."""

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

SEQ, HIDDEN, HEADS, FFN = 1024, 1024, 16, 2816
LLAMA = {"name": "gpt", "preset": None, "layers": 2, "hidden": HIDDEN, "heads": HEADS, "vocab": 32000, "style": "llama", "ffn": FFN}
QUERIES = SEQ * HIDDEN  # a sample's query values (its output's as many)


def block(copies: list[str], kv_heads: int = 4, style: str = "llama") -> LayerSpec:
    model = {**LLAMA, "kv_heads": kv_heads, "attention_copies": copies}
    if style != "llama":
        model |= {"style": style, "ffn": None}
    return build_model(model, SEQ).unit("llm").layers[1]


def kernel(layer: LayerSpec, name: str) -> Kernel:
    return next(k for k in layer.kernels if k.name == name)


def priced_bytes(k: Kernel, sharding: Sharding = Sharding(), samples: int = 2) -> tuple[float, float]:
    """A kernel's (forward, backward) bytes a sample on hopper, read back from its times over a
    micro-batch of `samples` (each of its launches one kernel gap)."""
    cluster = replace(cluster_from_config(composed(["cluster=hopper"])["cluster"]), amp=True)
    times = ComputeModel(cluster, "bf16").kernel_times(k, samples, sharding, 1)
    hbm, gaps = cluster.memory_bandwidth * cluster.memory_efficiency, k.launches * cluster.kernel_overhead_s
    return (times.fwd - gaps) * hbm / samples, (times.bwd_input - gaps) * hbm / samples


def copies_of(layer: LayerSpec) -> list[Kernel]:
    return [k for k in layer.kernels if k.name in ("attn_copies", "attn_layout")]


def keys(kv_heads: int) -> int:
    return SEQ * kv_heads * HIDDEN // HEADS


@pytest.mark.parametrize(
    ("copies", "values", "launches"),
    [
        # q, k, v to [b, s] and the output back.
        (["bshd"], lambda kv: 2 * QUERIES + 2 * kv, 4),
        # the keys and values read, query-sized ones written.
        (["kv_repeat"], lambda kv: kv + QUERIES, 2),
        (["rotary_patch"], lambda kv: QUERIES + 2 * kv, 3),
        (["rope_concat"], lambda kv: QUERIES + kv, 2),
        # after a repeat every copy moves query-sized keys and values.
        (["bshd", "kv_repeat", "rope_concat"], lambda kv: 4 * QUERIES + (kv + QUERIES) + 2 * QUERIES, 8),
    ],
)
@pytest.mark.parametrize("kv_heads", [4, HEADS])
def test_each_copy_reads_and_writes_its_tensors_each_way(copies: list[str], values, launches: int, kv_heads: int) -> None:
    made = copies_of(block(copies, kv_heads))
    assert sum(k.launches for k in made) == launches
    # Two bytes read and two written a value, forward; the gradient copied back as many.
    priced = [priced_bytes(k) for k in made]
    assert (sum(f for f, _ in priced), sum(b for _, b in priced)) == pytest.approx((4 * values(keys(kv_heads)),) * 2)
    # Split by heads over TP ranks; autocast adds nothing to a copy of 16-bit values.
    for k, whole in zip(made, priced):
        tp = priced_bytes(k, tensor_parallel(4))
        assert (4 * tp[0], 4 * tp[1]) == pytest.approx(whole)


def test_a_micro_batch_of_one_sample_transposes_in_place() -> None:
    """[s, 1] and [1, s] are the same contiguous tensor: the layout copies move nothing and
    launch nothing at one sample a micro-batch; the other copies do."""
    made = {k.name: k for k in copies_of(block(["bshd", "kv_repeat"]))}
    cluster = cluster_from_config(composed(["cluster=hopper"])["cluster"])
    model = ComputeModel(cluster, "bf16")
    one = model.kernel_times(made["attn_layout"], 1, Sharding(), 1)
    assert (one.fwd, one.bwd_input, one.bwd_weight, one.launches.fwd) == (0.0, 0.0, 0.0, 0)
    assert model.kernel_times(made["attn_layout"], 1, Sharding(), 1, grid_rows=2).fwd > 0  # a chunk of a larger micro-batch
    assert model.kernel_times(made["attn_copies"], 1, Sharding(), 1).fwd > 0


def test_the_copies_sit_between_the_rotation_and_the_core_and_launch_each_way() -> None:
    none, every = block([]), block(["bshd", "kv_repeat", "rotary_patch", "rope_concat"])
    names = [k.name for k in every.kernels]
    assert names[names.index("attn_rope_k") + 1 : names.index("attn_scores")] == ["attn_copies", "attn_layout"]
    assert every.kernels[: names.index("attn_rope_k")] == none.kernels[: names.index("attn_rope_k")]
    assert layer_launches(every).fwd - layer_launches(none).fwd == 11
    assert layer_launches(every).bwd_input - layer_launches(none).bwd_input == 11
    assert layer_launches(every).core_fwd == layer_launches(none).core_fwd  # outside the core: selective recompute keeps them


def test_a_repeat_rotates_the_repeated_keys_and_keeps_them_for_backward() -> None:
    """Megatron-LM's legacy attention repeats the keys before rotating them, and FlashAttention
    keeps the repeated keys and values (two bytes a value) in place of the grouped ones."""
    grouped, repeated = block(["rope_concat"]), block(["kv_repeat", "rope_concat"])
    assert kernel(repeated, "attn_rope_k").bytes == kernel(grouped, "attn_rope_k").bytes * HEADS // 4
    assert kernel(repeated, "attn_rope_q") == kernel(grouped, "attn_rope_q")
    extra = repeated.activations.split - grouped.activations.split
    assert extra == pytest.approx(2 * 2 * (QUERIES - keys(4)))
    # Multi-head attention repeats by one: a copy, nothing more kept.
    assert block(["kv_repeat"], HEADS).activations == block([], HEADS).activations


def test_a_copy_of_a_step_the_blocks_do_not_run_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"names \['cat'\]: the copies are bshd, kv_repeat, rotary_patch, rope_concat"):
        block(["cat"])
    with pytest.raises(ConfigError, match="rope_concat, copies of the rotary embedding, which model gpt does not run"):
        block(["rope_concat"], HEADS, style="gpt")
    assert kernel(block(["bshd"], HEADS, style="gpt"), "attn_layout").launches == 4  # a GPT block's attention copies too
    with pytest.raises(ConfigError, match="model unet has no transformer block whose self-attention they copy around"):
        validate(composed(["model=unet", "model.attention_copies=[bshd]"]))


def test_the_front_door_takes_it_for_every_model() -> None:
    layers = validate(composed(["model=mllm_9b", "model.scale=tiny", "model.attention_copies=[bshd]"])).model.unit("llm").layers
    assert kernel(layers[1], "attn_layout").launches == 4
    clip = validate(composed(["model=clip", "model.attention_copies=[bshd,kv_repeat]"])).model
    assert all(len(copies_of(layer)) == 2 for unit in clip.units for layer in unit.layers if layer.block)
