"""Tools refuse what they cannot do in one line: a GPU benchmark on a machine without one; the GPU
calibration still refits a stored run there."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, cli_env


@pytest.mark.slow  # a subprocess that imports torch
def test_the_gpu_benchmark_refuses_a_machine_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_runtime_gpu.py"], cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: benchmarks/bench_runtime_gpu.py needs a CUDA GPU, and torch sees none on this machine"


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=180)


def _benchmark(name: str, monkeypatch):
    """A benchmark script loaded as a module, its sibling scripts importable."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))  # the benchmarks import their siblings
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # a dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # subprocesses that import torch
def test_the_small_gpt_benchmark_refuses_without_a_gpu_and_prices_without_one():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    refused = _script("benchmarks/small_gpt_gpu.py", "--only", "h256")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == "error: benchmarks/small_gpt_gpu.py needs a CUDA GPU (or --sim-only), and torch sees none here"
    unknown = _script("benchmarks/small_gpt_gpu.py", "--sim-only", "--only", "h3")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert unknown.stderr.startswith("error: --only h3 names none of: h256-L4-mb4, ")
    priced = _script("benchmarks/small_gpt_gpu.py", "--sim-only", "--only", "h256")
    assert priced.returncode == 0, priced.stderr
    (line,) = priced.stdout.strip().splitlines()
    assert line.startswith("h256-L4-mb4") and '"sim_hopper_s": ' in line and '"sim_h200_s": ' in line
    # Without its memory-bound time the same step prices less; a key no config has, one line.
    (bare,) = (
        _script("benchmarks/small_gpt_gpu.py", "--sim-only", "--only", "h256", "--sim-override", "cluster.memory_bandwidth=1e14")
        .stdout.strip()
        .splitlines()
    )
    assert json.loads(bare.split(maxsplit=1)[1])["sim_h200_s"] < json.loads(line.split(maxsplit=1)[1])["sim_h200_s"]
    misspelt = _script("benchmarks/small_gpt_gpu.py", "--sim-only", "--only", "h256", "--sim-override", "cluster.memory_bandwith=1e14")
    assert misspelt.returncode == 2 and misspelt.stderr.startswith("error: h256-L4-mb4: Could not override 'cluster.memory_bandwith'")
    assert len(misspelt.stderr.strip().splitlines()) == 1
    listed = _script("benchmarks/measure_list_collective_host.py", "--cuda")
    assert listed.returncode == 2
    assert listed.stderr.strip() == "error: --cuda needs a CUDA GPU, and torch sees none on this machine"
    amp_host = _script("benchmarks/measure_amp_host.py")
    assert amp_host.returncode == 2 and amp_host.stdout == ""
    assert amp_host.stderr.strip() == "error: measure_amp_host needs a CUDA device, and none is visible"
    kernels = _script("benchmarks/measure_memory_kernels.py")
    assert kernels.returncode == 2 and kernels.stdout == ""
    assert kernels.stderr.strip() == "error: measure_memory_kernels needs a CUDA device, and none is visible"
    sustained = _script("benchmarks/sustained_load.py")
    assert sustained.returncode == 2 and sustained.stdout == ""
    assert sustained.stderr.strip() == "error: benchmarks/sustained_load.py needs a CUDA GPU (or --sim-only), and torch sees none here"
    prices = json.loads(_script("benchmarks/sustained_load.py", "--sim-only").stdout)
    assert set(prices["gemms"]) == {"llama70b-tp8-s8192", "gpt177b-tp8-s4096"}
    assert all(row["sim_s"] > 0 for rows in prices["gemms"].values() for row in rows)
    # Fewer heads leave FlashAttention 2's grid fewer blocks for the SMs: the rate a head falls.
    per_head = [row["sim_fwd_s"] / row["heads"] for row in prices["attention"]]
    assert [row["heads"] for row in prices["attention"]] == [2, 4, 8, 16, 32] and per_head == sorted(per_head, reverse=True)
    layer = _script("benchmarks/sustained_layer.py")
    assert layer.returncode == 2 and layer.stdout == ""
    assert layer.stderr.strip() == "error: benchmarks/sustained_layer.py needs a CUDA GPU (or --sim-only), and torch sees none here"
    blocks = json.loads(_script("benchmarks/sustained_layer.py", "--sim-only").stdout)
    assert set(blocks) == {"llama70b-tp8-s8192", "gpt177b-tp8-s4096", "llama7b-s4096"}
    for priced in blocks.values():  # the H200's faster HBM shortens the memory-bound kernels alone
        assert priced["h200"]["memory"] < priced["hopper"]["memory"] and priced["h200"]["attention"] == priced["hopper"]["attention"]
        assert all(seconds > 0 for seconds in priced["hopper"].values())
    # cuDNN's core priced as the preset prices Transformer Engine's (its GEMMs on the curve), which
    # takes less than FlashAttention 2's measured rates give.
    cudnn = json.loads(_script("benchmarks/sustained_layer.py", "--sim-only", "--attention", "cudnn").stdout)
    assert all(cudnn[name]["hopper"]["attention"] < blocks[name]["hopper"]["attention"] for name in blocks)
    assert all(cudnn[name]["hopper"]["gemm"] == blocks[name]["hopper"]["gemm"] for name in blocks)
    # Transformers' step-by-step operations move more bytes than the fused kernels; a GPT block has none.
    llamas = ("--only", "llama7b-s4096", "--only", "llama70b-tp8-s8192")
    unfused = json.loads(_script("benchmarks/sustained_layer.py", "--sim-only", "--unfused", *llamas).stdout)
    assert all(unfused[name]["hopper"]["memory"] > blocks[name]["hopper"]["memory"] for name in unfused)
    gpt = _script("benchmarks/sustained_layer.py", "--sim-only", "--unfused")
    assert gpt.returncode == 2 and gpt.stdout == "" and len(gpt.stderr.strip().splitlines()) == 1
    assert gpt.stderr.startswith("error: --unfused runs Transformers' Llama block, and gpt177b-tp8-s4096 is not one")


def test_the_gpu_calibration_refits_a_stored_run_without_a_gpu(tmp_path, monkeypatch, capsys):
    calibrate = _benchmark("calibrate_gpu", monkeypatch)
    stored = REPO_ROOT / "benchmarks" / "results" / "hopper_h100_calibration.json"
    monkeypatch.setattr(sys, "argv", ["calibrate_gpu.py", "--refit", str(stored)])
    with pytest.raises(SystemExit) as exit_:
        calibrate.main()
    assert exit_.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    out = tmp_path / "refit.json"
    monkeypatch.setattr(sys, "argv", ["calibrate_gpu.py", "--refit", str(stored), "--gemm-overhead-s", "0", "--out", str(out)])
    calibrate.main()
    refit, before = json.loads(out.read_text()), json.loads(stored.read_text())
    assert refit["gemms"] == before["gemms"] and refit["fit"]["gemm_overhead_s"] == 0.0
    assert refit["fit"]["gemm_half_dim"] != before["fit"]["gemm_half_dim"]  # what a GEMM costs beyond its arithmetic moves the fit


def test_the_sustained_load_check_takes_its_rates_over_the_first_and_the_last_seconds(monkeypatch):
    module = _benchmark("sustained_load", monkeypatch)
    # One FLOP a cycle: 0.1 s cycles for the first second, then the clocks fall to 0.125 s ones.
    cycles = [0.1] * 10 + [0.125] * 40
    early, late = module.rates_over(cycles, 1.0)
    assert early == pytest.approx(10.0) and late == pytest.approx(8.0)


def test_the_sustained_layer_runs_the_gemms_the_sustained_load_check_cycles(monkeypatch):
    layer, load = _benchmark("sustained_layer", monkeypatch), _benchmark("sustained_load", monkeypatch)
    for block in layer.LAYERS:
        if block.name in load.LAYERS:  # one TP rank's share: the same four GEMMs
            assert [tuple(g) for g in layer.gemm_shapes(block)] == [tuple(g) for g in load.LAYERS[block.name]]
    assert {block.name for block in layer.LAYERS} >= set(load.LAYERS)


def test_the_clock_sampler_summarises_the_samples_inside_a_window(monkeypatch):
    layer = _benchmark("sustained_layer", monkeypatch)
    sampler = layer.Sampler.__new__(layer.Sampler)  # without NVML: the samples set by hand
    # (time, SM MHz, board W, clock-limit reasons): idle at boost, then capped by power (0x4).
    sampler.samples = [(0.0, 1980, 120.0, 0), (1.0, 1980, 300.0, 0), (2.0, 1620, 690.0, 4), (3.0, 1590, 694.0, 4)]
    late = sampler.between(1.5, 3.0)
    assert late["samples"] == 2 and late["sm_mhz_median"] == 1605 and late["sm_mhz_min"] == 1590
    assert late["power_w_max"] == 694.0 and late["limit_reasons"] == {"0x4": 2}
    assert sampler.between(0.0, 3.0)["limit_reasons"] == {"0x0": 2, "0x4": 2}
    assert sampler.between(5.0, 6.0) == {}


def test_the_sustained_layer_reports_a_stored_run_by_kind(monkeypatch, capsys):
    layer = _benchmark("sustained_layer", monkeypatch)
    stored = json.loads((REPO_ROOT / "benchmarks" / "results" / "sustained_layer_weights_h200.json").read_text())
    row = stored["layers"][0]
    layer.report(row["name"], row)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"llama70b-tp8-s8192 x4: step fresh {row['fresh_step_s'] * 1e3:.2f} ms")
    assert [line.split(":")[0] for line in lines[1:4]] == ["  gemm", "  attention", "  memory-bound"]
    assert f"simulator {row['sim_h200_s']['gemm'] * 1e3:.2f}" in lines[1] and "with the step's weights 1.029" in lines[1]
    assert lines[4].startswith("  SM clock fresh")


def test_a_flashattention_kernel_is_attention_though_its_name_holds_a_gemm_library(monkeypatch):
    kinds = _benchmark("small_gpt_gpu", monkeypatch)
    # As a profile of torch 2.11's SDPA on an H200 names them (benchmarks/results/sustained_layer_h200.json).
    flash = "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, "
    flash += "false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t>>"
    assert kinds.kernel_kind(flash) == "attention"
    assert kinds.kernel_kind("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "gemm"
    assert kinds.kernel_kind("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>") == "norm"


def test_memory_kernel_rates_divide_a_kernels_bytes_by_its_profiled_time(tmp_path, monkeypatch, capsys):
    rates = _benchmark("memory_kernel_rates", monkeypatch)
    # 2 layers of hidden 64, 2 micro-batches of 128 tokens: a GELU moves 4 bytes over 128 x 256
    # values, a LayerNorm's input gradient 12 (fp32 under autocast) over 128 x 64.
    gelu, norm = 4 * 128 * 256, 12 * 128 * 64
    kernels = [
        {"name": "void at::native::GeluCUDAKernelImpl<bf16>", "count": 4, "total_s": 4 * gelu / 1e12},
        {"name": "void at::native::layer_norm_grad_input_kernel_vectorized<", "count": 10, "total_s": 10 * norm / 2e12},
        # launched a number of times the shape does not give: another kernel shares its name
        {"name": "void at::native::GammaBetaBackwardCUDAKernelTemplate<float>", "count": 7, "total_s": 1.0},
    ]
    case = {"hidden": 64, "layers": 2, "seq": 128, "micro_batch": 1, "micro_batches": 2, "vocab": 256, "heads": 1}
    profile = {"device": "GPU", "cases": {"tiny": {"case": case, "plain": {"profile": {"top_kernels": kernels}}}}}
    rows = rates.kernel_rates(profile, 4e12)
    assert [(r["kernel"], round(r["share"], 12)) for r in rows] == [("gelu forward", 0.25), ("layernorm input gradient", 0.5)]
    path, out = tmp_path / "profile.json", tmp_path / "rates.json"
    path.write_text(json.dumps(profile))
    monkeypatch.setattr(sys, "argv", ["memory_kernel_rates.py", str(path), "--hbm", "4e12", "--out", str(out)])
    rates.main()
    assert json.loads(out.read_text())["median_share"] == pytest.approx(0.375)
    # Kernels timed alone (measure_memory_kernels.py): the copy is not one of the kinds.
    alone = {
        "device": "GPU",
        "kernels": [
            {"kind": k, "tokens": 8, "width": 8, "seconds": 1.0, "bytes": b, "bandwidth": b}
            for k, b in (("copy", 3.6e12), ("gelu", 2e12), ("add", 2.8e12))
        ],
    }
    assert [r["kernel"] for r in rates.rates_of(alone, 4e12)] == ["gelu", "add"]
    assert statistics.median(r["share"] for r in rates.rates_of(alone, 4e12)) == pytest.approx(0.6)
    assert rates.rates_of({"device": "GPU", "rows": []}, 4e12) == []
    monkeypatch.setattr(sys, "argv", ["memory_kernel_rates.py", str(path), "--hbm", "0"])
    with pytest.raises(SystemExit) as exit_:
        rates.main()
    assert exit_.value.code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow  # a shell that imports torch
def test_the_device_session_refuses_a_machine_without_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = subprocess.run(
        ["bash", "benchmarks/device_session.sh", str(tmp_path / "out")],
        cwd=REPO_ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip() == "error: benchmarks/device_session.sh needs a CUDA GPU, and torch sees none here"
    usage = subprocess.run(["bash", "benchmarks/device_session.sh"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and usage.stderr.strip().startswith("usage: bash benchmarks/device_session.sh OUT_DIR")


def test_stepccl_pairing_exposes_what_a_transfer_longer_than_its_gemm_leaves(monkeypatch):
    from src.config import composed
    from src.costmodel.comm import CommModel
    from src.costmodel.compute import ComputeModel
    from src.setup import validate

    pairing = _benchmark("stepccl_pairing", monkeypatch)
    setup = validate(composed(pairing.CASE))
    found = pairing.pairs(setup.model, 8, 4, ComputeModel(setup.cluster, "bf16"), CommModel(setup.cluster))
    # Under sequence parallelism each all-reduce's volume is a reduce-scatter after a
    # row-parallel product and an all-gather before the next column-parallel one.
    assert [(p.collective, p.gemm) for p in found] == [(0, "attn_proj"), (0, "fc1"), (1, "fc2"), (1, "attn_qkv")]
    for p in found:
        assert p.exposed(4, paired=False) == p.transfer_s
        assert p.exposed(4, paired=True) == pytest.approx(p.transfer_s + 3 * max(0.0, p.transfer_s - p.gemm_s))
    proj, fc1 = found[0], found[1]
    assert proj.transfer_s > proj.gemm_s and proj.exposed(4, paired=True) > proj.exposed(4, paired=False)
    assert fc1.gemm_s > fc1.transfer_s and fc1.exposed(4, paired=True) == fc1.exposed(4, paired=False)


def test_the_order_bound_benchmark_prints_the_placement_floor(monkeypatch, capsys):
    """benchmarks/balance_order_bound.py on a small MLLM-9B plan: each policy, the search past
    cost's order, and the floor no placement goes below, which the recovered shares sit under;
    with extra warm-up forwards it says why there is none."""
    bound = _benchmark("balance_order_bound", monkeypatch)
    small = ["--batches=1", "--swaps=20", "model=mllm_9b", "cluster.nodes=6", "train.global_batch=48"]
    assert bound.main(small) == 0
    out = capsys.readouterr().out
    recovered = re.search(r"recovered: reorder (-?\d+)%, cost (-?\d+)%", out)
    most = re.search(r"no placement goes below [\d.]+ s: at most (\d+)% of skew's cost is recoverable", out)
    assert recovered and most, out
    assert max(int(recovered[1]), int(recovered[2])) <= int(most[1])
    assert bound.main([*small, "strategy.extra_warmup=1"]) == 0
    assert "no placement floor: 1 warm-up forwards beyond 1F1B's" in capsys.readouterr().out
