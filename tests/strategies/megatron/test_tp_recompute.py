"""Full recompute re-runs a layer's forward in its backward, TP collectives included
(Megatron-LM's tensor_parallel.checkpoint, torch.utils.checkpoint): a fully recomputed
block's backward pays 4 TP all-reduces where a kept or selectively recomputed one pays 2."""

from __future__ import annotations

import pytest

from src.costmodel.comm import CommModel
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
