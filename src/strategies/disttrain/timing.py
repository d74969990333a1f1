"""The end-to-end pipeline's iteration as DistTrain's Program runs it, for the planner's
best few choices (the orchestration's 1F1B model ranks many; this times a few closely).

Every stage runs its schedule order (schedules.chain.chain_orders: one end-to-end 1F1B, a
unit's stages interleaved where it holds several chunks); an operation starts when its
stage is free and its input has arrived: a forward when the previous stage's
forward of its micro-batch has crossed over (a unit's own hop, or a broker between
units), a backward when the next stage's backward has sent its gradient back. Each
operation takes the seconds of its micro-batch's load on its unit (data heterogeneity,
after the reordering): LLM replicas joined through a shared encoder or generator replica
run in step (data.py's pipelines of lcm(b_me, b_mg) replicas), so each such group is
timed as one graph of its replicas' stages, each replica with its own loads: a shared
replica's forward feeds every replica it serves, and its backward waits for all of
their gradients. A stage's iteration ends with its tail (gradient reduction over all
replicas, optimizer step, parameter gather) once every group's last operation there has
ended.

What it leaves out, and the simulator does not: link contention between transfers that
overlap in time, and sends queued behind one another on a stage's send stream; and it
scales a pass's TP collectives by its load whole, latency included, where the Program
scales their bytes only.
"""

from __future__ import annotations

from typing import Sequence

from src.schedules.pipeline import PipeOp


Hop = tuple[int, float, float]  # (virtual stage before, seconds forward, seconds back)


def dag_ends(
    orders: list[list[PipeOp]],
    virtual_of: list[list[int]],
    fwd: Sequence[Sequence[float]],
    bwd: Sequence[Sequence[float]],
    before: Sequence[Sequence[Hop]],
    trains: Sequence[bool],
) -> list[float]:
    """When each stage's last operation ends. Stage g's chunk c is virtual stage
    virtual_of[g][c]; fwd[v][j], bwd[v][j]: virtual stage v's seconds for micro-batch j;
    before[v]: the virtual stages whose forward v's forward waits for, each with the
    seconds its output takes to v and v's gradient back (a replica fed by a shared one,
    or feeding one: several); a backward waits for the backwards of every virtual stage
    after it that trains (a frozen unit's stage neither runs nor waits for them)."""
    microbatches = len(fwd[0])
    inputs = [[(u, there) for u, there, _ in hops] for hops in before]
    grads: list[list[tuple[int, float]]] = [[] for _ in fwd]
    for v, hops in enumerate(before):
        for u, _, back in hops:
            if trains[v]:
                grads[u].append((v, back))
    f_end = [[-1.0] * microbatches for _ in fwd]
    b_end = [[-1.0] * microbatches for _ in fwd]
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
                    ready = _arrival(f_end, inputs[v], j, 0.0)
                    if ready is None:
                        break
                    t = (t if t > ready else ready) + fwd[v][j]
                    f_end[v][j] = t
                elif trains[v]:
                    ready = _arrival(b_end, grads[v], j, f_end[v][j])
                    if ready is None:
                        break
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


def _arrival(ends: list[list[float]], sources: list[tuple[int, float]], j: int, ready: float) -> float | None:
    """When micro-batch j's inputs from `sources` (virtual stage, seconds on the way) have
    all arrived, no earlier than `ready`; None while one of them has not ended."""
    for u, seconds in sources:
        done = ends[u][j]
        if done < 0:
            return None
        ready = max(ready, done + seconds)
    return ready
