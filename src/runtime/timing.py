"""Measured time of one rank's step, in the simulator's breakdown categories.

A compute instruction's wall time, minus the collectives measured inside it (TP
all-reduces, the batch-sync gather), is compute; those collectives are exposed
communication of their kind. Waiting on a pipeline peer is a bubble (warm-up before the
rank's first backward, cool-down after its last forward, imbalance between), as the
simulator classifies it; elsewhere it is communication. Time between instructions and
after the rank's last one until the slowest rank finishes is idle.

DeepSpeed's collectives (gradient reductions and parameter gathers, inside
`engine.step()` and backward) are timed one by one by
its comms logger (runtime.engines.deepspeed_comm_seconds) and charged to comm_dp; only
the wait of an asynchronous ZeRO-3 all-gather stays inside compute, as measured_notes says.
"""

from __future__ import annotations

from src.program import Collective, Compute, Instruction, Recv, Send, Wait
from src.timeline import BREAKDOWN_CATEGORIES, Span


class StepTimer:
    def __init__(self, instructions: list[Instruction], pipelined: bool) -> None:
        self.pipelined = pipelined
        forwards = [i for i, ins in enumerate(instructions) if isinstance(ins, Compute) and ins.work.phase == "fwd"]
        self.last_forward = forwards[-1] if forwards else -1
        self.instructions = instructions
        self.reset(0.0)

    def reset(self, origin: float) -> None:
        self.origin = origin
        self.breakdown = {cat: 0.0 for cat in BREAKDOWN_CATEGORIES}
        self.spans: list[Span] = []
        self.seen_backward = False
        self.index = -1
        self.end = 0.0

    def record(self, instruction: Instruction, start: float, end: float, category: str, comm: dict[str, float]) -> None:
        self.index += 1
        start, end = start - self.origin, end - self.origin
        self.end = end
        if category == "marker":
            return
        seconds = end - start
        if category == "compute":
            inner = sum(comm.values())
            for kind, value in comm.items():
                self.breakdown[f"comm_{kind}"] += value
            self.breakdown["compute"] += max(0.0, seconds - inner)
            work = getattr(instruction, "work", None)
            microbatch = getattr(instruction, "microbatch", -1)
            if work is not None and work.phase in ("bwd", "interaction"):
                self.seen_backward = True
            name = f"{work.phase} {work.unit} L{work.layers[0]}-{work.layers[1]}" if work else "compute"
            self.spans.append(Span("compute", start, end, name, "compute", work.unit if work else "", microbatch))
            return
        if category.startswith("wait:"):
            category = self._wait_category(category.split(":", 1)[1])
        self.breakdown[category] += seconds
        stream = getattr(instruction, "stream", "compute")
        self.spans.append(Span(stream, start, end, _name(instruction), category))

    def _wait_category(self, kind: str) -> str:
        if not self.pipelined:
            return f"comm_{kind}"
        if not self.seen_backward:
            return "bubble_warmup"
        if self.index > self.last_forward:
            return "bubble_cooldown"
        return "bubble_imbalance"

    def finish(self, iteration_time: float) -> dict[str, float]:
        """The breakdown, with idle making it add up to the iteration time."""
        busy = sum(v for k, v in self.breakdown.items() if k != "idle")
        self.breakdown["idle"] = max(0.0, iteration_time - busy)
        return dict(self.breakdown)


def _name(instruction: Instruction) -> str:
    if isinstance(instruction, Recv):
        return f"recv {instruction.payload}"
    if isinstance(instruction, Send):
        return f"send {instruction.payload}"
    if isinstance(instruction, Wait):
        return f"wait {instruction.handle}"
    assert isinstance(instruction, Collective)
    return f"{instruction.op} {instruction.group}"
