"""Scale-out communication: what grows with the number of nodes, and what runs at once.

- Ring latency follows NCCL's model: intra-node steps at NVLink latency, node-crossing
  steps at the network's; all-reduces across nodes take the faster of ring and tree.
- Transfers of different families that cross a node's NICs at once share them.
- Compute overlapping a communication kernel runs on the SMs it leaves.
- ZeRO-3's per-layer collectives are latency bound at thousands of GPUs and small batch.
Hand computations use the toy cluster of tests/sim/test_sim_programs.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from src.cluster import cluster_from_config
from src.costmodel.comm import CommModel
from src.errors import ConfigError
from src.program import Collective, Compute, Group, Program, RankProgram, Wait, Work
from src.setup import plan_run, validate
from src.sim.engine import simulate
from src.sim.intervals import Intervals
from tests.composing import composed
from tests.sim.test_sim_programs import INTER_BW, INTER_LAT, INTRA_LAT, MODEL, MS, PRECISION, link, make_cluster, recv, send

F1 = Work("llm", "fwd", 1, (0, 1))  # 2 ms on the toy cluster
REL = 1e-9


# ---- ring and tree latencies (NCCL's tuning model) ----------------------------------------
def test_ring_latency_pays_the_network_only_on_node_crossing_steps() -> None:
    comm = CommModel(make_cluster(nodes=8, devices_per_node=4))
    lat, _ = comm.collective_parts("all_gather", tuple(range(32)), 1e6)
    assert lat == pytest.approx((32 - 8) * INTRA_LAT + (8 - 1) * INTER_LAT, rel=REL)
    one_per_node, _ = comm.collective_parts("reduce_scatter", tuple(range(0, 32, 4)), 1e6)
    assert one_per_node == pytest.approx(7 * INTER_LAT, rel=REL)
    inside, _ = comm.collective_parts("all_gather", (0, 1, 2, 3), 1e6)
    assert inside == pytest.approx(3 * INTRA_LAT, rel=REL)
    ring, _ = comm.collective_parts("all_reduce", tuple(range(8)), 1e9)  # 2 nodes, large: the ring
    assert ring == pytest.approx(2 * (6 * INTRA_LAT + 1 * INTER_LAT), rel=REL)


def test_ring_latency_grows_with_the_number_of_nodes() -> None:
    comm = CommModel(make_cluster(nodes=512, devices_per_node=4))
    small = comm.collective_time("all_gather", tuple(range(0, 64 * 4, 4)), 1e3)  # 64 nodes
    large = comm.collective_time("all_gather", tuple(range(0, 512 * 4, 4)), 1e3)  # 512 nodes
    assert large / small == pytest.approx(511 / 63, rel=1e-3)


def test_small_all_reduce_across_many_nodes_takes_the_tree() -> None:
    comm = CommModel(make_cluster(nodes=1024, devices_per_node=1))
    ranks = tuple(range(1024))
    lat, data = comm.collective_parts("all_reduce", ranks, 8.0)
    assert lat == pytest.approx(2 * math.log2(1024) * INTER_LAT, rel=REL)  # not 2 x 1023 steps
    assert data == pytest.approx(2 * 8.0 / INTER_BW, rel=REL)
    assert comm.collective_time("all_reduce", ranks, 8.0) < 2 * 1023 * INTER_LAT / 50


def test_large_all_reduce_across_nodes_keeps_the_ring() -> None:
    comm = CommModel(make_cluster(nodes=4, devices_per_node=1))
    lat, data = comm.collective_parts("all_reduce", (0, 1, 2, 3), 1e10)
    assert data == pytest.approx(2 * 3 / 4 * 1e10 / INTER_BW, rel=REL)
    assert lat == pytest.approx(2 * 3 * INTER_LAT, rel=REL)


# ---- families sharing a node's NICs ------------------------------------------------------
def _dp_under_a_send(devices_per_node: int, **cluster_overrides) -> tuple[float, float]:
    """Rank 0 sends 4e8 B to rank 1 while both all-reduce 1e8 B on a DP stream.
    Returns (the all-reduce's end, its time alone)."""
    cluster = make_cluster(nodes=2, devices_per_node=devices_per_node, **cluster_overrides)
    program = Program(
        world_size=2,
        classes=[
            RankProgram(
                (0,),
                [Collective("all_reduce", "dp", 1e8, "dp", stream="dp", blocking=False, handle="h"), send("act"), Wait("h")],
                label="left",
            ),
            RankProgram(
                (1,),
                [Collective("all_reduce", "dp", 1e8, "dp", stream="dp", blocking=False, handle="h"), recv("act"), Wait("h")],
                label="right",
            ),
        ],
    )
    program.add_group(Group("dp", (0, 1)))
    link(program, "act", 0, 1, 4e8, "pp")
    timeline = simulate(program, MODEL, cluster, PRECISION)
    span = next(s for s in timeline.ranks[0].spans if s.name.startswith("all_reduce"))
    return span.end, CommModel(cluster).collective_time("all_reduce", (0, 1), 1e8)


def test_transfers_of_two_families_share_the_nics() -> None:
    end, alone = _dp_under_a_send(devices_per_node=1)
    transfer = 2 * 0.5 * 1e8 / INTER_BW  # 2.5 ms; the send keeps the NIC for 10 ms
    assert alone == pytest.approx(2 * INTER_LAT + transfer, rel=REL)
    assert end == pytest.approx(2 * INTER_LAT + 2 * transfer, rel=REL)  # half the NIC all along


def test_transfers_inside_a_node_do_not_touch_the_nics() -> None:
    end, alone = _dp_under_a_send(devices_per_node=2)
    assert end == pytest.approx(alone, rel=REL)


# ---- compute beside communication kernels ------------------------------------------------
def _compute_beside(op: str, sms: bool = True, **cluster_overrides) -> float:
    """When a 2 ms GEMM ends that starts beside a 10 ms transfer over NVLink: an
    all-reduce of ranks 0 and 1 (one class: its collective is priced when issued; `sms`:
    whether its kernels hold SMs), or a send from rank 0 to rank 1."""
    cluster = make_cluster(nodes=1, devices_per_node=2, **cluster_overrides)
    if op == "collective":
        collective = Collective("all_reduce", "tp", 1e9, "tp", stream="comm", blocking=False, handle="h", sms=sms)
        program = Program(world_size=2, classes=[RankProgram((0, 1), [collective, Compute(F1), Wait("h")], label="both")])
        program.add_group(Group("tp", (0, 1)))
    else:
        program = Program(
            world_size=2,
            classes=[RankProgram((0,), [send("act"), Compute(F1)], label="left"), RankProgram((1,), [recv("act")], label="right")],
        )
        link(program, "act", 0, 1, 1e9, "pp")
    timeline = simulate(program, MODEL, cluster, PRECISION)
    return next(s for s in timeline.ranks[0].spans if s.category == "compute").end


def test_compute_overlapping_a_collective_runs_on_the_sms_it_leaves() -> None:
    assert _compute_beside("collective") == pytest.approx(2 * MS, rel=REL)
    assert _compute_beside("collective", collective_sm_fraction=0.2) == pytest.approx(2 * MS / 0.8, rel=REL)
    assert _compute_beside("collective", p2p_sm_fraction=0.2) == pytest.approx(2 * MS, rel=REL)


def test_compute_beside_a_copy_engine_collective_keeps_every_sm() -> None:
    """StepCCL moves its data with the copy engines (DistTrain §7): no SM is taken."""
    assert _compute_beside("collective", sms=False, collective_sm_fraction=0.2) == pytest.approx(2 * MS, rel=REL)


def test_compute_overlapping_a_send_runs_on_the_sms_it_leaves() -> None:
    assert _compute_beside("send", p2p_sm_fraction=0.1) == pytest.approx(2 * MS / 0.9, rel=REL)
    assert _compute_beside("send", collective_sm_fraction=0.1) == pytest.approx(2 * MS, rel=REL)


def test_intervals_stretch_only_the_overlapping_part() -> None:
    busy = Intervals()
    busy.add(1.0, 2.0)
    busy.add(3.0, 4.0)
    busy.add(1.5, 3.0)  # merges into [1, 4)
    assert (busy.starts, busy.ends) == ([1.0], [4.0])
    assert busy.stretched_end(0.0, 0.5, 0.5) == pytest.approx(0.5)
    assert busy.stretched_end(0.0, 2.0, 0.5) == pytest.approx(3.0)  # 1 s free, then 1 s of work at half rate
    assert busy.stretched_end(2.0, 2.0, 0.5) == pytest.approx(5.0)  # 1 s of work in [2, 4), then 1 s free


# ---- presets -----------------------------------------------------------------------------
def _preset(name: str) -> dict:
    return composed([f"cluster={name}"])["cluster"]


@pytest.mark.parametrize("name", ["a800", "dgx_a100", "frontier", "hopper", "local", "p3_16xlarge", "perlmutter"])
def test_every_preset_states_the_sms_communication_holds(name: str) -> None:
    cluster = cluster_from_config(_preset(name))
    assert 0 <= cluster.collective_sm_fraction < 1 and 0 <= cluster.p2p_sm_fraction < 1


def test_a_preset_without_or_with_an_impossible_sm_fraction_is_refused() -> None:
    cfg = _preset("dgx_a100")
    with pytest.raises(ConfigError, match="collective_sm_fraction"):
        cluster_from_config({k: v for k, v in cfg.items() if k != "collective_sm_fraction"})
    with pytest.raises(ConfigError, match=r"p2p_sm_fraction .* below 1; got 1"):
        cluster_from_config({**cfg, "p2p_sm_fraction": 1.0})


# ---- ZeRO-3 at thousands of GPUs ---------------------------------------------------------
def _zero3(nodes: int, *extra: str):
    overrides = [
        "model=gpt",
        "model.preset=null",
        "model.layers=4",
        "model.hidden=1024",
        "model.heads=16",
        "model.vocab=32000",
        "train.seq_len=512",
        "cluster=perlmutter",
        f"cluster.nodes={nodes}",
        f"train.global_batch={nodes * 4}",
        "strategy=ddp",
        "strategy.zero_stage=3",
        "logger=none",
        *extra,
    ]
    setup = validate(composed(overrides))
    plan = plan_run(setup)
    return plan, setup, simulate(plan.program, setup.model, setup.cluster, setup.train.precision)


def test_zero3_gathers_every_weight_and_reduces_every_layer_latency_bound_at_scale() -> None:
    plan, setup, timeline = _zero3(nodes=1024)  # 4096 GPUs, one sample each
    collectives = [i for i in plan.program.classes[0].instructions if isinstance(i, Collective)]
    llm = setup.model.unit("llm")
    weights = [max(1, sum(k.has_weight for k in layer.kernels)) for layer in llm.layers]
    gathers = [i for i in collectives if i.op == "all_gather"]
    # Forward and backward, one all-gather per weight (DeepSpeed's per-module fetch).
    assert sorted(i.count for i in gathers) == sorted(2 * weights)
    assert sum(i.op == "reduce_scatter" for i in collectives) == sum(
        1 for layer in range(llm.num_layers) if llm.trainable_params(layer, layer + 1)
    )
    comm = CommModel(setup.cluster)
    group = plan.program.groups[collectives[0].group]
    parts = [comm.collective_parts(i.op, group.ranks, i.bytes, group.sharing) for i in collectives]
    latency = sum(i.count * p[0] for i, p in zip(collectives, parts))
    assert latency > sum(i.count * p[1] for i, p in zip(collectives, parts))  # latency bound
    # Every call's ring crosses 1023 node boundaries and steps 3072 times inside nodes,
    # each at least the host's cost of posting a network step.
    ll = setup.cluster.ring_table()["ll"]
    floor = 1023 * ll.inter_step_s + 3072 * max(ll.intra_step_s, ll.net_step_floor_s)
    assert latency >= sum(i.count for i in collectives) * floor
    assert timeline.ranks[0].breakdown["comm_dp"] >= latency  # blocking: all of it exposed


def test_zero3_all_gather_of_a_gpt175b_layer_on_1536_a100s() -> None:
    """One GPT-175B layer (h = 12288: 12h² + 13h parameters, bf16) gathered over 1536
    DGX A100 GPUs (192 nodes) as four all-gathers of its weights, by hand with the
    preset's NCCL figures: LL128 is the fastest protocol (its per-step latency beats
    Simple's, its bandwidth LL's)."""
    cluster = cluster_from_config({**_preset("dgx_a100"), "nodes": 192})
    h = 12288
    call = (12 * h * h + 13 * h) * 2 / 4
    g, n = 1536, 192
    bus = min(300e9 * 0.75, 200e9 * 0.9)  # NVSwitch vs the node's 8 HDR NICs
    simple = 8.4e-6 + (g - n) * 6.0e-6 + (n - 1) * 14.0e-6 + (g - 1) / g * call / bus
    ll128 = 14.0e-6 + (g - n) * 2.0e-6 + (n - 1) * 4.0e-6 + (g - 1) / g * call / (0.92 * bus)
    ll = 6.6e-6 + (g - n) * 2.0e-6 + (n - 1) * 2.7e-6 + (g - 1) / g * call / 19.0e9
    assert ll128 < min(simple, ll)
    seconds = 4 * CommModel(cluster).collective_time("all_gather", tuple(range(g)), call)
    assert seconds == pytest.approx(4 * ll128, rel=1e-9)
    assert seconds == pytest.approx(35.7e-3, rel=2e-3)  # 3.47 ms of latency + 5.47 ms of data per weight


def test_zero3_exposed_gathers_grow_with_the_node_count() -> None:
    small = _zero3(nodes=16)[2].ranks[0].breakdown["comm_dp"]
    large = _zero3(nodes=1024)[2].ranks[0].breakdown["comm_dp"]
    assert large > 5 * small


@pytest.mark.slow
def test_ddp_plan_far_beyond_memory_exits_2_with_one_line(cli, tmp_path: Path) -> None:
    proc = cli(
        "model=gpt",
        "model.preset=gpt_80b",
        "cluster=perlmutter",
        "cluster.nodes=16",
        "strategy=ddp",
        "logger=none",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    # weights 143.0 + bf16 gradients 143.0 (DeepSpeed keeps them 16-bit) + optimizer 857.9 + activations 3.3
    assert "needs 1147.1 GiB" in lines[0] and "38.5 GiB usable" in lines[0]
    assert not (tmp_path / "summary.json").exists()


def test_zero3_overlap_reduces_on_a_stream_beside_the_prefetching_gathers() -> None:
    plan, _, _ = _zero3(4, "strategy.overlap_comm=true")
    asynchronous = [i for i in plan.program.classes[0].instructions if isinstance(i, Collective) and not i.blocking]
    prefetch = {i.stream for i in asynchronous if i.op == "all_gather"}
    reduce = {i.stream for i in asynchronous if i.op == "reduce_scatter"}
    assert len(prefetch) == 1 and len(reduce) == 1 and prefetch != reduce


def test_zero3_full_recompute_gathers_again_what_outlives_the_reuse_distance() -> None:
    """hidden 1024: QKV 3M, projection 1M, MLP 4M + 4M weights. Between a module's
    recomputed forward and its backward come the later modules' forwards and backwards:
    18M after QKV, 16M after the projection, 8M after the first MLP weight, none after
    the second. A reuse distance of 10M gathers QKV and the projection again (4M of 12M)."""
    plan, setup, _ = _zero3(4, "strategy.recompute=full", "strategy.max_reuse_distance=10000000")
    kept, _, _ = _zero3(4, "strategy.recompute=full")  # DeepSpeed's 1e9 keeps every module
    block = next(i for i, layer in enumerate(setup.model.unit("llm").layers) if layer.name == "block")
    weights = sum(setup.model.unit("llm").layers[block].fetched_modules(100_000))  # biases and norms stay whole
    gathers = [i for i in plan.program.classes[0].instructions if isinstance(i, Collective) and i.op == "all_gather"]
    again = [i for i in gathers if i.count == 2]
    blocks = sum(layer.name == "block" for layer in setup.model.unit("llm").layers)
    assert len(again) == blocks  # once per block, in its backward
    assert weights == 12 * 1024**2 and again[0].bytes == pytest.approx(weights * 4 / 12 * 2 / 2)
    assert len(gathers) == len(again) + sum(
        1 for i in kept.program.classes[0].instructions if isinstance(i, Collective) and i.op == "all_gather"
    )
    assert plan.units[0].reuse_distance == 10_000_000


def test_zero3_fetches_each_module_above_the_persistence_threshold_once_per_pass() -> None:
    """hidden 1024: QKV, projection and the MLP's weights hold 1-4M elements each, the layer
    norms 1024 a tensor. DeepSpeed's default threshold (1e5) keeps the norms whole on every
    rank; 0 partitions them too: 6 modules fetched before each block's forward and backward
    instead of 4, each one all-gather and one fetch of the framework's hooks."""
    for threshold, per_block in ((100_000, 4), (0, 6)):
        plan, setup, _ = _zero3(4, f"strategy.param_persistence_threshold={threshold}")
        layers = setup.model.unit("llm").layers
        block = next(i for i, layer in enumerate(layers) if layer.name == "block")
        instructions = plan.program.classes[0].instructions
        computes = [i for i in instructions if isinstance(i, Compute) and i.work.layers == (block, block + 1)]
        assert [c.work.fetches for c in computes] == [per_block, per_block]  # forward, backward
        weights = sum(layers[block].fetched_modules(threshold))
        assert computes[0].work.fetched == pytest.approx(weights)
        gathers = [
            i
            for k, i in enumerate(instructions)
            if isinstance(i, Collective) and i.op == "all_gather" and instructions[k + 1] in computes
        ]
        assert [g.count for g in gathers] == [per_block, per_block]
        assert plan.units[0].persistence_threshold == threshold


@pytest.mark.parametrize("value", ["-1", "1.5", "true"])
def test_a_persistence_threshold_that_is_no_count_of_elements_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^strategy.param_persistence_threshold must be a non-negative integer \(elements\), got "):
        _zero3(4, f"strategy.param_persistence_threshold={value}")


def _after_a_paired_transfer(beside: tuple[Work, ...]) -> tuple[float, float]:
    """Ten 2 ms GEMMs issued after a 1e9 B all-reduce on a copy-engine stream that is
    paired with `beside` (StepCCL's pair): (when they end, the transfer's time)."""
    cluster = make_cluster(nodes=1, devices_per_node=2)
    collective = Collective("all_reduce", "tp", 1e9, "tp", stream="tp", blocking=False, handle="h", sms=False, beside=beside)
    program = Program(world_size=2, classes=[RankProgram((0, 1), [collective, *[Compute(F1)] * 10, Wait("h")], label="both")])
    program.add_group(Group("tp", (0, 1)))
    timeline = simulate(program, MODEL, cluster, PRECISION)
    end = max(s.end for s in timeline.ranks[0].spans if s.category == "compute")
    return end, CommModel(cluster).collective_time("all_reduce", (0, 1), 1e9)


def test_a_paired_transfer_holds_compute_back_by_what_outlasts_its_gemm() -> None:
    """Unpaired, the transfer hides under all ten GEMMs; paired with one 2 ms GEMM chunk it
    hides under that one only, and what is left waits on the compute stream (DistTrain §7:
    "when TP communication is longer than GEMM, ... cannot fully hide"); split over two
    GEMMs, half of it beside each."""
    free, transfer = _after_a_paired_transfer(())
    assert free == pytest.approx(20 * MS, rel=REL) and transfer > 2 * MS
    one, _ = _after_a_paired_transfer((F1,))
    assert one == pytest.approx(20 * MS + transfer - 2 * MS, rel=REL)
    two, _ = _after_a_paired_transfer((F1, F1))
    assert two == pytest.approx(20 * MS + 2 * max(0.0, transfer / 2 - 2 * MS), rel=REL)
