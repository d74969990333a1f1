"""The cost model: GEMM efficiency, ring collectives, link sharing, memory of model states."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from src.cluster import ClusterSpec, family_sharing
from src.costmodel.comm import CommModel
from src.mesh import tensor_parallel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import model_state_bytes
from src.models.layers import transformer_layer
from src.models.spec import ModelSpec, UnitSpec
from src.program import Work

CLUSTER = ClusterSpec(
    name="test",
    device="dev",
    nodes=2,
    devices_per_node=4,
    peak_flops={"bf16": 100e12},
    memory_gib=40,
    memory_bandwidth=1e12,
    intra_bandwidth=100e9,
    intra_latency=1e-6,
    inter_bandwidth=50e9,
    inter_latency=5e-6,
    gemm_max_efficiency=0.8,
    gemm_half_dim=128,
    memory_efficiency=1.0,
    intra_efficiency=1.0,
    inter_efficiency=1.0,
    kernel_overhead_s=0.0,
    reserved_memory_gib=1.0,
    default_precision="bf16",
)


def test_large_gemm_approaches_max_efficiency_and_thin_ones_fall_off() -> None:
    compute = ComputeModel(CLUSTER, "bf16")
    big = 2 * 8192**3 / compute.gemm_time(8192, 8192, 8192) / 100e12
    assert big == pytest.approx(0.8 * (8192 / (8192 + 128)) ** 3)
    # The same FLOPs as a thin GEMM (a small per-device batch) run slower.
    thin = 2 * 64 * 8192 * 8192 * 128 / (128 * compute.gemm_time(64, 8192, 8192)) / 100e12
    assert thin < 0.6 * big


def test_over_partitioned_tp_is_less_efficient_per_flop() -> None:
    compute = ComputeModel(CLUSTER, "bf16")
    layer = transformer_layer(77, 1024, 16)
    t1 = compute.layer_times(layer, 8, tensor_parallel(1)).fwd
    t8 = compute.layer_times(layer, 8, tensor_parallel(8)).fwd
    # Perfect scaling would be t1 / 8; a small text tower split 8 ways is far from it.
    assert t8 > 1.5 * t1 / 8


def test_gemm_time_is_memory_bound_below_the_roofline() -> None:
    compute = ComputeModel(CLUSTER, "bf16")
    m, n, k = 1, 16384, 16384
    assert compute.gemm_time(m, n, k) == pytest.approx(
        max(2 * m * n * k / (100e12 * compute.efficiency(m, n, k)), 2 * (m * k + k * n + m * n) / 1e12)
    )


def test_ring_collectives_follow_the_alpha_beta_formulas() -> None:
    comm = CommModel(CLUSTER)
    inside = (0, 1, 2, 3)
    size = 1e9
    assert comm.collective_time("all_reduce", inside, size) == pytest.approx(2 * 3 * 1e-6 + 2 * 0.75 * size / 100e9)
    assert comm.collective_time("all_gather", inside, size) == pytest.approx(3 * 1e-6 + 0.75 * size / 100e9)
    assert comm.collective_time("reduce_scatter", inside, size) == comm.collective_time("all_gather", inside, size)
    across = (0, 4)
    # Across nodes the ring is limited by the node's NICs, split among the rings sharing them.
    assert comm.collective_time("all_reduce", across, size, sharing=4) == pytest.approx(2 * 1 * 5e-6 + 2 * 0.5 * size / (50e9 / 4))
    assert comm.collective_time("all_reduce", (3,), size) == 0.0
    assert comm.p2p_time(0, 4, size) == pytest.approx(5e-6 + size / 50e9)


def _par4d_groups(gx: int, gy: int, gz: int, gd: int, axis: int) -> list[tuple[int, ...]]:
    """Groups along one axis of Par4D's grid, rank = i + Gx(j + Gy(k + Gz d))."""
    dims = (gx, gy, gz, gd)
    groups: dict[tuple, list[int]] = {}
    for d in range(gd):
        for k in range(gz):
            for j in range(gy):
                for i in range(gx):
                    index = (i, j, k, d)
                    rank = i + gx * (j + gy * (k + gz * d))
                    key = tuple(v for a, v in enumerate(index) if a != axis)
                    groups.setdefault(key, []).append(rank)
    assert all(len(g) == dims[axis] for g in groups.values())
    return [tuple(g) for g in groups.values()]


@pytest.mark.parametrize(
    "grid,expected",
    [
        # ALGORITHMS.md §4.3 (derived): placement-aware beta with G_node = 4 and beta_inter = 1.
        ((2, 2, 2, 2), (None, None, 4, 4)),
        ((1, 1, 8, 2), (None, None, 1, 4)),
        ((8, 1, 1, 2), (1, 4, 4, 4)),
    ],
)
def test_family_sharing_reproduces_par4d_eq10(grid, expected) -> None:
    cluster = replace(CLUSTER, nodes=4, devices_per_node=4)
    for axis, want in enumerate(expected):
        if grid[axis] == 1:
            continue
        groups = _par4d_groups(*grid, axis)
        if want is None:
            assert not any(cluster.spans_nodes(g) for g in groups)
        else:
            assert family_sharing(cluster, groups) == want


def test_model_states_by_precision_and_zero_stage() -> None:
    params, dp = 1e9, 8
    plain = model_state_bytes(params, "bf16", frozen=False, zero_stage=0, dp=dp)
    assert sum(plain.values()) == 18e9  # 2 + 4 + 12 bytes per parameter
    zero1 = model_state_bytes(params, "bf16", frozen=False, zero_stage=1, dp=dp)
    assert sum(zero1.values()) == pytest.approx(6e9 + 12e9 / dp)
    zero3 = model_state_bytes(params, "bf16", frozen=False, zero_stage=3, dp=dp)
    assert sum(zero3.values()) == pytest.approx(18e9 / dp)
    assert sum(model_state_bytes(params, "fp16", False, 0, dp).values()) == 16e9
    assert sum(model_state_bytes(params, "bf16", True, 0, dp).values()) == 2e9


def test_work_prices_recompute_and_frozen_units() -> None:
    layer = transformer_layer(128, 512, 8)
    unit = UnitSpec("tower", (layer,) * 4, 512, 8, 128, 128 * 512)
    model = ModelSpec("m", (unit,))
    frozen = ModelSpec("m", (replace(unit, frozen=True),))
    compute = ComputeModel(CLUSTER, "bf16")
    times = compute.layer_times(layer, 2)
    fwd = compute.work_time(Work("tower", "fwd", 2, (0, 4)), model)
    bwd = compute.work_time(Work("tower", "bwd", 2, (0, 4)), model)
    full = compute.work_time(Work("tower", "bwd", 2, (0, 4), recompute="full"), model)
    selective = compute.work_time(Work("tower", "bwd", 2, (0, 4), recompute="selective"), model)
    assert fwd == pytest.approx(4 * times.fwd)
    assert bwd == pytest.approx(4 * (times.bwd_input + times.bwd_weight))
    assert full == pytest.approx(bwd + fwd)
    assert bwd < selective < full
    # A frozen unit that nothing upstream trains needs no backward at all.
    assert compute.work_time(Work("tower", "bwd", 2, (0, 4)), frozen) == 0.0
    assert math.isclose(compute.work_time(Work("tower", "optimizer", 0, (0, 4)), frozen), 0.0)
