"""Pipeline schedules as per-stage operation orders: GPipe, 1F1B, interleaved 1F1B.

A schedule says, for each pipeline stage, the order of its forward and backward passes
over (virtual chunk, micro-batch). Planners turn these orders into instructions; the
simulator and the runtime execute the same instructions, so there is one implementation
of each schedule.

1F1B bounds how far a stage runs ahead of the stages after it: stage s starts its first
backward after p - s - 1 warm-up forwards, so one micro-batch queues in front of the last
stage. Where the last stage's micro-batches take unequal times (an MLLM's generator on a
stage of its own, each micro-batch as heavy as its sequences' images), a slow one stalls
every stage before it and a quick one cannot give the time back. `extra_warmup` runs k
more warm-up forwards on every stage but the last: k more micro-batches queue in front of
it, which its quick micro-batches drain, at the memory of k more micro-batches' activations
a stage. Not under interleaving: there the last stage also runs the chain's middle (its first
chunk feeds stage 0's second), so stages before it running further ahead would wait on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from src.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, slots=True)
class PipeOp:
    kind: Literal["F", "B"]
    chunk: int
    microbatch: int


def gpipe(stages: int, microbatches: int) -> list[list[PipeOp]]:
    """All forwards, then all backwards in reverse micro-batch order: the last
    micro-batch is the last to finish its forward, so the last stage starts backward on
    it without waiting."""
    order = [PipeOp("F", 0, j) for j in range(microbatches)] + [PipeOp("B", 0, j) for j in reversed(range(microbatches))]
    return [list(order) for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int, warmups: Sequence[int] | None = None) -> list[list[PipeOp]]:
    """PipeDream-flush 1F1B: stage s runs min(p-s-1, m) warm-up forwards (or warmups[s]),
    then alternates one forward and one backward, then drains the remaining backwards."""
    orders = []
    for stage in range(stages):
        warmup = _warmup(warmups, stage, min(stages - stage - 1, microbatches), 0, microbatches)
        order = [PipeOp("F", 0, j) for j in range(warmup)]
        next_b = 0
        for j in range(warmup, microbatches):
            order.append(PipeOp("F", 0, j))
            order.append(PipeOp("B", 0, next_b))
            next_b += 1
        order += [PipeOp("B", 0, j) for j in range(next_b, microbatches)]
        orders.append(order)
    return orders


def interleaved(stages: int, microbatches: int, chunks: int, warmups: Sequence[int] | None = None) -> list[list[PipeOp]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): each stage holds `chunks`
    virtual stages; micro-batches advance through the chunks in groups of `stages`.

    `warmups` replaces Megatron's warm-up forward counts per stage (Optimus §4.3 defers
    the first stage's last chunk-0 forwards this way); a stage needs at least the
    (chunks-1)·stages forwards that reach its last chunk before its first backward."""
    if chunks == 1:
        return one_f_one_b(stages, microbatches, warmups)
    if microbatches % stages:
        raise ConfigError(f"interleaved schedule needs micro-batches ({microbatches}) divisible by pipeline stages ({stages})")
    total = microbatches * chunks

    def virtual(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, stages * chunks)
        chunk = within // stages
        microbatch = group * stages + within % stages
        return (chunk if forward else chunks - 1 - chunk), microbatch

    # Every stage runs the same sequences of forwards and backwards; only its warm-up differs.
    forwards = [PipeOp("F", *virtual(k, True)) for k in range(total)]
    backwards = [PipeOp("B", *virtual(k, False)) for k in range(total)]
    orders = []
    for stage in range(stages):
        warmup = _warmup(warmups, stage, min((stages - stage - 1) * 2 + (chunks - 1) * stages, total), (chunks - 1) * stages, total)
        order = forwards[:warmup]
        for f, b in zip(forwards[warmup:], backwards):
            order += (f, b)
        order += backwards[total - warmup :]
        orders.append(order)
    return orders


def _warmup(warmups: Sequence[int] | None, stage: int, default: int, least: int, total: int) -> int:
    if warmups is None:
        return default
    if not least <= warmups[stage] <= total:
        raise ConfigError(f"stage {stage}: {warmups[stage]} warm-up forwards, outside [{least}, {total}]")
    return warmups[stage]


def build_schedule(name: str, stages: int, microbatches: int, chunks: int = 1, extra_warmup: int = 0) -> list[list[PipeOp]]:
    """`extra_warmup`: more warm-up forwards on every stage but the last of a 1F1B without
    virtual stages (the module's docstring), up to every forward a stage runs."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}")
    if name != "interleaved" and chunks != 1:
        raise ConfigError(f"virtual pipeline chunks (vpp={chunks}) need schedule=interleaved, not {name}")
    if extra_warmup < 0 or (extra_warmup and (name == "gpipe" or chunks > 1)):
        raise ConfigError(
            f"{extra_warmup} extra warm-up forwards: a 1F1B schedule without virtual stages takes 0 or more (GPipe runs "
            f"every forward first; an interleaved last stage also runs the chain's middle, so the stages before it cannot "
            f"queue ahead of it)"
        )
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if chunks > 1:
        return interleaved(stages, microbatches, chunks)
    if not extra_warmup:
        return one_f_one_b(stages, microbatches)
    warmups = [min(stages - s - 1 + extra_warmup, microbatches) for s in range(stages - 1)] + [0]
    return one_f_one_b(stages, microbatches, warmups)


def warmup_counts(orders: list[list[PipeOp]]) -> list[int]:
    """Warm-up forwards per stage: those before its first backward but the one the
    steady phase pairs with it (what `one_f_one_b` and `interleaved` take as `warmups`)."""
    out = []
    for order in orders:
        first = next((i for i, op in enumerate(order) if op.kind == "B"), len(order))
        forwards = sum(1 for op in order[:first] if op.kind == "F")
        out.append(forwards - 1 if first < len(order) else forwards)
    return out


def in_flight(order: list[PipeOp]) -> int:
    """Most forwards whose backward has not run yet, along one stage's order."""
    live = peak = 0
    for op in order:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak
