"""The order search: its vectorized recurrence is IntervalSim's, and it only ever shortens it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from src.data.order_search import improve, makespans, time_tables
from src.data.reorder import IntervalSim, StageTimes, inter_reorder
from src.schedules.chain import Chain, chain_orders


def _pipeline(rng: random.Random, stages: int, microbatches: int) -> list[StageTimes]:
    return [
        StageTimes(tuple(rng.uniform(0.1, 1.0) for _ in range(stages)), tuple(rng.uniform(0.1, 2.0) for _ in range(stages)))
        for _ in range(microbatches)
    ]


def _recurrence(times: list[StageTimes], order: list[int], extra_warmup: int = 0) -> float:
    sim = IntervalSim(len(times[0].fwd), len(times), extra_warmup)
    for j in order:
        sim.place(times[j])
    return sim.makespan


def _table(times: list[StageTimes]) -> list[list[float]]:
    """A row per stage's forward, then per stage's backward; a column per micro-batch."""
    return [[t.fwd[s] for t in times] for s in range(len(times[0].fwd))] + [
        [t.bwd[s] for t in times] for s in range(len(times[0].bwd))
    ]


@pytest.mark.parametrize("extra_warmup", [0, 2])
@pytest.mark.parametrize("stages, microbatches", [(1, 1), (1, 4), (2, 2), (3, 7), (6, 5), (10, 24)])
def test_makespans_are_interval_sims(stages: int, microbatches: int, extra_warmup: int) -> None:
    rng = random.Random(stages * 100 + microbatches)
    pipes = [_pipeline(rng, stages, microbatches) for _ in range(3)]
    orders = [rng.sample(range(microbatches), microbatches) for _ in range(5)]
    which = [0, 1, 2, 1, 0]
    tables = time_tables(pipes)
    assert tables.tolist() == [_table(p) for p in pipes]
    got = makespans(tables, np.array(which), np.array(orders), extra_warmup)
    want = [_recurrence(pipes[g], order, extra_warmup) for g, order in zip(which, orders)]
    assert got.tolist() == pytest.approx(want, rel=1e-12)


def test_improve_never_lengthens_and_is_deterministic() -> None:
    rng = random.Random(7)
    pipes = [_pipeline(rng, 5, 16) for _ in range(4)]
    starts = [inter_reorder(p) for p in pipes]
    found = improve(pipes, starts)
    assert found == improve(pipes, starts)  # the real backend places each step's batch again
    for pipe, start, order in zip(pipes, starts, found):
        assert sorted(order) == list(range(16))
        assert _recurrence(pipe, order) <= _recurrence(pipe, start) + 1e-12


def test_improve_shortens_a_skewed_mllm_pipeline() -> None:
    """An MLLM's pipeline as DistTrain lays it out (two encoder stages, six LLM stages, two
    generator stages; seconds of MLLM-72B's plan on A800s at the mean load), each micro-batch's
    encoder and generator stages scaled by its sequence's skewed load: the generator has slack
    over the LLM in sum, not micro-batch by micro-batch, and where its heavy micro-batches fall
    decides how long the LLM waits. Algorithm 3 orders by the first stage alone; the search
    finds a shorter order from it."""
    enc_f, llm_f, gen_f = (0.09, 0.10), (0.24, 0.26, 0.26, 0.24, 0.24, 0.25), (0.38, 0.16)
    enc_b, llm_b, gen_b = (0.29, 0.30), (0.48, 0.51, 0.51, 0.48, 0.48, 0.49), (0.30, 0.35)
    rng = random.Random(3)
    times = []
    for _ in range(48):
        e, g = rng.expovariate(1.0), rng.expovariate(1.0)
        times.append(
            StageTimes(
                tuple(x * e for x in enc_f) + llm_f + tuple(x * g for x in gen_f),
                tuple(x * e for x in enc_b) + llm_b + tuple(x * g for x in gen_b),
            )
        )
    start = inter_reorder(times)
    (order,) = improve([times], [start])
    assert _recurrence(times, order) < 0.97 * _recurrence(times, start)


def test_nothing_to_search() -> None:
    one = [StageTimes((1.0,), (1.0,))]
    assert improve([one], [[0]]) == [[0]]
    assert improve([], []) == []


def _replayed(chain: Chain, times: list[StageTimes], order: list[int]) -> float:
    """The chain's devices run their orders (schedules.chain), position p holding micro-batch
    order[p]: an operation ends its duration after the later of its device's previous one and
    the one it waits for (a forward the previous virtual stage's forward, a backward the next
    one's backward, the last one's its own forward). Replayed op by op, as the devices would."""
    devices = chain_orders(chain, len(order))
    virtual_of = chain.virtual_of()
    last = chain.virtual_stages - 1
    ends: dict[tuple[str, int, int], float] = {}
    clock, at = [0.0] * len(devices), [0] * len(devices)
    while any(k < len(ops) for k, ops in zip(at, devices)):
        for d, ops in enumerate(devices):
            while at[d] < len(ops):
                op = ops[at[d]]
                v, j = virtual_of[d][op.chunk], op.microbatch
                waits = (("F", v - 1, j) if v else None) if op.kind == "F" else ("B", v + 1, j) if v < last else ("F", v, j)
                if waits is not None and waits not in ends:
                    break
                seconds = (times[order[j]].fwd if op.kind == "F" else times[order[j]].bwd)[v]
                clock[d] = ends[(op.kind, v, j)] = max(clock[d], ends[waits] if waits else 0.0) + seconds
                at[d] += 1
    return max(clock)


@pytest.mark.parametrize("units, microbatches", [(((1, 1), (2, 2), (1, 1)), 8), (((2, 1), (2, 3)), 6), (((1, 1), (4, 2), (2, 1)), 8)])
def test_makespans_run_an_interleaved_chain_s_own_orders(units: tuple[tuple[int, int], ...], microbatches: int) -> None:
    """A chain whose devices run several virtual stages (DistTrain's interleaved LLM) is priced
    by the devices' own orders, not as one 1F1B chain of its virtual stages: a device that runs
    two of them runs them one after the other."""
    chain = Chain(units)
    virtual = chain.virtual_stages
    rng = random.Random(virtual * 10 + microbatches)
    pipes = [_pipeline(rng, virtual, microbatches) for _ in range(2)]
    orders = [rng.sample(range(microbatches), microbatches) for _ in range(4)]
    which = [0, 1, 1, 0]
    got = makespans(time_tables(pipes), np.array(which), np.array(orders), chain=chain)
    want = [_replayed(chain, pipes[g], order) for g, order in zip(which, orders)]
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    as_devices = makespans(time_tables(pipes), np.array(which), np.array(orders))
    assert (got > as_devices + 1e-9).all()  # the virtual stages share devices
