"""The end-to-end pipeline's iteration as DistTrain's Program runs it, for the planner's
best few choices (the orchestration's 1F1B model ranks many; this times a few closely).

Every stage runs its schedule order (schedule.chain_orders: one end-to-end 1F1B, a
unit's stages interleaved where it holds several chunks); an operation starts when its
stage is free and its input has arrived: a forward when the previous stage's
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
    virtual_of: list[list[int]],
    fwd: Sequence[Sequence[float]],
    bwd: Sequence[Sequence[float]],
    forward_hop: Sequence[float],
    backward_hop: Sequence[float],
    trains: Sequence[bool],
) -> list[float]:
    """When each stage's last operation ends. Stage g's chunk c is virtual stage
    virtual_of[g][c] of the chain; fwd[v][j], bwd[v][j]: virtual stage v's seconds for
    micro-batch j; forward_hop[v] (backward_hop[v]): from virtual stage v to v + 1 (back);
    trains[v]: whether virtual stage v runs backwards (a frozen unit's stage neither runs
    nor waits for them)."""
    last = len(fwd) - 1
    microbatches = len(fwd[0])
    f_end = [[-1.0] * microbatches for _ in range(last + 1)]
    b_end = [[-1.0] * microbatches for _ in range(last + 1)]
    ops = [[(op.kind == "F", virtual_of[g][op.chunk], op.microbatch) for op in order] for g, order in enumerate(orders)]
    position, clock = [0] * len(orders), [0.0] * len(orders)
    remaining = sum(len(order) for order in ops)
    while remaining:
        progressed = False
        for g, order in enumerate(ops):
            x, t = position[g], clock[g]
            while x < len(order):
                forward, v, j = order[x]
                if forward:
                    ready = 0.0
                    if v:
                        arrived = f_end[v - 1][j]
                        if arrived < 0:
                            break
                        ready = arrived + forward_hop[v - 1]
                    t = (t if t > ready else ready) + fwd[v][j]
                    f_end[v][j] = t
                elif trains[v]:
                    ready = f_end[v][j]
                    if v < last and trains[v + 1]:
                        arrived = b_end[v + 1][j]
                        if arrived < 0:
                            break
                        ready = arrived + backward_hop[v]
                    t = (t if t > ready else ready) + bwd[v][j]
                    b_end[v][j] = t
                else:
                    b_end[v][j] = f_end[v][j]
                x += 1
            if x != position[g]:
                remaining -= x - position[g]
                position[g], clock[g] = x, t
                progressed = True
        if not progressed:
            raise RuntimeError("the end-to-end pipeline's schedule deadlocks")
    return clock
