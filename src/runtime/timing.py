"""Measured time of one rank's step, in the simulator's breakdown categories.

A compute instruction's wall time, minus the collectives measured inside it (TP
all-reduces, the batch-sync gather), is compute; those collectives are exposed
communication of their kind. Waiting on a pipeline peer is a bubble (warm-up before the
rank's first backward, cool-down after its last forward, imbalance between), as the
simulator classifies it; elsewhere it is communication. Time between instructions and
after the rank's last one until the slowest rank finishes is idle.

DeepSpeed's collectives (gradient reductions and parameter gathers, inside
`engine.step()` and backward) are timed one by one at its communication backend
(runtime.engines.time_deepspeed_comm) and charged to comm_dp; only
the wait of an asynchronous ZeRO-3 all-gather stays inside compute, as measured_notes says.
"""

from __future__ import annotations

from typing import NamedTuple

from src.program import Collective, Compute, Instruction, Recv, Send, Wait
from src.timeline import BREAKDOWN_CATEGORIES, Span


class _Static(NamedTuple):
    """What an instruction's span says beside its times: the same every step."""

    stream: str
    name: str
    unit: str
    microbatch: int
    backward: bool  # a backward or interaction pass: waits after it are no warm-up


def _static_of(instruction: Instruction) -> _Static:
    if isinstance(instruction, Compute):
        work = instruction.work
        name = f"{work.phase} {work.unit} L{work.layers[0]}-{work.layers[1]}"
        return _Static("compute", name, work.unit, instruction.microbatch, work.phase in ("bwd", "interaction"))
    return _Static(getattr(instruction, "stream", "compute"), _name(instruction), "", -1, False)


class StepTimer:
    """The breakdown and spans of one rank's step, one `record` per instruction in list
    order. Recording sits between every two instructions and runs cold after their
    work, so it does little: what an instruction's span says besides its times is worked
    out once here, and the spans are built from the last step's records when read."""

    def __init__(self, instructions: list[Instruction], pipelined: bool) -> None:
        self.pipelined = pipelined
        forwards = [i for i, ins in enumerate(instructions) if isinstance(ins, Compute) and ins.work.phase == "fwd"]
        self.last_forward = forwards[-1] if forwards else -1
        self._static = [_static_of(instruction) for instruction in instructions]
        self.reset(0.0)

    def reset(self, origin: float) -> None:
        self.origin = origin
        self.breakdown = {cat: 0.0 for cat in BREAKDOWN_CATEGORIES}
        self._records: list[tuple[int, float, float, str]] = []  # (instruction index, start, end, category)
        self.seen_backward = False
        self.index = -1
        self.end = 0.0

    @property
    def spans(self) -> list[Span]:
        spans = []
        for index, start, end, category in self._records:
            static = self._static[index]
            spans.append(Span(static.stream, start, end, static.name, category, static.unit, static.microbatch))
        return spans

    def record(self, start: float, end: float, category: str, comm: dict[str, float]) -> None:
        """The next instruction ran from `start` to `end` (perf_counter), `comm`: the
        seconds of the collectives timed inside it, by kind."""
        self.index += 1
        start, end = start - self.origin, end - self.origin
        self.end = end
        if category == "marker":
            return
        seconds = end - start
        if category == "compute":
            inner = 0.0
            if comm:
                inner = sum(comm.values())
                for kind, value in comm.items():
                    self.breakdown[f"comm_{kind}"] += value
            self.breakdown["compute"] += max(0.0, seconds - inner)
            if self._static[self.index].backward:
                self.seen_backward = True
            self._records.append((self.index, start, end, "compute"))
            return
        if category.startswith("wait:"):
            category = self._wait_category(category.split(":", 1)[1])
        self.breakdown[category] += seconds
        self._records.append((self.index, start, end, category))

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
