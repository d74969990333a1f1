"""model.cross_entropy: the loss over the vocabulary's logits as the software computes it:
PyTorch's cross entropy (in fp32 under autocast), Megatron-LM's vocab-parallel one on an fp32
copy, or one fused kernel each way."""

from __future__ import annotations

from dataclasses import replace

import pytest

from src.cluster import cluster_from_config
from src.config import composed
from src.costmodel.compute import ComputeModel
from src.mesh import Sharding, tensor_parallel
from src.models.cross_entropy import eager_logit_bytes
from src.models.registry import build_model
from src.setup import validate

GPT = {"name": "gpt", "preset": None, "layers": 2, "hidden": 1024, "heads": 16, "vocab": 32000}
SEQ = 2048
LOGITS = SEQ * 32000


def loss(mode: str):
    head = build_model({**GPT, "cross_entropy": mode}, SEQ).unit("llm").layers[-1]
    return next(kernel for kernel in head.kernels if kernel.cross_entropy)


def priced(mode: str, amp: bool, sharding: Sharding = Sharding()) -> tuple[float, float]:
    """The loss kernel's (forward, backward) bytes per logit on hopper, read back from its times."""
    cluster = replace(cluster_from_config(composed(["cluster=hopper"])["cluster"]), amp=amp)
    compute = ComputeModel(cluster, "bf16")
    times = compute.kernel_times(loss(mode), 1, sharding, 1)
    hbm, gap = cluster.memory_bandwidth * cluster.memory_efficiency, cluster.kernel_overhead_s
    return (times.fwd - gap) * hbm / LOGITS, (times.bwd_input - gap) * hbm / LOGITS


@pytest.mark.parametrize(
    ("mode", "plain", "autocast"),
    [("eager", (8, 10), (22, 26)), ("fp32", (38, 14), (38, 14)), ("fused", (2, 4), (2, 4))],
)
def test_each_mode_moves_its_bytes_a_logit_and_only_pytorchs_runs_in_fp32_under_autocast(
    mode: str, plain: tuple[int, int], autocast: tuple[int, int]
) -> None:
    """PyTorch's cross entropy over rows of 32,000 16-bit logits (62.5 KiB, more than a CUDA
    block's 48 KiB of shared memory) reads each row three times and writes it once forward;
    backward writes the loss's gradient, which log_softmax's backward reads twice with the
    saved output once, and writes the input's (8 and 10 bytes); under autocast the same in
    fp32, the logits cast up first and the gradient cast back (22 and 26).
    Megatron-LM's casts them itself and runs max, subtract, exp, sum, normalise (38), then
    scales the saved softmax and casts back (14). A fused kernel reads them once and writes
    the gradient over them (2 and 4)."""
    assert priced(mode, amp=False) == pytest.approx(plain)
    assert priced(mode, amp=True) == pytest.approx(autocast)


def test_pytorchs_softmax_reads_a_row_once_where_it_stays_on_chip() -> None:
    """A row that fits a block's shared memory (and divides into 16-byte vectors), or a warp,
    is read once forward; a longer one three times; backward reads it as often whatever it is.
    Vocab-parallel ranks hold narrower rows: 32,000 logits over TP 2 fit as 16-bit values, not
    as fp32 under autocast, which TP 4 brings on chip."""
    assert eager_logit_bytes(16000, 49152, amp=False) == (4.0, 10.0)
    assert eager_logit_bytes(16001, 49152, amp=False) == (8.0, 10.0)  # 32,002 bytes: not in float4s
    assert eager_logit_bytes(1000, 49152, amp=False) == (4.0, 10.0)  # a warp's, whatever its alignment
    assert eager_logit_bytes(1001, 49152, amp=False) == (4.0, 10.0)
    assert eager_logit_bytes(131072, 0, amp=False) == (4.0, 10.0)  # a CPU's caches hold the row
    assert eager_logit_bytes(24576, 65536, amp=False) == (4.0, 10.0)  # an MI250X's 64 KiB
    assert priced("eager", amp=False, sharding=tensor_parallel(2)) == pytest.approx((4 / 2, 10 / 2))
    assert priced("eager", amp=True, sharding=tensor_parallel(2)) == pytest.approx((22 / 2, 26 / 2))
    assert priced("eager", amp=True, sharding=tensor_parallel(4)) == pytest.approx((14 / 4, 26 / 4))


def test_vocab_parallelism_splits_the_loss_and_nothing_but_the_loss_changes() -> None:
    """The loss is vocab-parallel: each TP rank prices its share of the logits. The other
    kernels of the model are the same in every mode."""
    forward, backward = priced("fp32", amp=False, sharding=tensor_parallel(8))
    assert (forward * 8, backward * 8) == pytest.approx((38, 14))
    eager, fp32 = (build_model({**GPT, "cross_entropy": mode}, SEQ) for mode in ("eager", "fp32"))
    assert eager.unit("llm").layers[:-1] == fp32.unit("llm").layers[:-1]
    assert [k.name for k in eager.unit("llm").layers[-1].kernels] == [k.name for k in fp32.unit("llm").layers[-1].kernels]


def _loss_mode(*overrides: str) -> str:
    layers = validate(composed(["model=gpt", "model.preset=gpt_5b", *overrides])).model.unit("llm").layers
    return next(kernel.cross_entropy for kernel in layers[-1].kernels if kernel.cross_entropy)


def test_the_default_is_the_presets_software_a_strategys_codebase_or_the_models_option() -> None:
    """Megatron-LM's testbeds compute it in fp32 (hopper, a800, dgx_a100, perlmutter), LitGPT on
    Frontier and the real backend in PyTorch; DeepSpeed-3D's codebase (Megatron-LM v1.1.5) in
    fp32 on any preset; model.cross_entropy wins over both."""
    presets = {
        name: cluster_from_config(composed([f"cluster={name}"])["cluster"]).cross_entropy
        for name in ("hopper", "a800", "dgx_a100", "perlmutter", "frontier", "p3_16xlarge", "local")
    }
    assert presets == {
        "hopper": "fp32",
        "a800": "fp32",
        "dgx_a100": "fp32",
        "perlmutter": "fp32",
        "frontier": "eager",
        "p3_16xlarge": "eager",
        "local": "eager",
    }
    assert _loss_mode("cluster=frontier", "cluster.nodes=8") == "eager"
    assert _loss_mode("cluster=frontier", "cluster.nodes=8", "strategy=deepspeed3d") == "fp32"
    assert _loss_mode("cluster=frontier", "cluster.nodes=8", "strategy=deepspeed3d", "strategy.cross_entropy=null") == "eager"
    assert _loss_mode("cluster=frontier", "cluster.nodes=8", "strategy=deepspeed3d", "model.cross_entropy=fused") == "fused"


def test_each_mode_keeps_what_its_backward_reads() -> None:
    """PyTorch's cross entropy keeps log_softmax's 16-bit output, Megatron-LM's its fp32
    softmax, a fused kernel the logits it writes the gradient over: 2, 4 and 2 bytes a logit,
    an activation of the head that tensor parallelism splits with the vocabulary."""

    def head(mode: str):
        return build_model({**GPT, "cross_entropy": mode}, SEQ).unit("llm").layers[-1].activations

    assert {mode: head(mode).split / LOGITS for mode in ("eager", "fp32", "fused")} == {"eager": 2, "fp32": 4, "fused": 2}
    assert head("fp32").replicated == head("eager").replicated
