"""Pipeline transfers under TP (stages.stage_transfer): Megatron-LM's scatter/gather sends
1/tp of a stage's activation per TP rank and all-gathers it on the receiving stage;
under sequence parallelism each rank sends its own s/tp tokens and nothing is gathered."""

from __future__ import annotations

import pytest

from src.program import Collective, Recv
from src.sim.engine import simulate
from src.strategies import planner_for
from src.strategies.builders.stages import StageTransfer, stage_transfer
from tests.strategies.megatron.test_megatron import GPT_SMALL, request

SEQ, HIDDEN, MICRO = 2048, 1024, 2  # GPT_SMALL's boundary: seq x hidden per sample, 2 bytes (bf16)
FULL = SEQ * HIDDEN * MICRO * 2


def test_stage_transfer_follows_megatron() -> None:
    assert stage_transfer(800, 1, False, True) == StageTransfer(800)
    assert stage_transfer(800, 4, False, True) == StageTransfer(200, 800)
    assert stage_transfer(800, 4, False, False) == StageTransfer(800)
    assert stage_transfer(800, 4, True, True) == StageTransfer(200)
    assert stage_transfer(800, 4, True, False) == StageTransfer(200)


def plan(sequence_parallel: bool, scatter_gather: bool):
    return planner_for("megatron")(
        request(
            GPT_SMALL,
            "perlmutter",
            4,
            64,
            tp=4,
            pp=2,
            vpp=1,
            micro_batch_size=MICRO,
            recompute="none",
            zero_stage=0,
            sequence_parallel=sequence_parallel,
            scatter_gather=scatter_gather,
        )
    )


def gathers(rank_program) -> list[Collective]:
    return [i for i in rank_program.instructions if isinstance(i, Collective) and i.kind == "pp"]


@pytest.mark.parametrize(
    "sequence_parallel,scatter_gather,sent,gathered",
    [
        (False, True, FULL / 4, FULL),  # Megatron-LM's default without sequence parallelism
        (False, False, FULL, 0),  # --no-scatter-gather-tensors-in-pipeline
        (True, True, FULL / 4, 0),  # sequence parallel: each rank's s/tp tokens, nothing to gather
    ],
)
def test_each_tp_rank_sends_its_share_and_the_receiver_gathers(
    sequence_parallel: bool, scatter_gather: bool, sent: float, gathered: float
) -> None:
    built = plan(sequence_parallel, scatter_gather)
    assert built.program.routes["hop.v0"].bytes == sent
    stage0, stage1 = built.program.classes
    microbatches = built.unit("llm").num_microbatches
    for receiver in (stage1, stage0):  # activations forward, gradients backward
        ops = gathers(receiver)
        recvs = [i for i in receiver.instructions if isinstance(i, Recv)]
        assert len(recvs) == microbatches
        if not gathered:
            assert ops == []
            continue
        assert len(ops) == microbatches
        assert {(op.op, op.bytes, op.stream) for op in ops} == {("all_gather", gathered, "compute")}
        # The gather is on the receiving stage's own TP group, right after each receive.
        assert {op.group for op in ops} == {f"tp.s{0 if receiver is stage0 else 1}"}
        assert all(isinstance(receiver.instructions[receiver.instructions.index(op) - 1], Recv) for op in ops)


def test_scatter_gather_makes_a_cross_node_pipeline_faster() -> None:
    """TP 4 inside a Perlmutter node, four stages on different nodes: the NICs carry a
    quarter of the bytes and NVLink gathers them. (With two stages the hops saved land
    in the 1F1B schedule's bubbles.)"""

    def run(scatter_gather: bool):
        req = request(
            GPT_SMALL,
            "perlmutter",
            8,
            64,
            tp=4,
            pp=4,
            vpp=1,
            micro_batch_size=MICRO,
            recompute="none",
            zero_stage=0,
            sequence_parallel=False,
            scatter_gather=scatter_gather,
        )
        return simulate(planner_for("megatron")(req).program, req.model, req.cluster, "bf16")

    fast, slow = run(True), run(False)
    assert fast.iteration_time < slow.iteration_time
    assert fast.mean_breakdown()["comm_pp"] < slow.mean_breakdown()["comm_pp"]
