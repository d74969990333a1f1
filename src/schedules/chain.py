"""The end-to-end pipeline's schedule: one 1F1B over the encoder's, the LLM's and the
generator's stages, a unit's stages interleaved where it holds vpp > 1 virtual stages
per stage (Megatron-LM's interleaved 1F1B inside a unit, DistTrain §7).

Without interleaving it is PipeDream-flush 1F1B over all the stages (stage g warms up
with depth - g - 1 forwards). With it, every stage runs its forwards in Megatron-LM's
order (an interleaved unit's stages take micro-batches through their chunks in groups of
pp; the others one chunk, in order) and its backwards likewise. An interleaved stage
runs Megatron-LM's order: (pp - s - 1) x 2 + (vpp - 1) x pp warm-up forwards, and two
chunk forwards' worth more for each forward and backward of the stages after its unit,
then one forward and one backward in turn. The other stages follow them: the orders are
those of one execution in steps where such a stage runs a backward whenever its
gradient is there, else a forward, keeping in flight as many as it can start before its
first gradient can come back (a unit's interleaved groups hand micro-batches on in
bursts, and a fixed warm-up count before or after them could wait on itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from src.errors import ConfigError
from src.schedules.pipeline import PipeOp, one_f_one_b


class Deadlock(ConfigError):
    """Orders that wait on each other: several interleaved units whose fixed orders
    hand each other micro-batches in incompatible turns."""


@dataclass(frozen=True)
class Chain:
    """The pipeline's virtual stages in order: each unit's pp x vpp (virtual stage c x pp +
    s of a unit runs on its stage s), stage after stage of the chain."""

    units: tuple[tuple[int, int], ...]  # (pp, vpp) per unit, in chain order

    @property
    def depth(self) -> int:
        return sum(pp for pp, _ in self.units)

    @property
    def virtual_stages(self) -> int:
        return sum(pp * vpp for pp, vpp in self.units)

    def virtual_of(self) -> list[list[int]]:
        """Per stage of the chain, its chunks' virtual stages (chain numbering)."""
        out: list[list[int]] = []
        first = 0
        for pp, vpp in self.units:
            out += [[first + c * pp + s for c in range(vpp)] for s in range(pp)]
            first += pp * vpp
        return out

    @property
    def interleaved(self) -> bool:
        return any(vpp > 1 for _, vpp in self.units)


def chain_orders(chain: Chain, microbatches: int) -> list[list[PipeOp]]:
    """Every stage's order of forwards and backwards (PipeOp chunks: the stage's own)."""
    if not chain.interleaved:
        return one_f_one_b(chain.depth, microbatches)
    for pp, vpp in chain.units:
        if vpp > 1 and microbatches % pp:
            raise ConfigError(f"an interleaved unit of pp={pp} needs micro-batches ({microbatches}) divisible by its pipeline stages")
    sequences = [_sequence(pp, vpp, microbatches) for pp, vpp in chain.units for _ in range(pp)]
    virtual_of = chain.virtual_of()
    caps = _caps(virtual_of, sequences, microbatches)
    fixed: list[list[PipeOp] | None] = []
    for index, (pp, vpp) in enumerate(chain.units):
        after = sum(p for p, _ in chain.units[index + 1 :])
        for s in range(pp):
            # Megatron-LM's warm-up, and a forward and a backward of vpp chunks' length
            # for each stage of the units after it (the round trip Megatron-LM counts as
            # two chunk forwards per stage of its own).
            warmup = (pp - s - 1) * 2 + (vpp - 1) * pp + 2 * vpp * after
            fixed.append(_alternating(sequences[len(fixed)], vpp, warmup) if vpp > 1 else None)
    return _list_schedule(virtual_of, sequences, caps, fixed)


def _alternating(sequence: list[tuple[int, int]], vpp: int, warmup: int) -> list[PipeOp]:
    """Megatron-LM's interleaved order: the warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards."""
    forwards = [PipeOp("F", c, j) for c, j in sequence]
    backwards = [PipeOp("B", c, j) for c, j in _backward(sequence, vpp)]
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        order += (f, b)
    return order + backwards[len(forwards) - warmup :]


def _sequence(pp: int, vpp: int, microbatches: int) -> list[tuple[int, int]]:
    """(chunk, micro-batch) of a stage's forwards: Megatron-LM's groups of pp micro-batches."""
    if vpp == 1:
        return [(0, j) for j in range(microbatches)]
    out = []
    for k in range(microbatches * vpp):
        group, within = divmod(k, pp * vpp)
        out.append((within // pp, group * pp + within % pp))
    return out


def _backward(sequence: list[tuple[int, int]], vpp: int) -> list[tuple[int, int]]:
    """The backwards' order: the forwards' with the chunks reversed."""
    return [(vpp - 1 - c, j) for c, j in sequence]


def _ticks(virtual_of: list[list[int]]) -> tuple[list[int], list[int]]:
    """Per virtual stage, a forward's and a backward's length in ticks: a stage's
    micro-batch a forward of `lcm` ticks and a backward of twice that, split evenly over
    its chunks (a lone interleaved stage's chunks then take one and two ticks)."""
    lcm = math.lcm(*(len(chunks) for chunks in virtual_of))
    forward = [0] * (max(v for chunks in virtual_of for v in chunks) + 1)
    for chunks in virtual_of:
        for v in chunks:
            forward[v] = lcm // len(chunks)
    return forward, [2 * f for f in forward]


def _caps(virtual_of: list[list[int]], sequences: list[list[tuple[int, int]]], microbatches: int) -> list[int]:
    """How many forwards a stage of one chunk keeps in flight: those it can start before
    its first backward's gradient can arrive, forwards as early as their inputs and
    their stage allow and backwards coming back one after the other (_ticks)."""
    forward, backward = _ticks(virtual_of)
    last = len(forward) - 1
    start = [[-1] * microbatches for _ in range(last + 1)]
    position, clock = [0] * len(sequences), [0] * len(sequences)
    remaining = sum(len(s) for s in sequences)
    while remaining:
        for g, sequence in enumerate(sequences):
            while position[g] < len(sequence):
                c, j = sequence[position[g]]
                v = virtual_of[g][c]
                if v and start[v - 1][j] < 0:
                    break
                start[v][j] = max(clock[g], start[v - 1][j] + forward[v - 1] if v else 0)
                clock[g] = start[v][j] + forward[v]
                position[g] += 1
                remaining -= 1
    out = []
    for g, sequence in enumerate(sequences):
        c, j = _backward(sequence, len(virtual_of[g]))[0]
        v = virtual_of[g][c]
        gradient = start[last][j] + forward[last] + sum(backward[v + 1 :])  # back through the stages after it
        out.append(max(1, sum(1 for c, j in sequence if start[virtual_of[g][c]][j] < gradient)))
    return out


def _list_schedule(
    virtual_of: list[list[int]], sequences: list[list[tuple[int, int]]], caps: list[int], fixed: list[list[PipeOp] | None]
) -> list[list[PipeOp]]:
    """The orders of one execution in ticks (_ticks): an interleaved stage runs its
    `fixed` order, every other stage, when free, its next backward if its gradient has
    arrived, else its next forward if its input has and fewer than its cap of forwards
    are in flight. Any durations then run these orders without a deadlock: they are the
    stages' orders of one execution. (Should every stage wait with nothing under way, the
    caps of those held by them grow by one.)"""
    forward, backward = _ticks(virtual_of)
    last = len(forward) - 1
    microbatches = max(j for sequence in sequences for _, j in sequence) + 1
    f_done = [[-1] * microbatches for _ in range(last + 1)]  # the tick its output is ready
    b_done = [[-1] * microbatches for _ in range(last + 1)]
    backwards = [_backward(sequence, len(virtual_of[g])) for g, sequence in enumerate(sequences)]
    nf, nb, free = [0] * len(sequences), [0] * len(sequences), [0] * len(sequences)
    orders: list[list[PipeOp]] = [[] for _ in sequences]
    caps = list(caps)
    step = 0

    def ready(g: int, op: PipeOp) -> bool:
        v = virtual_of[g][op.chunk]
        if op.kind == "F":
            return v == 0 or 0 <= f_done[v - 1][op.microbatch] <= step
        return 0 <= f_done[v][op.microbatch] <= step and (v == last or 0 <= b_done[v + 1][op.microbatch] <= step)

    def run(g: int, op: PipeOp) -> None:
        v = virtual_of[g][op.chunk]
        if op.kind == "F":
            f_done[v][op.microbatch] = free[g] = step + forward[v]
            nf[g] += 1
        else:
            b_done[v][op.microbatch] = free[g] = step + backward[v]
            nb[g] += 1
        orders[g].append(op)

    latest = 0  # the last step at which an operation's output becomes ready
    while any(nb[g] < len(backwards[g]) for g in range(len(sequences))):
        ran = False
        for g, sequence in enumerate(sequences):
            if free[g] > step:
                ran = True
                continue
            order = fixed[g]
            if order is not None:
                if len(orders[g]) < len(order) and ready(g, order[len(orders[g])]):
                    run(g, order[len(orders[g])])
                    latest = max(latest, free[g])
                    ran = True
                continue
            if nb[g] < min(nf[g], len(backwards[g])):
                c, j = backwards[g][nb[g]]
                if ready(g, PipeOp("B", c, j)):
                    run(g, PipeOp("B", c, j))
                    latest = max(latest, free[g])
                    ran = True
                    continue
            if nf[g] < len(sequence) and nf[g] - nb[g] < caps[g] and ready(g, PipeOp("F", *sequence[nf[g]])):
                run(g, PipeOp("F", *sequence[nf[g]]))
                latest = max(latest, free[g])
                ran = True
        if not ran and latest <= step:
            held = [g for g in range(len(sequences)) if fixed[g] is None and nf[g] < len(sequences[g]) and nf[g] - nb[g] >= caps[g]]
            if not held:
                raise Deadlock("the interleaved units' orders wait on each other")
            for g in held:
                caps[g] += 1
        step += 1
    return orders
