"""FlashAttention's measured rates on one device (conf/cluster/measured/attention/<name>.yaml).

The preset's GEMM curve prices FlashAttention's core as the GEMMs it computes (QK^T with
k = the head dimension, PV with n = it) at the curve's efficiency for those shapes. The
kernels are not GEMMs: each streams key and value tiles through on-chip memory, runs the
softmax between its two products and, in backward, recomputes the scores; how fast that
goes is a property of the kernel's version, not of the GEMM library. Measured by their
authors on an A100 80GB, FlashAttention 1's causal forward and backward reach 55-83 TFLOP/s
at head dimension 128 and FlashAttention 2's 99-189, where the curve gives 95-142 to both.

A table holds a kernel's rate (forward and backward FLOPs over their time, as the
benchmark counts them: 4 b s^2 h d a forward, halved under a causal mask, 2.5 times that
a backward) by mask, head dimension and sequence length. Between measured sequences the
rate is interpolated in log2 of the length; past the ends it is the nearer end's (a
sequence shorter than the shortest measured one runs at least as slowly: that end is an
upper bound). Between measured head dimensions it is interpolated linearly in the
dimension; below the smallest, the smallest's. Past the largest the table says nothing
(FlashAttention 1 and 2 stop at 128 and 256, the measurements at 128; a wider head, such
as a VAE's one 512-wide head, runs another kernel): `covers` is false and the compute
model prices that core on the curve.

A rate holds for the benchmark's grid. FlashAttention 2 runs a core as thread blocks (CTAs) of
`rows` query rows (forward) or key rows (backward) per head and sample, as many resident on an
SM at once as the table's `grid` says, dispatched in grid order; under a causal mask a forward
block of query block i reads i + 1 key blocks (light ones first) and a backward block of key
block j reads every query block from j on (heavy ones first). With few heads a GPU (a large
tensor-parallel degree, one sample a micro-batch) the longest blocks, not the total, bound the
kernel. `packing` prices that: each grid is list-scheduled on the device's slots, and a core's
time is the table's rate scaled by how well its grid packs against how well the benchmark's
did (batch x sequence = `benchmark.tokens`, heads = `benchmark.hidden` / head dimension).
Only the kernels and head dimensions the table's `grid` lists are packed; others run at the
measured rate whatever their grid.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from src.errors import ConfigError
from src.measured_files import measured_file, read_table, table_precisions

ATTENTION_DIR = Path(__file__).resolve().parent.parent / "conf" / "cluster" / "measured" / "attention"
MASKS = ("causal", "full")


def _clamped_line(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y at x on the broken line through (xs, ys) (xs increasing), the nearer end's y past them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class RateSeries:
    """One kernel's measured rates (FLOP/s) at one mask and head dimension, by sequence length."""

    log_seqs: tuple[float, ...]
    rates: tuple[float, ...]

    def at(self, seq: float) -> float:
        return _clamped_line(self.log_seqs, self.rates, math.log2(max(seq, 1.0)))


@dataclass(frozen=True)
class Launch:
    """How a kernel's pass splits a core into thread blocks: `rows` of the query (forward) or
    key (backward) sequence a block, `per_sm` blocks resident on an SM at once."""

    rows: int
    per_sm: int


def _makespan(groups: int, blocks: int, slots: int, heavy_first: bool, causal: bool) -> float:
    """Greedy list scheduling, in grid order, of `groups` x `blocks` thread blocks on `slots`:
    the time the last ends, a block of a full mask taking `blocks` steps, of a causal one j + 1
    (light first) or blocks - j (heavy first)."""
    free = [0.0] * slots
    end = 0.0
    for _ in range(groups):
        for j in range(blocks):
            steps = blocks if not causal else (blocks - j if heavy_first else j + 1)
            start = heapq.heappop(free)
            end = max(end, start + steps)
            heapq.heappush(free, start + steps)
    return end


@functools.lru_cache(maxsize=4096)
def _packing(groups: int, blocks: int, slots: int, heavy_first: bool, causal: bool) -> float:
    """The share of the slots' time a grid keeps busy (1: every slot to the end)."""
    steps = groups * (blocks * blocks if not causal else blocks * (blocks + 1) / 2)
    return steps / (slots * _makespan(groups, blocks, slots, heavy_first, causal))


@dataclass(frozen=True)
class AttentionMeasurements:
    """FlashAttention kernels' measured rates on one device, at `precisions`; `sms`, `benchmark`
    and `grid` (kernel -> head dimension -> (forward, backward) Launch) price a core's grid
    against the benchmark's where the table states them."""

    name: str
    device: str
    source: str
    precisions: tuple[str, ...]
    # kernel -> mask -> head dimension -> rates by sequence length
    series: Mapping[str, Mapping[str, Mapping[int, RateSeries]]]
    sms: int = 0
    benchmark_tokens: int = 0
    benchmark_hidden: int = 0
    grid: Mapping[str, Mapping[int, tuple[Launch, Launch]]] = dataclasses.field(default_factory=dict)

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(self.series)

    def covers(self, kernel: str, causal: bool, head_dim: float) -> bool:
        return head_dim <= max(self.series[kernel]["causal" if causal else "full"])

    def rate(self, kernel: str, causal: bool, head_dim: float, seq: float) -> float:
        """FLOP/s of `kernel`'s forward and backward over `seq` keys at `head_dim` (one the
        table covers)."""
        by_dim = self.series[kernel]["causal" if causal else "full"]
        dims = sorted(by_dim)
        if head_dim > dims[-1]:
            raise ValueError(f"head dimension {head_dim} is past the table's largest, {dims[-1]}")
        return _clamped_line(dims, [by_dim[d].at(seq) for d in dims], head_dim)

    def packing(self, kernel: str, causal: bool, head_dim: float, seq: float, groups: float) -> tuple[float, float]:
        """How much longer than the table's rate says a core's forward and backward take, for
        `groups` heads x samples over `seq` queries and keys: the benchmark grid's packing over
        the core's, each pass on its own slots (1, 1 where the table states no grid for it)."""
        launches = self.grid.get(kernel, {}).get(int(head_dim)) if float(head_dim).is_integer() else None
        if launches is None:
            return 1.0, 1.0
        bench_groups = max(1, self.benchmark_tokens // max(int(seq), 1)) * (self.benchmark_hidden // int(head_dim))
        factors = []
        for launch, heavy_first in zip(launches, (False, True)):
            blocks, slots = max(1, math.ceil(seq / launch.rows)), self.sms * launch.per_sm
            bench = _packing(bench_groups, blocks, slots, heavy_first, causal)
            factors.append(bench / _packing(max(1, round(groups)), blocks, slots, heavy_first, causal))
        return factors[0], factors[1]


def measured_attention(name: str, cluster: str = "?") -> AttentionMeasurements:
    """The measured table conf/cluster/measured/attention/<name>.yaml, checked."""
    path = measured_file(ATTENTION_DIR, "conf/cluster/measured/attention", name, "attention measurements", cluster)
    return _read(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read(path: Path, mtime_ns: int) -> AttentionMeasurements:
    where = f"conf/cluster/measured/attention/{path.name}"
    keys = ["name", "device", "source", "method", "precisions", "sequences", "rates", "sms", "benchmark", "grid"]
    data = read_table(path, where, keys, ("device", "source", "method"))
    precisions = table_precisions(data, where, ("bf16", "fp16"), "16-bit precisions the rates")
    seqs = data.get("sequences")
    if (
        not isinstance(seqs, list)
        or len(seqs) < 2
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in seqs)
        or seqs != sorted(set(seqs))
    ):
        raise ConfigError(f"{where}: sequences lists two or more increasing positive lengths, got {seqs!r}")
    rates = data.get("rates")
    if not isinstance(rates, Mapping) or not rates:
        raise ConfigError(f"{where}: rates maps each kernel to its masks' rates, got {rates!r}")
    series = {str(kernel): _kernel_series(where, str(kernel), masks, seqs) for kernel, masks in rates.items()}
    grid = _grid(where, data.get("grid") or {}, series)
    sms, bench = data.get("sms"), data.get("benchmark") or {}
    if not isinstance(bench, Mapping):
        raise ConfigError(f"{where}: benchmark states the benchmark's tokens and hidden, got {bench!r}")
    if grid and not (_positive(sms) and all(_positive(bench.get(k)) for k in ("tokens", "hidden"))):
        raise ConfigError(f"{where}: a grid needs the device's sms and the benchmark's tokens and hidden, got {sms!r}, {bench!r}")
    return AttentionMeasurements(
        name=path.stem,
        device=str(data["device"]),
        source=str(data["source"]),
        precisions=precisions,
        series=series,
        sms=int(sms or 0),
        benchmark_tokens=int(bench.get("tokens") or 0),
        benchmark_hidden=int(bench.get("hidden") or 0),
        grid=grid,
    )


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _grid(where: str, grid: Any, series: Mapping[str, Any]) -> dict[str, dict[int, tuple[Launch, Launch]]]:
    """kernel -> head dimension -> {forward, backward: {rows, per_sm}}, for kernels the table rates."""
    if not isinstance(grid, Mapping):
        raise ConfigError(f"{where}: grid maps kernels to head dimensions' launches, got {grid!r}")
    out: dict[str, dict[int, tuple[Launch, Launch]]] = {}
    for kernel, by_dim in grid.items():
        if kernel not in series or not isinstance(by_dim, Mapping):
            raise ConfigError(f"{where}: grid.{kernel} is not a rated kernel's head dimensions: {sorted(series)}")
        out[str(kernel)] = {}
        for dim, passes in by_dim.items():
            ok = isinstance(passes, Mapping) and set(passes) == {"forward", "backward"}
            ok = ok and all(isinstance(passes[p], Mapping) and set(passes[p]) == {"rows", "per_sm"} for p in passes)
            if not _positive(dim) or not ok or not all(_positive(v) for p in passes.values() for v in p.values()):
                raise ConfigError(f"{where}: grid.{kernel}.{dim} gives forward and backward positive rows and per_sm, got {passes!r}")
            out[str(kernel)][int(dim)] = (Launch(**passes["forward"]), Launch(**passes["backward"]))
    return out


def _kernel_series(where: str, kernel: str, masks: Any, seqs: list[int]) -> dict[str, dict[int, RateSeries]]:
    if not isinstance(masks, Mapping) or set(masks) != set(MASKS):
        raise ConfigError(f"{where}: kernel {kernel} needs rates under both masks {list(MASKS)}, got {masks!r}")
    out: dict[str, dict[int, RateSeries]] = {}
    for mask in MASKS:
        by_dim = masks[mask]
        if not isinstance(by_dim, Mapping) or not by_dim:
            raise ConfigError(f"{where}: {kernel}.{mask} maps head dimensions to rates, got {by_dim!r}")
        out[mask] = {}
        for dim, row in by_dim.items():
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ConfigError(f"{where}: {kernel}.{mask}: a head dimension is a positive integer, got {dim!r}")
            if not isinstance(row, list) or len(row) != len(seqs):
                raise ConfigError(f"{where}: {kernel}.{mask}.{dim} lists one rate per sequence ({len(seqs)}), got {row!r}")
            points = [(s, r) for s, r in zip(seqs, row) if r is not None]
            if len(points) < 1 or any(isinstance(r, bool) or not isinstance(r, (int, float)) or r <= 0 for _, r in points):
                raise ConfigError(f"{where}: {kernel}.{mask}.{dim}: rates are positive TFLOP/s (null: not measured), got {row!r}")
            out[mask][dim] = RateSeries(tuple(math.log2(s) for s, _ in points), tuple(float(r) * 1e12 for _, r in points))
    return out
