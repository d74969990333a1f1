"""Measure this machine for the `local` cluster preset, and write its profile.

    python -m src.calibrate [--workers 4]

Real-backend workers are CPU processes with one thread each, sharing the host's cores,
talking over gloo. This measures what the simulator needs to price them, the way training
runs them (spawned processes, gloo, F.linear):
- GEMM throughput of one worker alone, by shape (square and thin, as the models' layers
  and small micro-batches make them) and dtype: the 16-bit peaks;
- a training step of the real backend's transformer block at the validation grid's two GPT
  sizes (forward, backward and a fused AdamW step), profiled op by op (torch.profiler): its
  fp32 GEMMs by shape give the fp32 peak and the efficiency curve, and its bandwidth-bound
  kinds (GELU forward and backward, LayerNorm forward and backward with its parameters'
  gradients, AdamW's 28 bytes a parameter; fp32, each tensor read or written once) their
  rates; a copy of the step's activations timed alone is the worker's memory bandwidth
  (copies stream at it: copy_efficiency 1) and the median kind's share of it the rate of every
  bandwidth-bound kernel (memory_efficiency), as the GPU presets take theirs from a profiled
  step. On a worker's one thread a step's GEMMs and kinds run slower than the same timed alone
  (caches the step's other tensors share, the backward's transposed operands);
- oversubscription: the per-worker rate of a large GEMM when 1, 2, ... workers compute at
  once (past the core count each gets a share of a core);
- gloo all-reduce time by message size and group size, and point-to-point ping-pong time
  by size: latency and bandwidth fits of the cost model's formulas; all-gather,
  reduce-scatter and all-to-all times by size, as the fraction of the fitted ring's rate
  they achieve (gloo's reduce-scatter falls far short of it);
- ZeRO-3's host work: DeepSpeed's stage 3 on one worker (its hooks fetch and release
  every module, with nothing to gather) on stacks of the real backend's transformer
  blocks of two widths, every tensor partitioned and run as the real backend runs them;
  what a step takes beyond the same blocks' plain step and DeepSpeed's collectives, per
  module fetch and per byte fetched (the hooks, the fetch and release bookkeeping, the
  buffers' copies). Over more workers DeepSpeed's all-gathers add what the cost model
  prices as collectives (of those, what is timed here is their launch, not their wait);
- the framework's cost per kernel: one transformer block of the real backend
  (src.runtime.modules.blocks.Block) so small that its arithmetic is nothing, forward and
  forward + backward, divided by the kernels the cost model counts for it;
- collectives as training runs them: every worker computes a fixed block of GEMMs, then
  all of them all-reduce (a layer's output, a bucket of gradients), over and over. On
  cores shared by more workers than they hold, the workers reach the collective at
  different times and a blocked one waits for a core to wake on; an all-reduce started
  from a barrier (above) pays neither. The time per round, less the block's with every
  worker computing and none communicating (as the simulator prices it), is the
  collective's: the ring fit of these gives the preset's intra_bandwidth and per-step
  latency; the barrier-started fit is kept beside the measurements. Where the
  barrier-started all-reduces span two group sizes (all workers and pairs, from 3
  workers), they also give a latency per collective that the ring's steps do not explain
  (a pair's all-reduce on shared cores costs about what the whole group's does: each
  collective waits for its members to be scheduled, whatever its steps): the ring's
  base_s, taken off the after-compute rounds before their fit;
- how far apart the workers reach a collective: every worker computes blocks of GEMMs
  of 0 to about 100 ms, each followed by a 4 MiB all-reduce. Time-sliced on shared cores,
  one may lag the others by up to about a scheduling period, the more likely the longer
  the block, and the all-reduce waits for the slowest: the slowest round beyond its block
  is fitted as a constant (the all-reduce) plus sync_skew_s · (1 - exp(-block /
  sync_skew_build_s)). The all-reduces after compute above are taken less that wait at
  their block, so that the ring fit is the collective's own and the simulator adds the
  wait by the compute it prices before each collective;
- the hand-over of a core: half the workers compute blocks of GEMMs while each of the
  others waits on a message its partner sends after every block. A waiter that sleeps long
  enough leaves its core to the computing workers, who then run at the share of fewer
  workers; a short wait does not free it. From the computing workers' rate by block length,
  core_handover_s is the wait at which they get half of that gain.

The profile (raw measurements and the fitted preset figures) is written to
outputs/calibrate/local-<cpu model>.yaml, or with `--update` to the repository's
conf/cluster/profiles/local-<cpu model>.yaml, which `cluster=local` takes on a host of
that CPU model (the preset's own figures elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from src.cluster_profile import PROFILE_DIR, host_identity, profile_path
from src.costmodel.comm import lag_wait
from src.out_paths import output_file

SQUARES = (64, 128, 256, 512, 1024)
THIN = ((16, 512, 512), (64, 2048, 512), (256, 128, 1024), (2048, 64, 64))  # (m, n, k): small batches, narrow heads
OVERSUBSCRIBED_N = 512
OUT_DIR = Path("outputs") / "calibrate"
MESSAGE_BYTES = tuple(4**k for k in range(5, 13))  # 1 KiB .. 16 MiB
REPEATS = 11
# Collectives after compute: GEMMs of SYNC_DIM^3 per round (a few ms on one core), over
# the larger message sizes, where gradients and layer outputs lie.
SYNC_DIM = 256
SYNC_GEMMS = 8
SYNC_BYTES = MESSAGE_BYTES[3:]
SYNC_ROUNDS = 16
SYNC_REPEATS = 3
# How far apart workers reach a collective: blocks of 0..128 GEMMs of SYNC_DIM^3 (0 to about
# 100 ms with 4 workers on 2 cores), each followed by an all-reduce of SKEW_BYTES.
SKEW_GEMMS = (0, 2, 8, 32, 128)
SKEW_BYTES = 4 * 2**20
SKEW_ROUNDS = 8
SKEW_REPEATS = 5  # the wait after a long block moves most from one measurement to the next
# Hand-over of a core: blocks of 1..64 GEMMs of SYNC_DIM^3 (about 0.3-20 ms on one core).
HANDOVER_GEMMS = (1, 4, 16, 64)
HANDOVER_ROUNDS = 12
DTYPES = ("fp32", "bf16", "fp16")
# A step of the validation grid's GPT blocks (src.validate's gpt-s and gpt-m: hidden, heads, and
# a micro-batch of 8 sequences of 64 and 128 tokens), profiled over STEP_PROFILED steps after
# STEP_WARMUP.
STEP_BLOCKS = ((128, 4, 8, 64), (384, 8, 8, 128))
STEP_WARMUP, STEP_PROFILED = 3, 10
FP32 = 4


def _seconds_per_call(call: Callable[[], Any], min_seconds: float) -> float:
    """Seconds one call takes, called back to back for at least `min_seconds` after one
    untimed call (which allocates and picks its kernel)."""
    call()
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        call()
        reps += 1
    return elapsed / reps


def _rate(m: int, n: int, k: int, dtype_name: str, min_seconds: float = 0.15) -> float:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    return 2.0 * m * n * k / _seconds_per_call(lambda: torch.nn.functional.linear(a, b), min_seconds)


def step_kernel_bytes(op: str, tokens: int, hidden: int, params: int) -> tuple[str, float] | None:
    """The kind and the bytes (fp32, each tensor read or written once) of one call of a
    profiled op of a GPT block's step; None for an op that is not a bandwidth-bound kind."""
    values, wide = tokens * hidden * FP32, tokens * 4 * hidden * FP32
    return {
        "aten::gelu": ("gelu", 2.0 * wide),
        "aten::gelu_backward": ("gelu_backward", 3.0 * wide),
        "aten::native_layer_norm": ("layer_norm", 2.0 * values),
        # the input's gradient (the output's gradient and the input read, written) and the
        # parameters' (the two read again, reduced over the tokens)
        "aten::native_layer_norm_backward": ("layer_norm_backward", 5.0 * values),
        "aten::_fused_adamw_": ("adamw", 28.0 * params),
    }.get(op)


def gemm_shape(op: str, shapes: list[list[int]]) -> tuple[int, int, int] | None:
    """(m, n, k) of a profiled mm (a, b) or addmm (bias, a, b); None for another op."""
    operands = {"aten::mm": shapes[:2], "aten::addmm": shapes[1:3]}.get(op)
    if operands is None or any(len(s) != 2 for s in operands):
        return None
    (m, k), (_, n) = operands
    return m, n, k


def _step_profile() -> dict[str, list[dict[str, Any]]]:
    """A profiled step of the real backend's block: each fp32 GEMM's shape and rate, each
    bandwidth-bound kind's seconds per call, and a copy's rate over the step's activations
    timed alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from src.runtime.modules.blocks import Block
    from src.runtime.modules.parallel import TP

    gemms, kernels, copies = [], [], []
    for hidden, heads, batch, seq in STEP_BLOCKS:
        block = Block(hidden, heads, TP(), causal=True)
        optimizer = torch.optim.AdamW(block.parameters(), fused=True)  # the real backend's (src/runtime/optimizer.py)
        x = torch.randn(batch, seq, hidden, requires_grad=True)
        params = sum(p.numel() for p in block.parameters())

        def step() -> None:
            optimizer.zero_grad()
            block({"x": x})["x"].sum().backward()
            optimizer.step()

        for _ in range(STEP_WARMUP):
            step()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(STEP_PROFILED):
                step()
        for event in prof.key_averages(group_by_input_shape=True):
            seconds = event.self_cpu_time_total * 1e-6 / event.count
            shape = gemm_shape(event.key, event.input_shapes)
            if shape is not None:
                m, n, k = shape
                gemms.append({"m": m, "n": n, "k": k, "flops_per_s": 2.0 * m * n * k / seconds})
            kind = step_kernel_bytes(event.key, batch * seq, hidden, params)
            if kind is not None:
                kernels.append({"op": event.key, "kind": kind[0], "hidden": hidden, "bytes": kind[1], "seconds": seconds})
        for width in (hidden, 4 * hidden):
            values = torch.randn(batch * seq, width)
            moved = 2.0 * values.numel() * FP32
            copies.append({"bytes": moved, "bytes_per_s": moved / _seconds_per_call(values.clone, 0.1)})
    return {"gemms": gemms, "kernels": kernels, "copies": copies}


def memory_figures(measured: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """The preset's bandwidth figures: a copy's median rate is the memory bandwidth, and the
    median over the kinds of each kind's median rate in the step its share of it."""
    bandwidth = statistics.median(c["bytes_per_s"] for c in measured["copies"])
    rates: dict[str, list[float]] = {}
    for k in measured["kernels"]:
        rates.setdefault(k["kind"], []).append(k["bytes"] / k["seconds"])
    share = statistics.median(statistics.median(r) for r in rates.values()) / bandwidth
    return {"memory_bandwidth": float(f"{bandwidth:.4g}"), "copy_efficiency": 1.0, "memory_efficiency": round(share, 3)}


def _timed(op, repeats: int = REPEATS) -> float:
    import torch.distributed as dist

    op()  # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _worker(rank: int, world: int, port: int, task: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    # DeepSpeed (the zero3 task) reads the launcher's variables too.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if task == "gemm_shapes":
            shapes = [(n, n, n) for n in SQUARES] + list(THIN)
            results[rank] = [(m, n, k, d, _rate(m, n, k, d)) for d in DTYPES for m, n, k in shapes]
        elif task == "host":
            results[rank] = _host_costs()
        elif task == "step":
            results[rank] = _step_profile()
        elif task == "zero3":
            results[rank] = _zero3()
        elif task == "sync":
            results[rank] = _after_compute()
        elif task == "handover":
            results[rank] = _handover(rank, world)
        elif task == "gemm_concurrent":
            dist.barrier()  # all start together: the rates are shares of the cores
            results[rank] = {d: _rate(OVERSUBSCRIBED_N, OVERSUBSCRIBED_N, OVERSUBSCRIBED_N, d, 0.5) for d in DTYPES}
        else:
            results[rank] = _links(rank, world)
    finally:
        dist.destroy_process_group()


HOST_BLOCK = (16, 2, 8)  # hidden, heads, tokens: arithmetic negligible beside the framework's calls
# ZeRO-3's host work: stacks of blocks of two widths (module fetches of almost no bytes, and
# of 0.1-1 MiB), a few tokens so that their arithmetic stays small.
ZERO3_WIDTHS = (16, 256)
ZERO3_BLOCKS, ZERO3_HEADS, ZERO3_TOKENS = 4, 2, 8
ZERO3_STEPS, ZERO3_REPEATS = 8, 3


def _host_costs() -> dict[str, float]:
    """Seconds per forward and per backward of a tiny transformer block of the real
    backend: what the framework costs a layer, whatever its size."""
    import torch

    from src.runtime.modules.blocks import Block
    from src.runtime.modules.parallel import TP

    hidden, heads, tokens = HOST_BLOCK
    block = Block(hidden, heads, TP(), causal=True)
    x = torch.randn(1, tokens, hidden, requires_grad=True)

    def forward() -> None:
        with torch.no_grad():
            block({"x": x})

    def step() -> None:
        block({"x": x})["x"].sum().backward()

    return {name: _seconds_per_call(fn, 0.5) for name, fn in (("forward", forward), ("forward_backward", step))}


def _zero3() -> dict[int, dict[str, float]]:
    """Per width: seconds per training step of a stack of the real backend's transformer
    blocks, plain (no DeepSpeed) and under DeepSpeed's ZeRO-3 with every tensor
    partitioned, built and run as the real backend does (under zero.Init, each block
    called in turn rather than through the engine's forward, its collectives timed), on one
    worker: the hooks fetch and release every module as they do over many, with nothing
    to gather (the all-gathers, which the cost model prices, are not run). With the
    seconds DeepSpeed's collectives still took (its gradient reductions over a group of
    one), and the module fetches and bytes a step makes: each module with parameters of
    its own, fetched for its forward and again for its backward."""
    import torch
    import torch.distributed as dist

    from src.config import ContrastiveSpec, DeepSpeedSpec
    from src.runtime.comm import CLOCK
    from src.runtime.engines import EngineSettings, ParallelGroups, backward, make_engine, partitioned_at_init, time_deepspeed_comm
    from src.runtime.optimizer import build_optimizer
    from src.runtime.modules.blocks import Block
    from src.runtime.modules.parallel import TP

    groups = ParallelGroups(dist.new_group([0]), (0,), None, ())
    settings = EngineSettings(3, 1, 1, persistence_threshold=0)
    linear = torch.nn.functional.linear  # zero.Init replaces it for the whole process

    def stack(hidden: int) -> torch.nn.ModuleList:
        return torch.nn.ModuleList(Block(hidden, ZERO3_HEADS, TP(), causal=True) for _ in range(ZERO3_BLOCKS))

    def run(blocks: torch.nn.ModuleList, x: torch.Tensor):
        state = {"x": x}
        for block in blocks:
            state = block(state)
        return state["x"].sum()

    def per_step(step) -> float:
        step()  # warm-up
        start = time.perf_counter()
        for _ in range(ZERO3_STEPS):
            step()
        return (time.perf_counter() - start) / ZERO3_STEPS

    out: dict[int, dict[str, float]] = {}
    for hidden in ZERO3_WIDTHS:
        x = torch.randn(1, ZERO3_TOKENS, hidden)
        plain = stack(hidden)
        optimizer = build_optimizer(plain, DeepSpeedSpec(), ContrastiveSpec())  # the engine's, as DeepSpeed gets it

        def plain_step() -> None:
            optimizer.zero_grad()
            run(plain, x).backward()
            optimizer.step()

        try:
            with partitioned_at_init(groups, settings):
                partitioned = stack(hidden)
            engine = make_engine(torch.nn.ModuleDict({"u": partitioned}), groups, settings)
        finally:
            torch.nn.functional.linear = linear
        time_deepspeed_comm()

        def zero3_step() -> None:
            loss = run(engine.module["u"], x)
            backward(engine, [loss], [torch.ones_like(loss)], 0)
            engine.step()

        rounds = []
        for _ in range(ZERO3_REPEATS):  # side by side: the host's load drifts
            plain_s = per_step(plain_step)
            CLOCK.take()
            zero3_s = per_step(zero3_step)
            rounds.append((plain_s, zero3_s, CLOCK.take().get("dp", 0.0) / (ZERO3_STEPS + 1)))
        modules = sum(1 for m in plain.modules() if next(m.parameters(recurse=False), None) is not None)
        nbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
        out[hidden] = {
            **{key: statistics.median(r[i] for r in rounds) for i, key in enumerate(("plain_s", "zero3_s", "collectives_s"))},
            "fetches": 2.0 * modules,
            "fetched_bytes": 2.0 * nbytes,
        }
    return out


def zero3_fetch_costs(measured: dict[int, dict[str, float]]) -> tuple[float, float]:
    """Host seconds per ZeRO-3 module fetch and per byte fetched: what a step takes beyond
    the plain step and DeepSpeed's collectives, fitted over the widths as fetches x
    per-fetch + bytes x per-byte (the narrowest width's bytes are almost none)."""
    points = [
        (row["fetches"], row["fetched_bytes"], max(row["zero3_s"] - row["plain_s"] - row["collectives_s"], 0.0))
        for row in (measured[h] for h in ZERO3_WIDTHS)
    ]
    (f0, b0, t0), (f1, b1, t1) = points[0], points[-1]
    per_byte = max((t1 / f1 - t0 / f0) / (b1 / f1 - b0 / f0), 0.0)
    return max(t0 / f0 - per_byte * b0 / f0, 0.0), per_byte


def host_kernel_costs(forward: float, forward_backward: float) -> tuple[float, float]:
    """The framework's host seconds per kernel of a forward and of a backward: a tiny
    block's times over the kernels the cost model counts for that block (eager attention,
    as CPU workers run it)."""
    from src.costmodel.compute import layer_launches
    from src.models.layers import transformer_layer

    hidden, heads, tokens = HOST_BLOCK
    launches = layer_launches(transformer_layer(tokens, hidden, heads))
    return forward / launches.fwd, (forward_backward - forward) / (launches.bwd_input + launches.bwd_weight)


def _links(rank: int, world: int) -> dict[str, list]:
    """With every one of `world` workers running, as in training: all-reduce, all-gather,
    reduce-scatter and all-to-all over all of them, all-reduce and ping-pong within pairs
    (0, 1), (2, 3), ... all at once."""
    import torch
    import torch.distributed as dist

    from src.runtime.comm import all_gather_single, reduce_scatter_single

    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
    mine = pairs[rank // 2] if rank // 2 < len(pairs) else None
    peer = rank ^ 1
    measured: dict[str, list] = {"all_reduce": [], "p2p": [], **{op: [] for op in ONE_PASS}}
    for nbytes in MESSAGE_BYTES:
        tensor = torch.ones(nbytes // 4 // world * world)
        shard = torch.empty(tensor.numel() // world)
        received = torch.empty_like(tensor)

        def ping_pong() -> None:
            if mine is None:
                return
            first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
            first(tensor, peer, group=mine)
            second(tensor, peer, group=mine)

        if world > 2:
            seconds = _timed(lambda: dist.all_reduce(tensor, group=mine) if mine is not None else None)
            if mine is not None:
                measured["all_reduce"].append((2, nbytes, seconds))
        measured["all_reduce"].append((world, nbytes, _timed(lambda: dist.all_reduce(tensor))))
        measured["all_gather"].append((world, nbytes, _timed(lambda: all_gather_single(tensor, shard))))
        measured["reduce_scatter"].append((world, nbytes, _timed(lambda: reduce_scatter_single(shard, tensor))))
        measured["all_to_all"].append((world, nbytes, _timed(lambda: dist.all_to_all_single(received, tensor))))
        seconds = _timed(ping_pong)
        if mine is not None:
            measured["p2p"].append((nbytes, seconds / 2))
    return measured


def _after_compute() -> dict[str, Any]:
    """Seconds per round of (a block of GEMMs, then an all-reduce over every worker), by
    message size, and per block alone with every worker computing (no collective); and the
    same, at one size, by block length (`skew`: gemms, block, round)."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(SYNC_DIM, SYNC_DIM), torch.randn(SYNC_DIM, SYNC_DIM)

    def block(gemms: int) -> None:
        for _ in range(gemms):
            torch.nn.functional.linear(a, b)

    def seconds_per_round(gemms: int, collective, rounds: int) -> float:
        block(gemms)
        collective()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            block(gemms)
            collective()
        return (time.perf_counter() - start) / rounds

    def medians(gemms: int, tensor, rounds: int, repeats: int) -> tuple[float, float]:
        # Each beside the other, `repeats` times (the host's load drifts): the medians.
        pairs = [
            (seconds_per_round(gemms, lambda: None, rounds), seconds_per_round(gemms, lambda: dist.all_reduce(tensor), rounds))
            for _ in range(repeats)
        ]
        return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)

    rounds = [(nbytes, *medians(SYNC_GEMMS, torch.ones(nbytes // 4), SYNC_ROUNDS, SYNC_REPEATS)) for nbytes in SYNC_BYTES]
    skew_tensor = torch.ones(SKEW_BYTES // 4)
    skew = [(gemms, *medians(gemms, skew_tensor, SKEW_ROUNDS, SKEW_REPEATS)) for gemms in SKEW_GEMMS]
    return {"rounds": rounds, "skew": skew}


def _handover(rank: int, world: int) -> dict[str, Any]:
    """Even ranks compute blocks of GEMMs, each odd rank waits on a token its even partner
    sends after every block. Per block length: rank 0's seconds alone (the others asleep in
    a barrier) and each computing rank's mean seconds per block beside the waiters."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(SYNC_DIM, SYNC_DIM), torch.randn(SYNC_DIM, SYNC_DIM)
    token = torch.zeros(1)
    partner = rank ^ 1
    computing = rank % 2 == 0

    def block(gemms: int) -> None:
        for _ in range(gemms):
            torch.nn.functional.linear(a, b)

    out: dict[str, Any] = {"computing": computing, "alone": {}, "beside": {}}
    for gemms in HANDOVER_GEMMS:
        block(gemms)
        if rank == 0:
            start = time.perf_counter()
            for _ in range(HANDOVER_ROUNDS):
                block(gemms)
            out["alone"][gemms] = (time.perf_counter() - start) / HANDOVER_ROUNDS
        dist.barrier()
        seconds = []
        for _ in range(HANDOVER_ROUNDS):
            if computing:
                start = time.perf_counter()
                block(gemms)
                seconds.append(time.perf_counter() - start)
                if partner < world:
                    dist.send(token, partner)
            else:
                dist.recv(token, partner)
        if computing:
            out["beside"][gemms] = statistics.fmean(seconds)
        dist.barrier()
    return out


def handover_seconds(handover: dict[int, dict[str, Any]], share_all: float, share_computing: float) -> float:
    """The wait at which the computing workers get half the gain of their waiting
    partners' cores: their share beside the waiters (a block alone over its time beside
    them) between share_all (every worker computing: no core handed over) and
    share_computing (only they compute), interpolated in log of the wait (as long as the
    block). 0 if the shortest wait already frees half; the longest wait measured if none
    does; 0 where the two shares are too close to tell (the cores are not oversubscribed)."""
    if share_computing - share_all < 0.05:
        return 0.0
    alone = handover[0]["alone"]
    points = []
    for gemms in sorted(alone):
        beside = statistics.fmean(r["beside"][gemms] for r in handover.values() if r["computing"])
        gained = (alone[gemms] / beside - share_all) / (share_computing - share_all)
        points.append((beside, min(max(gained, 0.0), 1.0)))
    if points[0][1] >= 0.5:
        return 0.0
    for (w0, g0), (w1, g1) in zip(points, points[1:]):
        if g1 >= 0.5:
            return math.exp(math.log(w0) + (0.5 - g0) / (g1 - g0) * (math.log(w1) - math.log(w0)))
    return points[-1][0]


def _slowest(sync: dict[int, dict[str, Any]], key: str) -> list[tuple[Any, float, float]]:
    """Per measurement of `key`: (its size or block, the block as long as its slowest
    rank's with every worker computing, the round as long as its slowest rank's)."""
    return [
        (row[0], max(sync[r][key][i][1] for r in sync), max(sync[r][key][i][2] for r in sync)) for i, row in enumerate(sync[0][key])
    ]


def fit_sync_skew(sync: dict[int, dict[str, Any]]) -> tuple[float, float]:
    """(sync_skew_s, sync_skew_build_s) of the slowest round beyond its block against the
    block's seconds t: least squares of a constant (the all-reduce itself) plus
    sync_skew_s · (1 - exp(-t / sync_skew_build_s)), over a log grid of build times; (0, 0)
    where the wait does not grow with the block (cores not shared)."""
    points = [(block, round_ - block) for _, block, round_ in _slowest(sync, "skew")]
    ys = [y for _, y in points]
    best: tuple[float, float, float] | None = None
    for step in range(0, 61):
        build = 2.5e-4 * 2.0 ** (step / 6)  # 0.25 ms .. 256 ms
        xs = [lag_wait(1.0, build, t) for t, _ in points]
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        if spread <= 0:
            continue
        wait = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
        error = sum((mean_y + wait * (x - mean_x) - y) ** 2 for x, y in zip(xs, ys))
        if best is None or error < best[0]:
            best = (error, wait, build)
    if best is None or best[1] <= 0:
        return 0.0, 0.0
    return best[1], best[2]


def _rounded(wait: float, build: float) -> tuple[float, float]:
    """Four significant digits, as the profile states them (and prices them)."""
    return float(f"{wait:.4g}"), float(f"{build:.4g}")


def after_compute_points(
    sync: dict[int, dict[str, Any]], world: int, skew: tuple[float, float] = (0.0, 0.0)
) -> list[tuple[int, int, float]]:
    """(group, bytes, seconds) of the all-reduces measured after compute: each size's
    round as long as its slowest rank's, less the block as long as its slowest rank's
    with every worker computing (what the simulator prices it at), less the wait for the
    slowest that the simulator adds after that block (`skew`: fit_sync_skew's figures)."""
    return [(world, nbytes, max(round_ - block - lag_wait(*skew, block), 0.0)) for nbytes, block, round_ in _slowest(sync, "rounds")]


def link_figures(
    links: dict[int, dict[str, list]], after_compute: list[tuple[int, int, float]] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The preset's link figures from one worker count's measurements (every rank's, each
    collective as slow as its slowest rank), and the measurements kept. With all-reduces
    measured after compute (training's pattern), the ring's latency and bandwidth are
    theirs; the other collectives keep their rates relative to the ring (measured from a
    barrier both), each size at least its barrier-started time."""
    slowest: dict[tuple[int, int], float] = {}
    for r in links:
        for size, nbytes, seconds in links[r]["all_reduce"]:
            slowest[(size, nbytes)] = max(slowest.get((size, nbytes), 0.0), seconds)
    barrier = [(g, n, t) for (g, n), t in slowest.items()]
    latency, bandwidth = fit_ring(barrier)
    base = fit_ring_base(barrier)
    p2p_latency, p2p_bandwidth = fit_p2p(links[0]["p2p"])
    one_pass = {op: [max((links[r][op][i] for r in links), key=lambda p: p[2]) for i in range(len(MESSAGE_BYTES))] for op in ONE_PASS}
    if after_compute:
        # No slower than the same all-reduce from a barrier: a round that came out shorter
        # than its block is the host's noise, not a free collective.
        after_compute = [(g, n, max(t, slowest.get((g, n), 0.0))) for g, n, t in after_compute]
    ring_points = after_compute or barrier
    ring_latency, ring_bandwidth = fit_ring([(g, n, max(t - base, 0.0)) for g, n, t in ring_points])
    figures = {
        "intra_bandwidth": float(f"{ring_bandwidth:.4g}"),
        "intra_latency": float(f"{p2p_latency:.4g}"),
        "p2p_bandwidth": float(f"{p2p_bandwidth:.4g}"),
        "collectives": gloo_collectives(ring_latency, base),
        "collective_efficiency": {op: round(fit_efficiency(points, latency, bandwidth), 3) for op, points in one_pass.items()},
    }
    measured: dict[str, Any] = {
        "all_reduce": [{"group": g, "bytes": n, "seconds": t} for (g, n), t in sorted(slowest.items())],
        "p2p": [{"bytes": n, "seconds": t} for n, t in links[0]["p2p"]],
        **{op: [{"group": g, "bytes": n, "seconds": t} for g, n, t in points] for op, points in one_pass.items()},
        "barrier_ring_fit": {
            "step_s": float(f"{latency:.4g}"),
            "bandwidth": float(f"{bandwidth:.4g}"),
            "base_s": float(f"{base:.4g}"),
        },
    }
    if after_compute:
        measured["all_reduce_after_compute"] = [{"group": g, "bytes": n, "seconds": t} for g, n, t in after_compute]
    return figures, measured


def _spawn(task: str, workers: int) -> dict[int, Any]:
    import torch.multiprocessing as mp

    from src.runtime.driver import free_port

    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(workers, free_port(), task, results), nprocs=workers, start_method="spawn")
    return dict(results)


# ---- fits ----------------------------------------------------------------------------------
ONE_PASS = ("all_gather", "reduce_scatter", "all_to_all")


def gloo_collectives(step_latency: float, base: float = 0.0) -> dict[str, Any]:
    """The preset's `collectives` block for gloo: one ring protocol at the fitted latency
    per collective and per step (its bandwidth is intra_bandwidth's); no tree."""
    step = float(f"{step_latency:.4g}")
    ring = {"base_s": float(f"{base:.4g}"), "intra_step_s": step, "inter_step_s": step, "share": 1.0}
    return {"ring": {"gloo": ring}, "tree": {}}


def fit_gemm_curve(points: list[tuple[int, int, int, float]]) -> tuple[float, float, float]:
    """Peak, max efficiency and half dimension of rate = peak * E * prod d/(d + h): least
    squares in log space (E in closed form for each h of a geometric grid)."""
    peak = max(rate for *_, rate in points)
    best: tuple[float, float, float] | None = None
    for step in range(0, 121):
        half = 2.0 ** (step / 10)  # 1 .. 4096
        logs = [math.log(rate / peak) - sum(math.log(d / (d + half)) for d in (m, n, k)) for m, n, k, rate in points]
        log_e = statistics.fmean(logs)
        err = sum((x - log_e) ** 2 for x in logs)
        if best is None or err < best[0]:
            best = (err, math.exp(log_e), half)
    assert best is not None
    return peak, min(best[1], 1.0), best[2]


def fit_ring(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Latency per step and bandwidth of t = 2(g-1)·latency + 2(g-1)/g·bytes/bandwidth,
    least squares over every (group size g, bytes, seconds)."""
    xs = [2.0 * (g - 1) for g, _, _ in points]
    ys = [2.0 * (g - 1) / g * nbytes for g, nbytes, _ in points]
    return _least_squares(xs, ys, [t for *_, t in points])


def fit_ring_base(points: list[tuple[int, int, float]]) -> float:
    """The latency per collective beyond its ring steps, from all-reduces over two or more
    group sizes: least squares of t = base + 2(g-1)·latency + 2(g-1)/g·bytes/bandwidth
    (0 from one group size, where base and steps cannot be told apart, or where the fit
    finds none)."""
    if len({g for g, _, _ in points}) < 2:
        return 0.0
    base = _solve([(1.0, 2.0 * (g - 1), 2.0 * (g - 1) / g * n) for g, n, _ in points], [t for *_, t in points])[0]
    return max(base, 0.0)


def fit_efficiency(points: list[tuple[int, int, float]], latency: float, bandwidth: float) -> float:
    """The fraction of the ring's data rate a one-pass collective (all-gather,
    reduce-scatter: (g-1) steps, (g-1)/g of the bytes) achieves, from its largest messages,
    where the data term dominates."""
    largest = sorted(points, key=lambda p: p[1])[-3:]
    ratios = [((g - 1) / g * n / bandwidth) / max(t - (g - 1) * latency, 1e-12) for g, n, t in largest]
    return min(1.0, statistics.median(ratios))


def fit_p2p(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Latency and bandwidth of t = latency + bytes/bandwidth."""
    return _least_squares([1.0] * len(points), [float(n) for n, _ in points], [t for _, t in points])


def _solve(rows: list[tuple[float, ...]], ts: list[float]) -> list[float]:
    """Least squares of ts over the rows' columns: one coefficient per column."""
    return [float(c) for c in np.linalg.lstsq(np.array(rows), np.array(ts), rcond=None)[0]]


def _least_squares(xs: list[float], ys: list[float], ts: list[float]) -> tuple[float, float]:
    """A latency (per unit of xs) and a bandwidth (bytes ys) from seconds ts."""
    latency, per_byte = _solve(list(zip(xs, ys)), ts)
    latency = max(latency, 0.0)
    if per_byte <= 0:
        raise RuntimeError(
            f"the link fit found no bandwidth term (seconds per byte {per_byte:.3g}): measurements too noisy; rerun on an idle machine"
        )
    return latency, 1.0 / per_byte


def calibrate(workers: int) -> dict[str, Any]:
    shapes = _spawn("gemm_shapes", 1)[0]
    concurrent = {k: _spawn("gemm_concurrent", k) for k in range(1, workers + 1)}
    alone = {d: statistics.fmean(concurrent[1][r][d] for r in concurrent[1]) for d in DTYPES}
    preset: dict[str, Any] = {"peak_flops": {}, "oversubscription": {}}
    curves = {}
    for d in DTYPES:
        peak, efficiency, half = fit_gemm_curve([(m, n, k, rate) for m, n, k, dt, rate in shapes if dt == d])
        preset["peak_flops"][d] = float(f"{peak:.4g}")
        curves[d] = (efficiency, half)
    # One efficiency curve per preset, the default precision's (fp32): as a step runs its GEMMs.
    step = _spawn("step", 1)[0]
    if not step["gemms"] or not step["kernels"]:
        raise SystemExit(
            f"error: the profiled step shows {len(step['gemms'])} fp32 GEMMs and {len(step['kernels'])} bandwidth-bound "
            f"kernels of the kinds src.calibrate names (aten::mm, aten::addmm; aten::gelu, aten::native_layer_norm, ...): "
            f"this torch names its ops otherwise"
        )
    peak, efficiency, half = fit_gemm_curve([(g["m"], g["n"], g["k"], g["flops_per_s"]) for g in step["gemms"]])
    preset["peak_flops"]["fp32"] = float(f"{peak:.4g}")
    preset["gemm_max_efficiency"] = round(efficiency, 3)
    preset["gemm_half_dim"] = round(half, 1)
    preset.update(memory_figures(step))
    for k, rates in concurrent.items():
        # A share above 1 is the noise of two short measurements (k workers cannot beat one alone).
        preset["oversubscription"][k] = min(1.0, round(statistics.fmean(rates[r]["fp32"] for r in rates) / alone["fp32"], 3))
    host = _spawn("host", 1)[0]
    forward_kernel, backward_kernel = host_kernel_costs(host["forward"], host["forward_backward"])
    preset.update(host_forward_kernel_s=float(f"{forward_kernel:.4g}"), host_backward_kernel_s=float(f"{backward_kernel:.4g}"))
    zero3 = _spawn("zero3", 1)[0]
    fetch_s, fetch_byte_s = zero3_fetch_costs(zero3)
    preset.update(host_fetch_s=float(f"{fetch_s:.4g}"), host_fetch_byte_s=float(f"{fetch_byte_s:.4g}"))
    syncs = {k: _spawn("sync", k) for k in range(2, workers + 1)}
    skews = {k: _rounded(*fit_sync_skew(sync)) for k, sync in syncs.items()}
    links = {k: link_figures(_spawn("links", k), after_compute_points(syncs[k], k, skews[k])) for k in range(2, workers + 1)}
    handovers = {k: _spawn("handover", k) for k in range(2, workers + 1)}
    preset["by_workers"] = {
        k: {**figures, "sync_skew_s": skews[k][0], "sync_skew_build_s": skews[k][1]} for k, (figures, _) in links.items()
    }
    for k, handover in handovers.items():
        shares = preset["oversubscription"]
        seconds = handover_seconds(handover, shares[k], shares[(k + 1) // 2])
        preset["by_workers"][k]["core_handover_s"] = float(f"{seconds:.4g}")
    import torch

    return {
        "host": {
            **host_identity(),
            "torch": str(torch.__version__),
            "date": datetime.date.today().isoformat(),
            "workers": workers,
        },
        "preset": preset,
        "fits": {
            "gemm": {d: {"max_efficiency": curves[d][0], "half_dim": curves[d][1]} for d in DTYPES},
            "gemm_in_step_fp32": {"peak": peak, "max_efficiency": efficiency, "half_dim": half},
        },
        "measured": {
            "gemm_alone": [{"m": m, "n": n, "k": k, "dtype": d, "flops": rate} for m, n, k, d, rate in shapes],
            "gemm_concurrent": {k: {d: [rates[r][d] for r in sorted(rates)] for d in DTYPES} for k, rates in concurrent.items()},
            "links_by_workers": {k: kept for k, (_, kept) in links.items()},
            "skew_by_workers": {
                k: [{"gemms": g, "block_s": block, "round_s": round_} for g, block, round_ in _slowest(sync, "skew")]
                for k, sync in syncs.items()
            },
            "handover_by_workers": {k: {r: dict(h) for r, h in handover.items()} for k, handover in handovers.items()},
            "step": {"blocks_hidden_heads_batch_seq": [list(b) for b in STEP_BLOCKS], **step},
            "host_block": {"hidden_heads_tokens": list(HOST_BLOCK), **host},
            "zero3_by_width": {
                "blocks_heads_tokens": [ZERO3_BLOCKS, ZERO3_HEADS, ZERO3_TOKENS],
                **{hidden: zero3[hidden] for hidden in ZERO3_WIDTHS},
            },
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="the most workers runs will start (backend.workers)")
    parser.add_argument("--out", type=output_file, default=None, help=f"profile file (default: {OUT_DIR}/local-<cpu>.yaml)")
    parser.add_argument(
        "--update",
        action="store_true",
        help=f"write the repository's profile ({PROFILE_DIR}/local-<cpu>.yaml), which cluster=local reads",
    )
    args = parser.parse_args()
    if args.workers < 2:
        parser.error(f"--workers {args.workers}: links need at least 2 workers")
    if args.update and args.out:
        parser.error("--update writes the repository's profile; --out names another file: give one of them")
    profile = calibrate(args.workers)
    path = profile_path() if args.update else args.out or OUT_DIR / profile_path().name
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# `local` preset profile, measured by `python -m src.calibrate --workers {args.workers}` on "
        f"{profile['host']['cpu_model']} ({profile['host']['cores']} cores).\n"
    )
    path.write_text(header + yaml.safe_dump(profile, sort_keys=False))
    print(f"wrote {path}" + ("" if args.update else f" (cluster=local reads {profile_path()}: --update writes it)"))
    print(yaml.safe_dump({"preset": profile["preset"], "fits": profile["fits"]}, sort_keys=False))


if __name__ == "__main__":
    main()
