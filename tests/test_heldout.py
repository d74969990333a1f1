"""src.heldout: the published runs' data file and the way each run is priced (no process
starts; one small run is simulated)."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from src import heldout
from src.setup import preset_cluster
from src.errors import ConfigError

DATA, RUNS = heldout.load(heldout.RUNS)
BY_ID = {r.id: r for r in RUNS}
FITTED = heldout.REPO / "conf" / "cluster" / "measured" / "gemm_fixed" / "hopper_xla_batched.yaml"


def test_every_run_cites_a_source_and_a_published_number() -> None:
    assert len(RUNS) == len(BY_ID) >= 26
    for run in RUNS:
        assert run.source in DATA["sources"] and run.where
        assert set(run.published) & {"iteration_s", "tflops_per_gpu", "tokens_per_s", "tokens_per_gpu_s"}


def test_a_rate_per_gpu_becomes_seconds_by_narayanans_flop_count() -> None:
    # Table 1's 1.7B row: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs at 137 TFLOP/s on each of 32 GPUs.
    b, s, l, h, v = 512, 2048, 24, 2304, 51200
    flops = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert heldout.published_seconds(BY_ID["t1-1.7b"], s, v) == pytest.approx(flops / (137e12 * 32))
    assert heldout.published_seconds(BY_ID["k22-175b-full"], s, v) == 18.13  # stated as seconds


def test_megatron_lm_s_own_flop_count_counts_no_recomputation() -> None:
    # The Megatron-Core table's 1.7B row: 72 B s l h^2 (1 + s/6h + V/12lh) FLOPs at 408.8 TFLOP/s on each of 48 GPUs.
    b, s, l, h, v = 192, 4096, 24, 2048, 131072
    flops = 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    assert heldout.published_seconds(BY_ID["mc24-1.7b"], s, v, "megatron_core") == pytest.approx(flops / (408.8e12 * 48))
    with pytest.raises(ConfigError, match="counts FLOPs as 'palm'"):
        heldout.published_seconds(BY_ID["mc24-1.7b"], s, v, "palm")


def test_a_source_states_its_megatron_lm_settings_and_the_search_fills_the_rest() -> None:
    run = BY_ID["mc24-70b"]
    stated = heldout.overrides(run, heldout.settings(run, DATA))
    settings = {"strategy.sequence_parallel=true", "strategy.zero_stage=1", "strategy.overlap_grad_reduce=true"}
    assert settings | {"strategy.overlap_param_gather=true"} <= set(stated)
    assert {"cluster=hopper", "cluster.nodes=96", "model.vocab=131072", "train.seq_len=4096"} <= set(stated)
    assert not any(o.startswith(("strategy.schedule", "strategy.vpp", "strategy.recompute")) for o in stated)


def test_overrides_state_the_runs_configuration() -> None:
    interleaved = heldout.overrides(BY_ID["t1-145.6b"], DATA["common"])
    assert {"cluster.nodes=192", "strategy.vpp=2", "strategy.schedule=interleaved", "model.attention=eager"} <= set(interleaved)
    assert {"strategy.sequence_parallel=false", "strategy.zero_stage=0", "train.precision=fp16"} <= set(interleaved)
    assert "strategy.schedule=1f1b" in heldout.overrides(BY_ID["t1-1008b"], DATA["common"])
    assert "strategy.sequence_parallel=true" in heldout.overrides(BY_ID["k22-22b-sel-sp"], DATA["common"])
    zero3 = heldout.overrides(BY_ID["t2-zero3-175b-384"], DATA["common"])
    assert {"strategy=ddp", "strategy.zero_stage=3"} <= set(zero3) and not any("schedule" in o for o in zero3)
    with pytest.raises(ConfigError, match="12 GPUs is neither whole 8-GPU dgx_a100 nodes nor a part of one"):
        heldout.overrides(replace(BY_ID["t1-1.7b"], gpus=12), DATA["common"])
    with pytest.raises(ConfigError, match="3 GPUs is neither whole 8-GPU dgx_a100 nodes nor a part of one"):
        heldout.overrides(replace(BY_ID["t1-1.7b"], gpus=3), DATA["common"])
    # Part of a node: that many of its devices (a single GPU, a model-parallel group).
    part = heldout.overrides(replace(BY_ID["t1-1.7b"], gpus=4), DATA["common"])
    assert {"cluster.nodes=1", "cluster.devices_per_node=4"} <= set(part)


def test_a_run_whose_gpus_its_preset_cannot_hold_is_refused_when_the_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "runs.yaml"
    one_gpu = "layers: 40, hidden: 1536, heads: 16, gpus: 1,"
    path.write_text(heldout.RUNS.read_text().replace(one_gpu, one_gpu.replace("gpus: 1", "gpus: 3")))
    with pytest.raises(ConfigError, match="run adlr-v1-1.2b: 3 GPUs is neither whole 8-GPU p3_16xlarge nodes nor a part of one"):
        heldout.load(path)


def test_a_run_citing_no_listed_source_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.yaml"
    path.write_text(heldout.RUNS.read_text().replace("source: korthikanti2022", "source: nobody2020", 1))
    with pytest.raises(ConfigError, match=r"sources \['nobody2020'\]"):
        heldout.load(path)


def test_a_source_s_model_settings_are_refused_incomplete_or_misspelt(tmp_path: Path) -> None:
    path = tmp_path / "runs.yaml"
    h800 = "vocab: 32000, seq_len: 4096, style: llama, ffn: 28672, kv_heads: 8"  # the H800 source's alone
    path.write_text(heldout.RUNS.read_text().replace(h800, h800.replace("kv_heads", "kv_head")))
    with pytest.raises(ConfigError, match=r"flagperf_h800_flagscale's model settings \['kv_head'\] are not ones a run reads"):
        heldout.load(path)
    path.write_text(heldout.RUNS.read_text().replace("seq_len: 4096, style: llama, ffn: 28672", "style: llama, ffn: 28672", 1))
    with pytest.raises(ConfigError, match=r"flagperf_h800_flagscale's model settings lack \['seq_len'\]"):
        heldout.load(path)
    # A Llama's software says which of its blocks' operations it runs unfused; a GPT's need not.
    path.write_text(heldout.RUNS.read_text().replace("dropout: false, unfused: [rope, swiglu],", "dropout: false,"))
    with pytest.raises(ConfigError, match=r"flagperf_a800_flagscale's model settings lack \['unfused'\]"):
        heldout.load(path)


def test_the_smallest_run_is_simulated_and_summed_up_by_source() -> None:
    rows = heldout.check([BY_ID["k22-22b-full"]], DATA)
    assert rows[0]["simulated_s"] > 0 and rows[0]["published_s"] == 1.42
    # Where the simulated seconds go (they add up), and the front door's command that prices the run.
    assert sum(rows[0]["breakdown_s"].values()) == pytest.approx(rows[0]["simulated_s"])
    assert rows[0]["breakdown_s"]["compute"] > 0 and all(s > 0 for s in rows[0]["breakdown_s"].values())
    run = BY_ID["k22-22b-full"]
    assert shlex.split(rows[0]["command"])[:3] == ["python", "-m", "src.run"]
    assert shlex.split(rows[0]["command"])[3:] == heldout.overrides(run, heldout.settings(run, DATA))
    summary = heldout.summarize(rows, "source")["korthikanti2022"]
    assert summary["runs"] == 1 and summary["mape_pct"] == pytest.approx(abs(rows[0]["error_pct"]))
    assert summary["simulated_faster"] + summary["simulated_slower"] == 1


def test_a_source_runs_on_its_own_preset_and_settings() -> None:
    small = BY_ID["fa-gpt3-355m"]
    common = heldout.settings(small, DATA)
    assert common["cluster"] == "dgx_a100" and common["model"]["attention"] == "flash1" and common["precision"] == "bf16"
    assert {"model.vocab=50264", "model.attention=flash1", "train.precision=bf16", "cluster.nodes=1"} <= set(
        heldout.overrides(small, common)
    )
    assert heldout.settings(BY_ID["t1-1.7b"], DATA)["model"]["attention"] == "eager"  # the file's common settings
    # Transformers' Llama runs its blocks' elementwise operations unfused, FlagScale's legacy model two of them.
    assert "model.unfused=[rmsnorm,rope,swiglu]" in heldout.overrides(*_with_settings("flagperf-a800-llama2-7b-zero3"))
    assert "model.unfused=[rope,swiglu]" in heldout.overrides(*_with_settings("flagperf-h800-llama2-70b-tp8pp4"))
    # The copies its legacy attention makes, stated where its source was read for them, passed on; none elsewhere.
    h800 = heldout.overrides(*_with_settings("flagperf-h800-llama2-70b-tp8pp4"))
    assert "model.attention_copies=[bshd,kv_repeat,rope_concat]" in h800
    assert not any("attention_copies" in o for o in heldout.overrides(*_with_settings("flagperf-a800-llama2-7b-zero3")))


def _with_settings(run_id: str) -> tuple[heldout.Run, dict]:
    return BY_ID[run_id], heldout.settings(BY_ID[run_id], DATA)


def test_a_run_of_its_own_sequence_on_a_machine_its_preset_is_not_quite() -> None:
    # MPT's A100 40GB table: 1B at 8192 tokens a sequence, 128 sequences at 107,799 tokens/s.
    run = BY_ID["mpt-a100-40-1b-s8192-g8"]
    common = heldout.settings(run, DATA)
    assert run.seq(common) == 8192 and heldout.published_seconds(run, run.seq(common), 50368) == pytest.approx(128 * 8192 / 107799)
    stated = set(heldout.overrides(run, common))
    assert {"train.seq_len=8192", "cluster.memory_gib=40", "model.attention=flash1"} <= stated
    assert "cluster.memory_bandwidth=1555000000000.0" in stated
    assert heldout.settings(BY_ID["mpt-a100-80-1b-s8192-g8"], DATA).get("cluster_settings") is None  # the preset's own A100


# MPT rows and the parameter count llm-foundry's README gives them (its NumParams column): the
# layers and widths taken from the MPT yamls, the vocabulary, the biases and the learned
# positions (which grow with the sequence) give back every one. The head counts, on which no
# parameter depends, are the yamls' alone.
MPT_PARAMS = {
    "mpt-a100-80-1b-s2048-g8": 1_315_950_592,
    "mpt-a100-80-1b-s1024-g8": 1_313_853_440,
    "mpt-a100-80-7b-s2048-g8": 6_658_859_008,
    "mpt-a100-80-30b-s2048-g8": 29_975_214_080,
    "mpt-h100-70b-s2048-g64": 64_862_437_376,
}


@pytest.mark.parametrize("run_id, params", MPT_PARAMS.items())
def test_an_mpt_row_is_the_model_its_table_counts(run_id: str, params: int) -> None:
    from src.setup import validate
    from tests.composing import composed

    run = BY_ID[run_id]
    model = validate(composed(heldout.overrides(run, heldout.settings(run, DATA)))).model
    assert sum(unit.params for unit in model.units) == params


def test_a_llama_row_is_the_model_its_source_trains() -> None:
    # FlagPerf's Llama-2-7B (Transformers' LlamaForCausalLM of its config.json): 6,738,415,616
    # parameters, the released checkpoint's count.
    from src.setup import validate
    from tests.composing import composed

    run = BY_ID["flagperf-a800-llama2-7b-zero3"]
    stated = heldout.overrides(run, heldout.settings(run, DATA))
    assert {"model.style=llama", "model.ffn=11008", "cluster=a800", "cluster.intra_bandwidth=200000000000.0"} <= set(stated)
    assert sum(unit.params for unit in validate(composed(stated)).model.units) == 6_738_415_616


def test_the_layout_flagperf_ran_out_of_memory_in_is_refused_for_memory() -> None:
    # FlagPerf's Llama-3-8B ablation on one DGX A800: PP1DP8TP1 "OOM" beside the layouts it timed.
    import dataclasses

    from src.errors import ConfigError
    from src.setup import plan_run, validate
    from tests.composing import composed

    timed = BY_ID["flagperf-a800-llama3-8b-pp2dp4tp1"]
    out_of_memory = dataclasses.replace(timed, strategy={"name": "megatron", "tp": 1, "pp": 1})
    with pytest.raises(ConfigError, match=r"needs .* GiB .* short by"):
        plan_run(validate(composed(heldout.overrides(out_of_memory, heldout.settings(timed, DATA)))))
    assert plan_run(validate(composed(heldout.overrides(timed, heldout.settings(timed, DATA))))).program


def test_tokens_per_gpu_and_second_become_the_batch_s_tokens_over_every_gpu_s_rate() -> None:
    run = BY_ID["flagperf-a800-aquila2-7b-dp8"]  # 72 sequences of 2048 tokens at 3936.8 tokens/s on each of 8 GPUs
    assert heldout.published_seconds(run, 2048, 100008) == pytest.approx(72 * 2048 / (3936.8 * 8))


def test_tokens_per_second_become_the_batch_s_tokens_over_that_rate() -> None:
    run = BY_ID["fa-gpt3-2.7b"]  # 512 sequences of 2048 tokens at 85k tokens/s
    assert heldout.published_seconds(run, 2048, 50264) == pytest.approx(512 * 2048 / 85000)


def test_a_held_out_collective_is_priced_by_its_preset_over_consecutive_ranks() -> None:
    from src.cluster import MIB, measured_collectives
    from src.costmodel.measured import table_seconds

    runs = {c.id: c for c in heldout.collective_runs(DATA)}
    assert runs and {c.source for c in runs.values()} <= set(DATA["sources"])
    run = runs["pm-ag2-64-64mib"]  # Perlmutter's second campaign; the table took the first
    table = measured_collectives("perlmutter_nccl").collectives["all_gather"]
    assert heldout.collective_seconds(run) == pytest.approx(table_seconds(table, 64, 64 * MIB))
    row = heldout.check_collectives([run])[0]
    assert row["preset"] == "perlmutter" and row["published_s"] == pytest.approx(run.published_ms / 1e3)


def test_a_held_out_gemm_is_priced_by_its_preset_s_compute_model_on_one_device() -> None:
    from src.costmodel.compute import ComputeModel

    runs = {g.id: g for g in heldout.gemm_runs(DATA)}
    assert runs and {g.source for g in runs.values()} <= set(DATA["sources"])
    run = runs["mamf-mi250x-v1"]
    row = heldout.check_gemms([run])[0]
    # 2mnk at 147.0 TFLOP/s: 3.917 ms published; the frontier preset's measured table prices it.
    assert row["published_s"] == pytest.approx(2 * 1024 * 19968 * 14080 / 147.0e12)
    model = ComputeModel(preset_cluster("frontier"), "bf16")
    assert row["simulated_s"] == model.gemm_time(1024, 19968, 14080)
    assert row["series"] == "stas00_mamf, frontier GEMM" and row["gpus"] == 1 and row["gemm"]


def test_a_gemm_timed_as_a_kernel_s_duration_is_compared_without_the_gap_between_kernels() -> None:
    kernel_timed = frozenset(n for n, s in DATA["sources"].items() if s.get("gemm_timing") == "kernel")
    assert kernel_timed == {"xla_matmul_table"}
    run = next(g for g in heldout.gemm_runs(DATA) if g.source == "xla_matmul_table")
    (stream,) = heldout.check_gemms([run])
    (kernel,) = heldout.check_gemms([run], kernel_timed)
    assert stream["simulated_s"] - kernel["simulated_s"] == pytest.approx(preset_cluster("hopper").kernel_overhead_s, rel=1e-9)


def test_a_batched_gemm_is_priced_as_its_gemms_in_one_kernel_and_summed_apart() -> None:
    from src.costmodel.compute import ComputeModel

    run = next(g for g in heldout.gemm_runs(DATA) if g.id == "xla-sm90-b4-512x256x2048")
    assert run.b == 4
    (row,) = heldout.check_gemms([run])
    # Four 512 x 256 x 2048 GEMMs at 210.37 TFLOP/s together: 10.21 us, not a quarter of it.
    assert row["published_s"] == pytest.approx(4 * 2 * 512 * 256 * 2048 / 210.37261442e12)
    model = ComputeModel(preset_cluster("hopper"), "bf16")
    assert row["simulated_s"] == model.gemm_time(512, 256, 2048, 4) != model.gemm_time(512, 256, 2048)
    assert row["series"] == "xla_matmul_table, hopper batched GEMMs"


def test_the_xla_table_is_held_out_whole_but_the_cubes_the_fixed_time_was_fitted_to() -> None:
    table = {(g.b, g.m, g.n, g.k) for g in heldout.gemm_runs(DATA) if g.source == "xla_matmul_table"}
    fitted = {tuple(entry[:4]) for entry in yaml.safe_load(FITTED.read_text())["gemms"]}
    sides = (256, 512, 1024, 2048, 4096)
    every = {(b, m, n, k) for b in (1, 2, 4) for m in sides for n in sides for k in sides}
    assert fitted < every and table == every - fitted and len(table) == 365


def test_a_held_out_normalisation_is_priced_as_the_model_s_own_kernel_on_its_device() -> None:
    layernorm = next(k for k in heldout.kernel_runs(DATA) if k.id == "liger-h100nvl-layernorm-fwd-8192")
    (row,) = heldout.check_kernels([layernorm], DATA)
    # PyTorch's LayerNorm forward over 4096 x 8192 fp32 values reads and writes each once: 268 MB
    # at the H100 NVL's 3.9 TB/s times the preset's memory efficiency, and one kernel's gap.
    hopper = preset_cluster("hopper")
    moved = 4096 * 8192 * 4 * 2
    assert row["simulated_s"] == pytest.approx(moved / (3.9e12 * hopper.memory_efficiency) + hopper.kernel_overhead_s)
    assert row["published_s"] == pytest.approx(0.140896e-3) and row["kernel"] and row["gpus"] == 1
    # Transformers' RMSNorm, step by step, moves 36 bytes a 16-bit value forward in 8 kernels.
    rmsnorm = next(k for k in heldout.kernel_runs(DATA) if k.id == "liger-h100nvl-rmsnorm-fwd-8192")
    assert heldout.kernel_seconds(rmsnorm, {"memory_bandwidth": 3.9e12}) == pytest.approx(
        2048 * 8192 * 36 / (3.9e12 * hopper.memory_efficiency) + 8 * hopper.kernel_overhead_s
    )
    backward = replace(rmsnorm, phase="bwd")
    nvl = heldout.kernel_seconds(rmsnorm, {"memory_bandwidth": 3.9e12})
    assert heldout.kernel_seconds(backward, {}) > heldout.kernel_seconds(rmsnorm, {}) > nvl
    full = heldout.kernel_seconds(replace(rmsnorm, phase="full"), {})
    assert full == pytest.approx(heldout.kernel_seconds(backward, {}) + heldout.kernel_seconds(rmsnorm, {}))


def test_a_held_out_loss_is_priced_as_pytorch_s_cross_entropy_over_its_logits() -> None:
    loss = next(k for k in heldout.kernel_runs(DATA) if k.id == "liger-h100nvl-cross_entropy-full-131072")
    (row,) = heldout.check_kernels([loss], DATA)
    # 16384 rows of 131,072 fp32 logits (512 KiB, off chip): log_softmax's three reads and a
    # write forward; nll_loss's dense gradient, log_softmax's backward's two reads of it, one of
    # its output and its write: 4 + 5 passes of 4 bytes.
    hopper = preset_cluster("hopper")
    moved = 16384 * 131072 * 4 * (4 + 5)
    assert row["simulated_s"] == pytest.approx(moved / (3.9e12 * hopper.memory_efficiency) + 2 * hopper.kernel_overhead_s)
    assert row["series"] == "liger_h100_nvl, hopper cross_entropy full"


def test_a_held_out_kernel_names_an_operation_the_model_prices(tmp_path) -> None:
    data = yaml.safe_load(heldout.RUNS.read_text())
    data["kernels"][0]["op"] = "softmax"
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(data))
    ops = "ops are \\['layernorm', 'rmsnorm', 'cross_entropy'\\], phases \\['fwd', 'bwd', 'full'\\]"
    with pytest.raises(ConfigError, match=f"op 'softmax'.*{ops}"):
        heldout.load(path)


@pytest.mark.parametrize("kind", ["runs", "collectives", "gemms", "kernels"])
def test_a_row_with_a_key_its_kind_lacks_is_refused_in_one_line(tmp_path, kind: str) -> None:
    data = yaml.safe_load(heldout.RUNS.read_text())
    row = data[kind][0]
    row["pubished"] = row.pop("id")
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"'\?': unknown keys \['pubished'\], missing keys \['id'\]") as err:
        heldout.load(path)
    assert "\n" not in str(err.value)


def test_a_preset_s_summary_counts_whole_systems_not_its_gemms() -> None:
    gemm = heldout.check_gemms([g for g in heldout.gemm_runs(DATA) if g.id == "mamf-h100-v1"])
    kernel = heldout.check_kernels([k for k in heldout.kernel_runs(DATA) if k.id == "liger-h100nvl-layernorm-fwd-1024"], DATA)
    collective = heldout.check_collectives([c for c in heldout.collective_runs(DATA) if c.id == "pm-ag2-64-64mib"])
    summaries = heldout.summaries_of(gemm + kernel + collective)
    assert set(summaries["preset"]) == {"perlmutter"}
    series = {"stas00_mamf, hopper GEMM", "liger_h100_nvl, hopper layernorm fwd", "pccl2025, perlmutter all_gather"}
    assert set(summaries["series"]) == series
    assert set(summaries["source"]) == {"stas00_mamf", "liger_h100_nvl", "pccl2025"}


def test_a_subset_is_printed_and_never_replaces_the_full_results(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(heldout, "OUT", tmp_path / "default")
    monkeypatch.setattr("sys.argv", ["heldout", "--only", "pm-ag2-64-64mib"])
    heldout.main()
    assert "pm-ag2-64-64mib" in capsys.readouterr().out and not (tmp_path / "default").exists()
    monkeypatch.setattr("sys.argv", ["heldout", "--only", "pm-ag2-64-64mib", "--out", str(tmp_path / "chosen")])
    heldout.main()
    assert (tmp_path / "chosen" / "heldout.json").exists()


def test_a_chosen_training_run_is_printed_with_the_command_that_prices_it(capsys) -> None:
    data, runs = heldout.load(heldout.RUNS)
    (run,) = [r for r in runs if r.id == "k22-22b-sel-sp"]
    heldout.check([run], data, commands=True)
    line, command = capsys.readouterr().err.splitlines()
    assert line.startswith("k22-22b-sel-sp: published 1.100 s") and command == "  " + heldout.command(run, heldout.settings(run, data))
    assert command.strip().startswith("python -m src.run model=gpt ")


def test_a_collective_the_preset_measured_too_is_compared_campaign_to_campaign() -> None:
    from dataclasses import replace

    runs = {c.id: c for c in heldout.collective_runs(DATA)}
    on_grid = runs["fr-ag1-16-4mib"]  # the first campaign; the table took the second's 6.494 ms
    off_grid = replace(on_grid, id="between", mib=3)
    rows = heldout.check_collectives([on_grid, off_grid])
    assert rows[0]["preset_measured_s"] == pytest.approx(6.494e-3) and "preset_measured_s" not in rows[1]
    summary = heldout.campaigns(rows)[rows[0]["series"]]
    assert (summary["points"], summary["of"]) == (1, 2)
    # Where the table measured the point the simulator returns it: the errors are the campaigns' difference.
    assert summary["mape_pct"] == pytest.approx(summary["measurement_mape_pct"]) == pytest.approx(100 * (35.791 - 6.494) / 35.791)


def test_the_readme_s_standing_is_the_results_file_s() -> None:
    """The README's opening figures per preset (runs, MAPE) are heldout.json's: a re-run that
    moves them and leaves the prose behind fails here."""
    import json
    import re

    readme = (heldout.RUNS.parent / "README.md").read_text()
    standing = readme[readme.index("## Where it stands") : readme.index("## The log")]
    stated = {name: (int(runs), float(mape)) for name, runs, mape in re.findall(r"`(\w+)` (\d+)[^,]*, ([\d.]+) %", standing)}
    by_preset = json.loads((heldout.RUNS.parent.parent / "results" / "heldout.json").read_text())["by"]["preset"]
    assert set(stated) == set(by_preset)
    for name, (runs, mape) in stated.items():
        assert (runs, mape) == (by_preset[name]["runs"], round(by_preset[name]["mape_pct"], 1)), name
