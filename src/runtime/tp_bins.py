"""Work a plan places in a pass's TP bins (Optimus §4.3: encoder kernels scheduled while an
LLM operation's TP all-reduces travel), as the real backend finds it in a rank's list.

A plan says it so: a whole pass (its layers' own TP collectives inside it), then the
asynchronous TP collectives that stand for them (markers, each with a handle), then the
work that runs while they travel (a Compute of another unit among it), then the waits of
those handles. The executor runs the pass with its last TP collective issued and not yet
waited for while the work runs (runtime.comm.BINS).
"""

from __future__ import annotations

from dataclasses import dataclass

from src.program import Collective, Compute, Instruction, Wait


@dataclass(frozen=True)
class Binned:
    """Positions in a rank's list: the pass, its markers, the work in its bins, its waits."""

    compute: int
    markers: range
    work: range
    waits: range


def _is_marker(instruction: Instruction) -> bool:
    """An asynchronous TP collective that a layer runs inside its pass (no payloads)."""
    return (
        isinstance(instruction, Collective)
        and instruction.kind == "tp"
        and not instruction.blocking
        and instruction.handle is not None
        and not (instruction.inputs or instruction.outputs)
    )


def find_bins(instructions: list[Instruction]) -> dict[int, Binned]:
    """Every pass of `instructions` whose TP bins hold work, by the pass's position."""
    out: dict[int, Binned] = {}
    for index, instruction in enumerate(instructions):
        if not (isinstance(instruction, Compute) and _whole(instruction)):
            continue
        end = index + 1
        while end < len(instructions) and _is_marker(instructions[end]):
            end += 1
        handles = {i.handle for i in instructions[index + 1 : end] if isinstance(i, Collective)}
        if not handles:
            continue
        first_wait = end
        while first_wait < len(instructions) and not _waits_for(instructions[first_wait], handles):
            first_wait += 1
        last_wait = first_wait
        while last_wait < len(instructions) and _waits_for(instructions[last_wait], handles):
            last_wait += 1
        if last_wait - first_wait != len(handles):  # not every marker waited for, together
            continue
        work = range(end, first_wait)
        unit = instruction.work.unit
        if any(isinstance(instructions[i], Compute) and instructions[i].work.unit != unit for i in work):  # type: ignore[union-attr]
            out[index] = Binned(index, range(index + 1, end), work, range(first_wait, last_wait))
    return out


def _whole(compute: Compute) -> bool:
    """A pass run at once (not a kernel range or a chunk of one)."""
    work = compute.work
    return work.kernels is None and work.chunks == 1 and work.fraction == 1.0 and not work.sharding.grid


def _waits_for(instruction: Instruction, handles: set[str | None]) -> bool:
    return isinstance(instruction, Wait) and instruction.handle in handles
