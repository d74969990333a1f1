"""DeepSpeed's pipeline engine exchanges payloads in its TrainSchedule's step order, each send a
synchronous broadcast the sender waits on (strategy.p2p=deepspeed, which deepspeed3d sets);
Megatron-LM's pipeline sends each payload as soon as its pass ends."""

from __future__ import annotations

import pytest

from src.errors import ConfigError
from src.program import COMPUTE_STREAM, Compute, Plan, Recv, Send
from src.setup import plan_run, validate
from src.sim.engine import simulate
from tests.composing import composed
from tests.strategies.node_gpt import node_gpt

PP, MICROBATCHES = 4, 6
# A GPT of 8 blocks on one 8-GPU node at TP 2, PP 4 (one replica), so a stage sends and receives both ways.
BASE = node_gpt(8, MICROBATCHES) + ["strategy.tp=2", f"strategy.pp={PP}", "strategy.micro_batch_size=1", "strategy.recompute=none"]


def train_schedule(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """DeepSpeed's TrainSchedule.steps (deepspeed/runtime/pipe/schedule.py at v0.3.15) for one
    stage, restated: its exchanges and passes in order, each with its micro-batch."""
    out: list[tuple[str, int]] = []
    valid = range(microbatches).__contains__
    prev = -1
    for step in range(2 * (microbatches + stages - 1)):
        forward = step % 2 == stage % 2
        if forward:
            mb = (step if step % 2 == 0 else step - 1) // 2 - stage // 2
        elif step % 2 == 0:
            mb = step // 2 - stages + (stage + 1) // 2
        else:
            mb = (step - 1) // 2 - stages + 1 + stage // 2
        if forward:
            if valid(mb) and stage > 0:
                out.append(("RecvActivation", mb))
            if valid(prev) and stage > 0:
                out.append(("SendGrad", prev))
        else:
            if valid(prev) and stage < stages - 1:
                out.append(("SendActivation", prev))
            if valid(mb) and stage < stages - 1:
                out.append(("RecvGrad", mb))
        if valid(mb):
            out.append(("ForwardPass" if forward else "BackwardPass", mb))
        prev = mb
    return out


def _exchanges(plan: Plan, stage: int) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for i in plan.program.classes[stage].instructions:
        if isinstance(i, Compute) and i.work.phase in ("fwd", "bwd"):
            out.append(("ForwardPass" if i.work.phase == "fwd" else "BackwardPass", i.microbatch))
        elif isinstance(i, (Send, Recv)) and i.route.startswith("hop"):
            verb = "Send" if isinstance(i, Send) else "Recv"
            out.append((verb + ("Grad" if i.payload.grad else "Activation"), i.payload.microbatch))
    return out


def _plan(*extra: str) -> Plan:
    return plan_run(validate(composed(BASE + list(extra))))


def test_deepspeed3d_exchanges_in_its_train_schedules_order() -> None:
    plan = _plan("strategy=deepspeed3d")
    for stage in range(PP):
        assert _exchanges(plan, stage) == train_schedule(stage, PP, MICROBATCHES), stage
    sends = [i for rp in plan.program.classes for i in rp.instructions if isinstance(i, Send)]
    assert sends and all(s.rendezvous and s.stream == COMPUTE_STREAM for s in sends)


def test_megatron_sends_as_each_pass_ends_unless_told_deepspeeds_order() -> None:
    megatron = ["strategy=megatron", "strategy.vpp=1", "strategy.schedule=1f1b", "strategy.zero_stage=0"]
    setup = validate(composed(BASE + megatron))
    eager = plan_run(setup)
    assert _exchanges(eager, 1) != train_schedule(1, PP, MICROBATCHES)
    assert not any(i.rendezvous for rp in eager.program.classes for i in rp.instructions if isinstance(i, Send))
    ordered = _plan(*megatron, "strategy.p2p=deepspeed")
    assert _exchanges(ordered, 1) == train_schedule(1, PP, MICROBATCHES)
    # Sends that wait for their receivers, later in the step order, never make a step faster.
    eager_s, ordered_s = (
        simulate(plan.program, setup.model, setup.cluster, setup.train.precision).iteration_time for plan in (eager, ordered)
    )
    assert ordered_s > eager_s


@pytest.mark.parametrize(
    "extra, message",
    [
        (["strategy.p2p=nccl"], r"strategy.p2p='nccl'; choose one of \['eager', 'deepspeed'\]"),
        (["strategy.p2p=deepspeed"], r"set strategy.schedule=1f1b \(got null, which leaves it to the search\)"),
        (
            ["strategy.p2p=deepspeed", "strategy.schedule=interleaved", "strategy.vpp=2"],
            r"strategy.p2p=deepspeed exchanges in the order of DeepSpeed's TrainSchedule, a 1F1B without virtual stages: "
            r"set strategy.schedule=1f1b \(got interleaved\)",
        ),
    ],
)
def test_a_bad_p2p_is_one_line(extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _plan("strategy=megatron", *extra)
