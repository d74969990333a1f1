"""src.calibrate's fits recover known figures, and the `local` preset takes a host
profile's figures only on a host of that CPU model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

import src.cluster_profile as cluster_profile
from src.calibrate import (
    MESSAGE_BYTES,
    ZERO3_WIDTHS,
    after_compute_points,
    fit_gemm_curve,
    fit_p2p,
    fit_ring,
    fit_ring_base,
    handover_seconds,
    link_figures,
    fit_sync_skew,
    zero3_fetch_costs,
)
from src.cluster import cluster_from_config
from src.errors import ConfigError

LOCAL = cluster_profile.preset_file("local") or {}  # as Hydra reads it


def test_gemm_curve_fit_recovers_efficiency_and_half_dimension() -> None:
    peak, efficiency, half = 80e9, 0.9, 32.0
    shapes = [(n, n, n) for n in (32, 64, 128, 512, 2048)] + [(8, 512, 512), (4096, 64, 64)]
    points = [(m, n, k, peak * efficiency * math.prod(d / (d + half) for d in (m, n, k))) for m, n, k in shapes]
    fitted_peak, fitted_eff, fitted_half = fit_gemm_curve(points)
    # The fit's peak is the best measured rate; efficiency is relative to it.
    best = max(rate for *_, rate in points)
    assert fitted_peak == best
    assert fitted_half == pytest.approx(half, rel=0.05)
    assert fitted_peak * fitted_eff == pytest.approx(peak * efficiency, rel=0.05)


def test_link_fits_recover_latency_and_bandwidth() -> None:
    latency, bandwidth = 2e-4, 1.5e9
    ring = [(g, n, 2 * (g - 1) * latency + 2 * (g - 1) / g * n / bandwidth) for g in (2, 4) for n in (1e3, 1e5, 1e7)]
    assert fit_ring(ring) == pytest.approx((latency, bandwidth), rel=1e-6)
    p2p = [(n, 1e-3 + n / 3e9) for n in (1e3, 1e6, 1e7)]
    assert fit_p2p(p2p) == pytest.approx((1e-3, 3e9), rel=1e-6)


def test_a_latency_per_collective_is_fitted_where_two_group_sizes_tell_it_from_the_steps() -> None:
    """On 4 workers sharing 2 cores a pair's all-reduce (2 ring steps) costs about what the
    group's (6) does: 1.5 ms per collective beyond 0.7 ms per step. The after-compute
    rounds over the whole group then fit the steps less that base."""
    base, step, bandwidth = 1.5e-3, 0.7e-3, 1.3e9
    barrier = [(g, n, base + 2 * (g - 1) * step + 2 * (g - 1) / g * n / bandwidth) for g in (2, 4) for n in MESSAGE_BYTES]
    assert fit_ring_base(barrier) == pytest.approx(base, rel=1e-6)
    assert fit_ring_base([p for p in barrier if p[0] == 4]) == 0.0  # one group size: no telling base from steps
    one_pass = [(4, n, base + 3 * step + 0.75 * n / bandwidth) for n in MESSAGE_BYTES]
    links = {
        r: {
            "all_reduce": barrier,
            "p2p": [(n, 1e-4 + n / 3e9) for n in MESSAGE_BYTES],
            **{op: one_pass for op in ("all_gather", "reduce_scatter", "all_to_all")},
        }
        for r in range(4)
    }
    after = [(4, n, base + 6 * step + 1.5 * n / bandwidth) for n in MESSAGE_BYTES]
    figures, measured = link_figures(links, after)
    ring = figures["collectives"]["ring"]["gloo"]
    assert (ring["base_s"], ring["intra_step_s"]) == (pytest.approx(base, rel=1e-3), pytest.approx(step, rel=1e-3))
    assert figures["intra_bandwidth"] == pytest.approx(bandwidth, rel=1e-3)
    assert measured["barrier_ring_fit"]["base_s"] == pytest.approx(base, rel=1e-3)


def test_zero3_fit_recovers_the_host_cost_per_fetch_and_per_byte_beyond_the_plain_step_and_collectives() -> None:
    per_fetch, per_byte = 2e-4, 5e-10
    measured = {}
    for hidden, nbytes in zip(ZERO3_WIDTHS, (1e5, 2.5e7)):
        plain, collectives = 1e-3 * hidden, 2e-4 * hidden
        extra = 48 * per_fetch + nbytes * per_byte
        measured[hidden] = {
            "plain_s": plain,
            "zero3_s": plain + collectives + extra,
            "collectives_s": collectives,
            "fetches": 48.0,
            "fetched_bytes": nbytes,
        }
    assert zero3_fetch_costs(measured) == pytest.approx((per_fetch, per_byte), rel=1e-6)


def test_noise_without_a_bandwidth_term_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no bandwidth term"):
        fit_p2p([(1e3, 2e-3), (1e6, 1e-3), (1e7, 5e-4)])


def test_local_takes_the_profile_of_this_cpu_model_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cluster_profile, "PROFILE_DIR", tmp_path)
    fallback = cluster_from_config(LOCAL)
    assert "no profile for this host's CPU" in fallback.sources["profile"]
    measured = {
        "peak_flops": {"fp32": 90e9, "bf16": 200e9},
        "oversubscription": {1: 1.0, 2: 0.95, 4: 0.5},
        "gemm_max_efficiency": 0.8,
        "gemm_half_dim": 8.0,
        "intra_latency": 3e-4,
        "intra_bandwidth": 2e9,
    }
    cluster_profile.profile_path("local").write_text(yaml.safe_dump({"preset": measured}))
    cluster = cluster_from_config(LOCAL)  # 4 workers per node
    assert cluster.sources["profile"].startswith("measured on this CPU model")
    assert cluster.peak("fp32") == pytest.approx(0.5 * 90e9)  # four workers share the cores
    assert cluster.intra_bandwidth == 2e9 and cluster.gemm_half_dim == 8.0
    two = cluster_from_config({**LOCAL, "devices_per_node": 2})
    assert two.peak("fp32") == pytest.approx(0.95 * 90e9)
    eight = cluster_from_config({**LOCAL, "devices_per_node": 8})
    assert eight.peak("fp32") == pytest.approx(0.5 * 4 / 8 * 90e9)  # past the measured counts, in proportion
    assert cluster_from_config({**LOCAL, "profile": None}).peak("fp32") == fallback.peak("fp32")


def test_local_takes_another_cpu_models_profile_where_profile_cpu_names_it(tmp_path: Path, monkeypatch) -> None:
    # Pricing what another host measured: its CPU model's profile, whatever this host is.
    monkeypatch.setattr(cluster_profile, "PROFILE_DIR", tmp_path)
    other = "Other(R) CPU 9000"
    profile = {"host": {"cpu_model": other}, "preset": {"peak_flops": {"fp32": 70e9, "bf16": 10e9}}}
    cluster_profile.profile_path("local", other).write_text(yaml.safe_dump(profile))
    assert "no profile for this host's CPU" in cluster_from_config(LOCAL).sources["profile"]
    cluster = cluster_from_config({**LOCAL, "profile_cpu": other})
    assert cluster.peak_flops == {"fp32": 70e9, "bf16": 10e9}
    assert cluster.sources["profile"].startswith(f"measured on {other} (cluster.profile_cpu; this host: ")
    measured_on = r"local's profiles were measured on \['Other\(R\) CPU 9000'\]"
    with pytest.raises(ConfigError, match=r"profile_cpu='Nine': no profile .*local-nine\.yaml; " + measured_on):
        cluster_from_config({**LOCAL, "profile_cpu": "Nine"})
    with pytest.raises(ConfigError, match="takes none"):
        cluster_from_config({**LOCAL, "profile": None, "profile_cpu": other})
    with pytest.raises(ConfigError, match="profile_cpu must be a CPU model"):
        cluster_from_config({**LOCAL, "profile_cpu": 3})


def test_a_profiled_steps_gemms_and_bandwidth_bound_kinds() -> None:
    from src.calibrate import gemm_shape, memory_figures, step_kernel_bytes

    # addmm(bias, a, b) and mm(a, b): (m, n, k); a batched or another op is none.
    assert gemm_shape("aten::addmm", [[384], [512, 128], [128, 384]]) == (512, 384, 128)
    assert gemm_shape("aten::mm", [[128, 512], [512, 384]]) == (128, 384, 512)
    assert gemm_shape("aten::bmm", [[2, 3, 4], [2, 4, 5]]) is None
    assert gemm_shape("aten::mm", [[2, 3, 4], [2, 4, 5]]) is None
    # 512 tokens of width 128 in fp32: GELU over the MLP's 4h reads and writes 2 x 1 MiB.
    assert step_kernel_bytes("aten::gelu", 512, 128, 0) == ("gelu", 2.0 * 512 * 512 * 4)
    assert step_kernel_bytes("aten::native_layer_norm_backward", 512, 128, 0) == ("layer_norm_backward", 5.0 * 512 * 128 * 4)
    assert step_kernel_bytes("aten::_fused_adamw_", 512, 128, 1000) == ("adamw", 28000.0)
    assert step_kernel_bytes("aten::add", 512, 128, 0) is None
    measured = {
        "copies": [{"bytes_per_s": r} for r in (60e9, 80e9, 100e9)],
        "kernels": [
            {"kind": "gelu", "bytes": 8e6, "seconds": 1e-3},  # 8 GB/s
            {"kind": "gelu", "bytes": 12e6, "seconds": 1e-3},  # 12: the kind's median 10
            {"kind": "layer_norm", "bytes": 16e6, "seconds": 1e-3},
            {"kind": "adamw", "bytes": 40e6, "seconds": 1e-3},
        ],
    }
    assert memory_figures(measured) == {"memory_bandwidth": 80e9, "copy_efficiency": 1.0, "memory_efficiency": 0.2}


def test_bad_oversubscription_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"cluster.oversubscription.4=1.5"):
        cluster_from_config({**LOCAL, "profile": None, "oversubscription": {4: 1.5}})


def test_one_pass_collective_efficiency_is_its_share_of_the_ring_rate() -> None:
    from src.calibrate import fit_efficiency

    latency, bandwidth, g = 1e-3, 1e9, 4
    points = [(g, n, (g - 1) * latency + (g - 1) / g * n / (bandwidth * 0.125)) for n in (1e4, 1e6, 1e7, 1e8)]
    assert fit_efficiency(points, latency, bandwidth) == pytest.approx(0.125)


def test_collective_efficiency_slows_that_op_only() -> None:
    from src.costmodel.comm import CommModel

    base = cluster_from_config({**LOCAL, "profile": None})
    slow = cluster_from_config({**LOCAL, "profile": None, "collective_efficiency": {"reduce_scatter": 0.25}})
    ranks = (0, 1, 2, 3)
    for op, factor in (("reduce_scatter", 4.0), ("all_gather", 1.0), ("all_reduce", 1.0)):
        assert CommModel(slow).collective_parts(op, ranks, 1e8)[1] == pytest.approx(
            factor * CommModel(base).collective_parts(op, ranks, 1e8)[1]
        )
    with pytest.raises(ConfigError, match="collective_efficiency"):
        cluster_from_config({**LOCAL, "profile": None, "collective_efficiency": {"reduce": 0.5}})


def test_a_profile_gives_each_worker_count_the_links_measured_with_that_many_running(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cluster_profile, "PROFILE_DIR", tmp_path)
    ring = {"gloo": {"base_s": 0.0, "intra_step_s": 1e-4, "inter_step_s": 1e-4, "share": 1.0}}
    by_workers = {
        2: {"intra_bandwidth": 3e9, "collectives": {"ring": ring, "tree": {}}},
        4: {"intra_bandwidth": 1e9, "collectives": {"ring": {"gloo": {**ring["gloo"], "intra_step_s": 8e-4}}, "tree": {}}},
    }
    cluster_profile.profile_path("local").write_text(yaml.safe_dump({"preset": {"by_workers": by_workers}}))
    two, three, four = (cluster_from_config({**LOCAL, "devices_per_node": k}) for k in (2, 3, 4))
    assert (two.intra_bandwidth, three.intra_bandwidth, four.intra_bandwidth) == (3e9, 3e9, 1e9)
    assert four.ring_table()["gloo"].intra_step_s == 8e-4
    assert "links measured with 2 workers running" in three.sources["profile"]


def test_a_figure_the_run_sets_itself_stays_the_runs_over_the_profile(tmp_path: Path, monkeypatch) -> None:
    # The profile measured peaks and a hand-over; the command line sets the fp32 peak and the
    # hand-over itself: those stay, the profile's other figures apply, and the sources say so.
    monkeypatch.setattr(cluster_profile, "PROFILE_DIR", tmp_path)
    measured = {"peak_flops": {"fp32": 90e9, "bf16": 20e9}, "by_workers": {4: {"core_handover_s": 1e-3}}}
    cluster_profile.profile_path("local").write_text(yaml.safe_dump({"preset": measured}))
    assert cluster_from_config(LOCAL).peak_flops == {"fp32": 90e9, "bf16": 20e9}
    overridden = cluster_from_config({**LOCAL, "peak_flops": {**LOCAL["peak_flops"], "fp32": 50e9}, "core_handover_s": 5e-3})
    assert overridden.peak_flops == {"fp32": 50e9, "bf16": 20e9}
    assert overridden.core_handover_s == 5e-3
    assert overridden.sources["profile"].endswith("the run's own core_handover_s, peak_flops")


def test_collectives_after_compute_set_the_ring_and_keep_the_others_relative_to_the_barrier_fit() -> None:
    # Rounds of (a block of GEMMs, an all-reduce) on 4 workers: the block takes 20 ms on
    # the slowest rank with every worker computing; what is left of the slowest rank's
    # round is the all-reduce, here a ring of 3 ms per step and 0.5 GB/s.
    sizes = (2**16, 2**20, 2**22)
    ring = {n: 6 * 3e-3 + 1.5 * n / 0.5e9 for n in sizes}
    sync = {
        0: {"rounds": [(n, 20e-3, 20e-3 + ring[n]) for n in sizes]},
        1: {"rounds": [(n, 19e-3, 20e-3 + ring[n] - 1e-3) for n in sizes]},
    }
    points = after_compute_points(sync, 4)
    assert points == [(4, n, pytest.approx(ring[n])) for n in sizes]

    def links(step: float, bandwidth: float) -> dict:
        all_reduce = [(4, n, 6 * step + 1.5 * n / bandwidth) for n in MESSAGE_BYTES]
        one_pass = [(4, n, 3 * step + 0.75 * n / bandwidth) for n in MESSAGE_BYTES]  # the ring's rate
        p2p = [(n, 1e-4 + n / 3e9) for n in MESSAGE_BYTES]
        return {"all_reduce": all_reduce, "p2p": p2p, "all_gather": one_pass, "reduce_scatter": one_pass, "all_to_all": one_pass}

    quiet = {r: links(1e-3, 1.5e9) for r in range(4)}
    figures, measured = link_figures(quiet, points)
    assert figures["intra_bandwidth"] == pytest.approx(0.5e9, rel=1e-3)
    assert figures["collectives"]["ring"]["gloo"]["intra_step_s"] == pytest.approx(3e-3, rel=1e-3)
    assert figures["collective_efficiency"]["all_gather"] == pytest.approx(1.0)
    assert measured["barrier_ring_fit"] == {
        "step_s": pytest.approx(1e-3, rel=1e-3),
        "bandwidth": pytest.approx(1.5e9, rel=1e-3),
        "base_s": 0.0,  # one group size
    }
    assert link_figures(quiet)[0]["intra_bandwidth"] == pytest.approx(1.5e9, rel=1e-3)  # no rounds measured: the barrier's
    # A round shorter than its block (noise) counts as the barrier-started all-reduce, not as free.
    noisy = [(4, n, 0.0 if n == sizes[0] else t) for _, n, t in points]
    kept = link_figures(quiet, noisy)[1]["all_reduce_after_compute"][0]
    assert kept["seconds"] == pytest.approx(6 * 1e-3 + 1.5 * sizes[0] / 1.5e9)
    # With the slowest worker 4 ms late once built up over 10 ms of compute, its wait after
    # the 20 ms block is the simulator's to add: the points are the collective's own.
    late = 4e-3 * (1 - math.exp(-2.0))
    sync[0]["rounds"] = [(n, 20e-3, 20e-3 + ring[n] + late) for n in sizes]
    assert after_compute_points(sync, 4, (4e-3, 10e-3)) == [(4, n, pytest.approx(ring[n])) for n in sizes]


def test_the_lag_is_fitted_as_a_wait_that_builds_up_with_the_block() -> None:
    # The slowest round beyond its block: a 5 ms all-reduce plus a lag of up to 4 ms, built
    # up over 8 ms of compute (blocks of 0 to 100 ms); a faster rank does not set it.
    blocks = (0.0, 1.5e-3, 6e-3, 25e-3, 100e-3)
    gemms = (0, 2, 8, 32, 128)
    build = 2.5e-4 * 2.0 ** (30 / 6)  # 8 ms: a point of the fit's grid
    slowest = [(g, b, b + 5e-3 + 4e-3 * (1 - math.exp(-b / build))) for g, b in zip(gemms, blocks)]
    faster = [(g, 0.9 * b, 0.9 * b + 5e-3) for g, b in zip(gemms, blocks)]
    wait, built = fit_sync_skew({0: {"skew": slowest}, 1: {"skew": faster}})
    assert (wait, built) == (pytest.approx(4e-3), pytest.approx(build))
    steady = [(g, b, b + 5e-3) for g, b in zip(gemms, blocks)]
    assert fit_sync_skew({0: {"skew": steady}})[0] == pytest.approx(0.0, abs=1e-12)  # no lag: nothing to add
    shrinking = [(g, b, b + 5e-3 - 1e-3 * (1 - math.exp(-b / build))) for g, b in zip(gemms, blocks)]
    assert fit_sync_skew({0: {"skew": shrinking}}) == (0.0, 0.0)  # noise below a constant: no negative lag


def _handover(gained: dict[int, float]) -> dict[int, dict]:
    """Rank 0 computing (a block of n GEMMs alone: n ms), rank 1 waiting: beside the waiter
    the block runs at 0.5 + 0.5 x gained of one alone (half the cores, up to all of them)."""
    alone = {n: n * 1e-3 for n in gained}
    beside = {n: alone[n] / (0.5 + 0.5 * g) for n, g in gained.items()}
    return {0: {"computing": True, "alone": alone, "beside": beside}, 1: {"computing": False, "alone": {}, "beside": {}}}


def test_the_handover_is_the_wait_at_which_half_the_cores_gain_is_had() -> None:
    # Gains 0, 0.25, 0.75, 1 at waits 2, 6.4, 18.3, 64 ms: half between 6.4 and 18.3 ms, in log.
    handover = _handover({1: 0.0, 4: 0.25, 16: 0.75, 64: 1.0})
    assert handover_seconds(handover, 0.5, 1.0) == pytest.approx((4e-3 / 0.625 * 16e-3 / 0.875) ** 0.5)
    assert handover_seconds(_handover({1: 0.6, 4: 1.0}), 0.5, 1.0) == 0.0  # the shortest wait frees the core
    assert handover_seconds(_handover({1: 0.0, 4: 0.2}), 0.5, 1.0) == pytest.approx(4e-3 / 0.6)  # none does: the longest
    assert handover_seconds(handover, 0.98, 1.0) == 0.0  # cores not oversubscribed: nothing to hand over


def test_the_handover_and_the_drift_are_preset_figures_of_their_own() -> None:
    assert cluster_from_config({**LOCAL, "profile": None}).core_handover_s == 0.0
    assert cluster_from_config({**LOCAL, "profile": None, "core_handover_s": 2e-3}).core_handover_s == 2e-3
    with pytest.raises(ConfigError, match="cluster.core_handover_s is a wait in seconds, at least 0, got -1"):
        cluster_from_config({**LOCAL, "profile": None, "core_handover_s": -1})
    assert cluster_from_config({**LOCAL, "profile": None}).sync_skew_s == 0.0
    assert cluster_from_config({**LOCAL, "profile": None, "sync_skew_build_s": 0.02}).sync_skew_build_s == 0.02
    with pytest.raises(ConfigError, match="cluster.sync_skew_s is a wait in seconds, at least 0, got -0.1"):
        cluster_from_config({**LOCAL, "profile": None, "sync_skew_s": -0.1})
