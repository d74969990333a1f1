"""Full recompute re-runs a layer's forward in its backward, TP collectives included
(Megatron-LM's tensor_parallel.checkpoint, torch.utils.checkpoint): a fully recomputed
block's backward pays 4 TP all-reduces where a kept or selectively recomputed one pays 2,
each beside the GEMM StepCCL pairs it with."""

from __future__ import annotations

import pytest

from src.costmodel.comm import CommModel
from src.models.layers import transformer_layer
from src.models.registry import build_model
from src.program import Collective, Compute
from src.sim.engine import simulate
from src.strategies import planner_for
from tests.strategies.megatron.test_megatron import GPT_SMALL, request

SEQ, HIDDEN, MICRO, BLOCKS, MICROBATCHES = 2048, 1024, 2, 8, 4


def test_a_layer_s_tp_collectives_per_pass() -> None:
    block = next(layer for layer in build_model(GPT_SMALL).unit("llm").layers if layer.tp_allreduces)
    assert block.tp_allreduces == 2
    assert [block.tp_collectives(False, r) for r in ("none", "selective", "full")] == [2, 2, 2]
    assert [block.tp_collectives(True, r) for r in ("none", "selective", "full")] == [2, 2, 4]


def _plan(recompute: str):
    req = request(
        GPT_SMALL, "perlmutter", 1, MICRO * MICROBATCHES, tp=4, pp=1, vpp=1, micro_batch_size=MICRO,
        recompute=recompute, zero_stage=0, sequence_parallel=False,
    )  # fmt: skip
    return req, planner_for("megatron")(req)


def _counts_by_phase(instructions) -> dict[str, int]:
    counts = {"fwd": 0, "bwd": 0}
    phase = None
    for instruction in instructions:
        if isinstance(instruction, Compute):
            phase = instruction.work.phase
        elif isinstance(instruction, Collective) and instruction.kind == "tp":
            counts[phase] += instruction.count
    return counts


@pytest.mark.parametrize("recompute,backward", [("none", 2), ("selective", 2), ("full", 4)])
def test_the_program_holds_the_recomputed_forward_s_all_reduces(recompute: str, backward: int) -> None:
    _, built = _plan(recompute)
    (rank,) = {tuple(c.instructions) for c in built.program.classes}
    assert _counts_by_phase(rank) == {"fwd": 2 * BLOCKS * MICROBATCHES, "bwd": backward * BLOCKS * MICROBATCHES}


def test_the_simulator_prices_them_on_the_compute_stream() -> None:
    """One node, no pipeline: the exposed TP time is every all-reduce end to end, each
    priced as the cluster's collective model prices a 4-way all-reduce of one micro-batch's
    activations."""
    req, kept = _plan("none")
    _, full = _plan("full")
    one = CommModel(req.cluster).collective_time("all_reduce", (0, 1, 2, 3), SEQ * HIDDEN * MICRO * 2)
    tp_s = {
        name: simulate(built.program, req.model, req.cluster, "bf16").mean_breakdown()["comm_tp"]
        for name, built in (("kept", kept), ("full", full))
    }
    assert tp_s["kept"] == pytest.approx(4 * BLOCKS * MICROBATCHES * one, rel=1e-9)
    assert tp_s["full"] == pytest.approx(6 * BLOCKS * MICROBATCHES * one, rel=1e-9)


def test_a_layer_s_stepccl_pairs_name_the_gemm_beside_each_collective() -> None:
    """A block's forward all-reduces follow its row-parallel products (attention's output
    projection, fc2); its backward's follow the column-parallel ones' input gradients (qkv,
    fc1); under sequence parallelism each is a reduce-scatter beside one product and an
    all-gather beside the next; a fully recomputed backward pairs its forward's first."""
    block = transformer_layer(2048, 1024, 16, gated=True, bias=False, rotary=True)
    index = {kernel.name: i for i, kernel in enumerate(block.kernels)}
    qkv, proj, fc1, fc2 = index["attn_qkv"], index["attn_proj"], index["fc1"], index["fc2"]
    assert block.tp_pairs(False, "none", False) == ((("fwd", proj),), (("fwd", fc2),))
    assert block.tp_pairs(True, "selective", False) == ((("bwd", qkv),), (("bwd", fc1),))
    assert block.tp_pairs(False, "none", True) == ((("fwd", proj), ("fwd", fc1)), (("fwd", fc2), ("fwd", qkv)))
    assert block.tp_pairs(True, "none", True) == ((("bwd", proj), ("bwd", qkv)), (("bwd", fc2), ("bwd", fc1)))
    for backward in (False, True):
        for recompute in ("none", "selective", "full"):
            for sequence_parallel in (False, True):
                pairs = block.tp_pairs(backward, recompute, sequence_parallel)
                assert pairs is not None and len(pairs) == block.tp_collectives(backward, recompute)
    assert block.tp_pairs(True, "full", False)[:2] == block.tp_pairs(False, "full", False)
    # Cross-attention projects another unit's memory too: its products do not pair one to one.
    assert transformer_layer(256, 1024, 16, cross_seq=77, cross_hidden=768).tp_pairs(False, "none", False) is None
