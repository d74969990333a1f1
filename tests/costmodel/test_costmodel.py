"""The cost model: GEMM efficiency, ring collectives, link sharing, memory of model states."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from src.cluster import ClusterSpec, family_sharing
from src.costmodel.comm import CommModel
from src.mesh import Sharding, tensor_parallel
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


def test_a_gemm_streams_at_a_copys_rate_and_other_memory_bound_kernels_at_theirs() -> None:
    # Half the HBM for the framework's kernels, 0.9 of it for a copy: a GEMM bound by its
    # operands' traffic (a vector times a matrix, at any GEMM efficiency) moves them at 0.9,
    # an optimizer step's passes at 0.5.
    cluster = replace(CLUSTER, memory_efficiency=0.5, copy_efficiency=0.9, gemm_half_dim=1e-6)
    compute, unset = ComputeModel(cluster, "bf16"), ComputeModel(replace(cluster, copy_efficiency=0.0), "bf16")
    m, n, k = 1, 16384, 16384
    assert compute.gemm_time(m, n, k) == pytest.approx(2 * (m * k + k * n + m * n) / 0.9e12)
    assert unset.gemm_time(m, n, k) == pytest.approx(2 * (m * k + k * n + m * n) / 0.5e12)
    assert compute.memory_time(1e9) == pytest.approx(1e9 / 0.5e12)


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
        # Par4D's placement-aware beta (eq. 10; docs/strategies.md, Par4D), derived by hand with G_node = 4 and beta_inter = 1.
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


# ---- the library's protocols, the framework's host time, point-to-point and all-to-all ------
def test_a_collective_takes_the_fastest_protocol_for_its_size() -> None:
    """Two protocols by hand: a low-latency one that moves data at a quarter of the bus
    bandwidth, a bulk one with a larger latency at the full rate."""
    from src.cluster import Protocol

    ll = Protocol(base_s=5e-6, intra_step_s=0.5e-6, share=0.25)
    simple = Protocol(base_s=10e-6, intra_step_s=3e-6, share=1.0)
    comm = CommModel(replace(CLUSTER, ring_protocols={"ll": ll, "simple": simple}, tree_protocols={}))
    inside = (0, 1, 2, 3)  # 100 GB/s NVLink, 3 steps
    small, large = 1e4, 1e9
    assert comm.collective_time("all_gather", inside, small) == pytest.approx(5e-6 + 3 * 0.5e-6 + 0.75 * small / 25e9)
    assert comm.collective_time("all_gather", inside, large) == pytest.approx(10e-6 + 3 * 3e-6 + 0.75 * large / 100e9)


def test_a_ring_spanning_nodes_pays_the_hosts_floor_on_every_step_and_its_size_correction() -> None:
    from src.cluster import Protocol

    simple = Protocol(base_s=0.0, intra_step_s=1e-6, inter_step_s=10e-6, net_step_floor_s=4e-6, size_correction=(1.0,) * 14 + (0.5,))
    comm = CommModel(replace(CLUSTER, ring_protocols={"simple": simple}, tree_protocols={}))
    ranks = tuple(range(8))  # 2 nodes: 6 steps inside them at the 4 us floor, 1 across
    nbytes = 64 * 2**14  # the 15th power of two from 64 B: corrected to half the rate
    latency, transfer = comm.collective_parts("reduce_scatter", ranks, nbytes)
    assert latency == pytest.approx(6 * 4e-6 + 10e-6)
    assert transfer == pytest.approx(7 / 8 * nbytes / (0.5 * 50e9))


def test_a_layer_costs_the_longer_of_device_and_host_time_on_a_gpu_and_both_on_a_cpu() -> None:
    layer = transformer_layer(8, 64, 2)  # tiny: the host's 12 forward kernels dominate
    unit = UnitSpec("llm", (layer,), 64, 2, 8, 8 * 64)
    model = ModelSpec("m", (unit,))
    work = Work("llm", "fwd", 1, (0, 1))
    gpu = replace(CLUSTER, host_forward_kernel_s=30e-6, host_backward_kernel_s=60e-6)
    device = ComputeModel(CLUSTER, "bf16").work_time(work, model)
    assert ComputeModel(gpu, "bf16").work_time(work, model) == pytest.approx(max(device, 12 * 30e-6))
    cpu = replace(gpu, host_async=False)
    assert ComputeModel(cpu, "bf16").work_time(work, model) == pytest.approx(device + 12 * 30e-6)
    # CPU workers sharing cores: the framework's time, measured on one worker alone, runs
    # at the share of the cores, as the arithmetic does.
    shared = replace(cpu, oversubscription={4: 0.25})  # CLUSTER has 4 devices a node
    shared_device = ComputeModel(replace(CLUSTER, oversubscription={4: 0.25}), "bf16").work_time(work, model)
    assert ComputeModel(shared, "bf16").work_time(work, model) == pytest.approx(shared_device + 4 * 12 * 30e-6)
    backward = Work("llm", "bwd", 1, (0, 1))
    assert ComputeModel(gpu, "bf16").work_time(backward, model) == pytest.approx(
        18 * 60e-6
    )  # 14 input-gradient + 4 weight-gradient kernels (eager)


def test_the_host_issues_ahead_while_the_device_runs_a_device_bound_layer() -> None:
    # A large layer (device-bound) and three tiny ones (host-bound) in one work: forward, the
    # host issues the tiny layers' kernels while the device runs the large one, so their host
    # time hides whole; backward runs them first, where nothing runs ahead to hide it.
    big, tiny = transformer_layer(2048, 2048, 16), transformer_layer(8, 64, 2)
    model = ModelSpec("m", (UnitSpec("llm", (big, tiny, tiny, tiny), 64, 2, 8, 8 * 64),))
    gpu = ComputeModel(replace(CLUSTER, host_forward_kernel_s=30e-6, host_backward_kernel_s=60e-6), "bf16")
    for phase in ("fwd", "bwd"):
        alone = [gpu.work_streams(Work("llm", phase, 1, (i, i + 1)), model) for i in range(4)]
        (big_device, big_host), (tiny_device, tiny_host) = alone[0], alone[1]
        assert big_device > big_host + 3 * tiny_host and tiny_host > tiny_device
        for i, (device, host) in enumerate(alone):  # a layer alone takes the longer of the two
            assert gpu.work_time(Work("llm", phase, 1, (i, i + 1)), model) == pytest.approx(max(device, host))
        work = Work("llm", phase, 1, (0, 4))
        assert gpu.work_streams(work, model) == pytest.approx((big_device + 3 * tiny_device, big_host + 3 * tiny_host))
        expected = big_device + 3 * tiny_device if phase == "fwd" else big_device + 3 * tiny_host
        assert gpu.work_time(work, model) == pytest.approx(expected)


def test_a_layer_replayed_from_cuda_graphs_costs_the_host_one_launch_per_pass() -> None:
    layer = transformer_layer(8, 64, 2)  # host-bound when issued kernel by kernel
    model = ModelSpec("m", (UnitSpec("llm", (layer,), 64, 2, 8, 8 * 64),))
    eager = replace(CLUSTER, host_forward_kernel_s=30e-6, host_backward_kernel_s=60e-6)
    graphed = replace(eager, host_launch="graphed")
    for phase, launch, kernels in (("fwd", 30e-6, 12), ("bwd", 60e-6, 18)):
        work = Work("llm", phase, 1, (0, 1))
        device = ComputeModel(CLUSTER, "bf16").work_time(work, model)
        assert device < launch * kernels
        assert ComputeModel(eager, "bf16").work_time(work, model) == pytest.approx(launch * kernels)
        assert ComputeModel(graphed, "bf16").work_time(work, model) == pytest.approx(max(device, launch))


def test_pytorch_amp_adds_its_casts_to_the_host_s_work_at_a_forward_kernel_s_cost() -> None:
    """Under AMP a block's four Linears cast their weights and biases, its two eager
    LayerNorms' outputs are cast for the GEMMs after them, and backward casts each back:
    10 more operators each way, each at the forward kernel's host cost (measured: 9.8 and
    12 more kernels, 28-35 us each on an H200's host). A framework that folds the biases'
    and the norms' gradients into other kernels leaves only the weights' casts known."""
    from src.models.grad_kernels import with_param_grad_kernels

    layer = transformer_layer(8, 64, 2)  # host-bound
    model = ModelSpec("m", (UnitSpec("llm", (layer,), 64, 2, 8, 8 * 64),))
    eager = replace(CLUSTER, host_forward_kernel_s=30e-6, host_backward_kernel_s=60e-6)
    amp = ComputeModel(replace(eager, amp=True), "bf16")
    fused = with_param_grad_kernels(model, "fused")
    for phase, kernels in (("fwd", 12 * 30e-6), ("bwd", 18 * 60e-6)):
        work = Work("llm", phase, 1, (0, 1))
        assert ComputeModel(eager, "bf16").work_time(work, model) == pytest.approx(kernels)
        assert amp.work_time(work, model) == pytest.approx(kernels + 10 * 30e-6)
        assert amp.work_time(work, fused) == pytest.approx(kernels + 4 * 30e-6)
        fp32 = replace(eager, peak_flops={"fp32": 100e12})  # fp32 runs cast nothing
        unchanged = ComputeModel(fp32, "fp32").work_time(work, model)
        assert ComputeModel(replace(fp32, amp=True), "fp32").work_time(work, model) == unchanged
    # Full recomputation re-runs the forward's casts in backward.
    recomputed = Work("llm", "bwd", 1, (0, 1), recompute="full")
    plain = ComputeModel(eager, "bf16").work_time(recomputed, model)
    assert amp.work_time(recomputed, model) == pytest.approx(plain + 20 * 30e-6)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_stepccl_chunk_issues_the_pass_once_and_its_paired_gemms_once_a_chunk(sequence_parallel: bool) -> None:
    """StepCCL cuts only the GEMMs paired with a TP collective (DistTrain §7): the host
    issues a pass's other kernels once over its chunks and each paired GEMM once a chunk:
    one per all-reduce, two under sequence parallelism (all-gather and reduce-scatter)."""
    layer = transformer_layer(8, 64, 2)  # host-bound: its time is the host's
    assert layer.tp_allreduces == 2
    model = ModelSpec("m", (UnitSpec("llm", (layer,), 64, 2, 8, 8 * 64),))
    eager = ComputeModel(replace(CLUSTER, host_forward_kernel_s=30e-6, host_backward_kernel_s=60e-6), "bf16")
    sharding = tensor_parallel(2, sequence_parallel)
    paired = 2 * (2 if sequence_parallel else 1)
    for phase, launch, kernels in (("fwd", 30e-6, 12), ("bwd", 60e-6, 18)):
        whole = Work("llm", phase, 1, (0, 1), sharding=sharding)
        assert eager.work_time(whole, model) == pytest.approx(kernels * launch)
        chunk = replace(whole, fraction=0.25, chunks=4)
        assert eager.work_time(chunk, model) == pytest.approx((kernels - paired) * launch / 4 + paired * launch)
        # The four chunks: the pass once, and three more launches of each paired GEMM.
        assert 4 * eager.work_time(chunk, model) == pytest.approx((kernels + 3 * paired) * launch)


def test_zero3_fetches_cost_the_host_per_fetch_and_byte_whatever_the_load() -> None:
    layer = transformer_layer(8, 64, 2)
    model = ModelSpec("m", (UnitSpec("llm", (layer,), 64, 2, 8, 8 * 64),))
    cpu = replace(CLUSTER, host_async=False, host_fetch_s=1e-3, host_fetch_byte_s=1e-9)
    plain, fetching = Work("llm", "fwd", 1, (0, 1)), Work("llm", "fwd", 1, (0, 1), fetches=6, fetched=1e6)
    fetch = 6 * 1e-3 + 1e6 * 2 * 1e-9  # bf16 parameters
    model_cpu = ComputeModel(cpu, "bf16")
    assert model_cpu.work_time(fetching, model) == pytest.approx(model_cpu.work_time(plain, model) + fetch)
    heavy = replace(fetching, load=3.0)
    assert model_cpu.work_time(heavy, model) == pytest.approx(3 * model_cpu.work_time(plain, model) + fetch)
    # A GPU's host runs ahead: the fetches show only where they outlast the layer's kernels.
    gpu = ComputeModel(replace(cpu, host_async=True), "bf16")
    assert gpu.work_time(fetching, model) == pytest.approx(max(ComputeModel(CLUSTER, "bf16").work_time(plain, model), fetch))


def test_devices_sharing_cores_run_bandwidth_bound_kernels_at_their_share_too() -> None:
    # Four workers a node at a quarter of a core each: a layer norm's bytes move at a
    # quarter of the rate, as its GEMMs' FLOPs do; devices that share nothing are unchanged.
    alone, shared = ComputeModel(CLUSTER, "bf16"), ComputeModel(replace(CLUSTER, oversubscription={4: 0.25}), "bf16")
    launch = CLUSTER.kernel_overhead_s
    assert shared.memory_time(1e9) - launch == pytest.approx(4 * (alone.memory_time(1e9) - launch))
    assert shared.gemm_time(4096, 4096, 4096) - launch == pytest.approx(4 * (alone.gemm_time(4096, 4096, 4096) - launch))


def test_a_send_across_nodes_leaves_through_one_nic() -> None:
    nics = replace(CLUSTER, nics=4, p2p_bandwidth=80e9)
    comm = CommModel(nics)
    assert comm.p2p_time(0, 1, 1e9) == pytest.approx(1e-6 + 1e9 / 80e9)  # inside: the library's p2p rate
    assert comm.p2p_time(0, 4, 1e9) == pytest.approx(5e-6 + 1e9 / 12.5e9)  # one of 4 NICs of 50 GB/s
    assert comm.p2p_time(0, 4, 1e9, sharing=8) == pytest.approx(5e-6 + 1e9 / 6.25e9)  # 8 sends share the node's NICs


def test_an_all_to_all_shares_the_nodes_nics_among_its_members_there() -> None:
    comm = CommModel(CLUSTER)
    ranks = tuple(range(8))  # 4 members on each of 2 nodes
    latency, transfer = comm.collective_parts("all_to_all", ranks, 8e8)
    # Each rank sends 4/8 of its buffer off the node, its node's 50 GB/s shared by 4; 3/8 over NVLink.
    assert transfer == pytest.approx(max(3 / 8 * 8e8 / 100e9, 4 / 8 * 8e8 / (50e9 / 4)))
    assert latency == pytest.approx(6 * 1e-6 + 1 * 5e-6)


def test_a_row_exchange_first_gathers_every_ranks_layout() -> None:
    comm = CommModel(CLUSTER)
    ranks = (0, 1, 2, 3)
    gather = comm.collective_time("all_gather", ranks, 32 * 4)
    latency, transfer = comm.row_exchange_parts(ranks, 4e6)
    swap = comm.collective_parts("all_to_all", ranks, 4e6)
    assert (latency, transfer) == pytest.approx((gather + swap[0], swap[1]))


def test_nccls_model_reproduces_a_public_8_gpu_all_reduce_curve() -> None:
    """nccl-tests all_reduce_perf on one 8-GPU NVLink node (kvcache-ai/Mooncake PR #3484:
    1, 4, 16, 32 MiB in 27.8, 53.2, 121.3, 195.4 us, bus bandwidth up to 300 GB/s, so a
    Hopper node) against the hopper preset's NCCL model: within 30 %, never faster by more
    than 10 %."""
    import yaml
    from pathlib import Path

    from src.cluster import cluster_from_config

    preset = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "cluster" / "hopper.yaml").read_text())
    comm = CommModel(cluster_from_config(preset))
    for size, measured in ((2**20, 27.8e-6), (2**22, 53.2e-6), (2**24, 121.3e-6), (2**25, 195.4e-6)):
        modelled = comm.collective_time("all_reduce", tuple(range(8)), size)
        assert 0.9 < modelled / measured < 1.3, (size, modelled, measured)


def test_causal_flash_attention_runs_the_score_tiles_on_and_below_the_diagonal() -> None:
    """FlashAttention under a causal mask skips the tiles of scores above the diagonal: of
    16 x 16 tiles of 128 rows (a 2048-token sequence), 136 run; eager attention computes
    every score before masking, and a unit that attends both ways masks none."""
    from src.costmodel.compute import FLASH_TILE
    from src.models.attention import with_attention

    compute = ComputeModel(CLUSTER, "bf16")
    eager = transformer_layer(2048, 1024, 16)
    unit = UnitSpec(name="u", layers=(eager,), hidden=1024, heads=16, seq_len=2048, output_elems=0)
    flash = with_attention(ModelSpec(name="m", units=(unit,)), "flash").units[0].layers[0]
    ran = (2048 // FLASH_TILE + 1) / (2 * (2048 // FLASH_TILE))
    assert ran == pytest.approx(136 / 256)
    core = [k for k in flash.kernels if k.kind == "gemm" and k.attention_core]
    assert {k.name for k in core} == {"attn_scores", "attn_context"}
    for kernel in core:
        full, causal = compute.kernel_times(kernel, 2, Sharding(), 1), compute.kernel_times(kernel, 2, Sharding(), 1, causal=True)
        assert causal.fwd == pytest.approx(ran * full.fwd) and causal.bwd_input == pytest.approx(ran * full.bwd_input)
    others = [k for k in flash.kernels if not k.attention_core]
    assert all(compute.kernel_times(k, 2, Sharding(), 1, causal=True) == compute.kernel_times(k, 2, Sharding(), 1) for k in others)
    assert compute.layer_times(flash, 2, causal=True).fwd < compute.layer_times(flash, 2).fwd
    assert compute.layer_times(eager, 2, causal=True) == compute.layer_times(eager, 2)
