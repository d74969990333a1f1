"""The end-to-end pipeline's iteration as DistTrain's Program runs it, for the planner's
best few choices (the orchestration's 1F1B model ranks many; this times a few closely).

Every stage runs its schedule order (programs: one end-to-end 1F1B); an operation starts
when its stage is free and its input has arrived: a forward when the previous stage's
forward of its micro-batch has crossed over (a unit's own hop, or a broker between
units), a backward when the next stage's backward has sent its gradient back. Each
operation takes the seconds of its micro-batch's load on its unit (data heterogeneity,
after the reordering): LLM replicas joined through a shared encoder or generator replica
run in step (data.py's pipelines of lcm(b_me, b_mg) replicas), so each such group is
timed with, per micro-batch, its slowest replica's load on each unit. A stage's
iteration ends with its tail (gradient reduction over all replicas, optimizer step,
parameter gather) once every group's last operation there has ended.

What it leaves out, and the simulator does not: link contention between transfers that
overlap in time, and sends queued behind one another on a stage's send stream.
"""

from __future__ import annotations

from typing import Sequence

from src.schedules.pipeline import PipeOp


def stage_ends(
    orders: list[list[PipeOp]],
    fwd: Sequence[Sequence[float]],
    bwd: Sequence[Sequence[float]],
    forward_hop: Sequence[float],
    backward_hop: Sequence[float],
    trains: Sequence[bool],
) -> list[float]:
    """When each stage's last operation ends. fwd[g][j], bwd[g][j]: stage g's seconds for
    micro-batch j; forward_hop[g] (backward_hop[g]): from stage g to g + 1 (back);
    trains[g]: whether stage g runs backwards (a frozen unit's stage neither runs nor
    waits for them)."""
    depth = len(orders)
    microbatches = len(fwd[0])
    f_end = [[-1.0] * microbatches for _ in range(depth)]
    b_end = [[-1.0] * microbatches for _ in range(depth)]
    ops = [[(op.kind == "F", op.microbatch) for op in order] for order in orders]
    position, clock = [0] * depth, [0.0] * depth
    remaining = sum(len(order) for order in ops)
    while remaining:
        progressed = False
        for g in range(depth):
            x, t, order = position[g], clock[g], ops[g]
            while x < len(order):
                forward, j = order[x]
                if forward:
                    ready = 0.0
                    if g:
                        arrived = f_end[g - 1][j]
                        if arrived < 0:
                            break
                        ready = arrived + forward_hop[g - 1]
                    t = (t if t > ready else ready) + fwd[g][j]
                    f_end[g][j] = t
                elif trains[g]:
                    ready = f_end[g][j]
                    if g < depth - 1 and trains[g + 1]:
                        arrived = b_end[g + 1][j]
                        if arrived < 0:
                            break
                        ready = arrived + backward_hop[g]
                    t = (t if t > ready else ready) + bwd[g][j]
                    b_end[g][j] = t
                else:
                    b_end[g][j] = f_end[g][j]
                x += 1
            if x != position[g]:
                remaining -= x - position[g]
                position[g], clock[g] = x, t
                progressed = True
        if not progressed:
            raise RuntimeError("the end-to-end pipeline's schedule deadlocks")
    return clock
