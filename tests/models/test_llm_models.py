"""Any LLM a user brings through model=gpt: Llama 3 presets, style/ffn/kv_heads knobs,
and pricing Llama 3 405B at its paper's scale from the command line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from src.errors import ConfigError
from src.models.registry import build_model
from tests.test_cli import assert_one_line_error


# The released checkpoints' parameter counts (Hugging Face's meta-llama/Llama-3.1-{8B,70B,405B}):
# RMSNorm's scale without a shift, untied output, grouped-query attention.
@pytest.mark.parametrize(
    "preset,public", [("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496), ("llama3_405b", 405_853_388_800)]
)
def test_llama3_presets_have_the_public_parameter_counts(preset: str, public: int) -> None:
    spec = build_model({"name": "gpt", "preset": preset})
    assert spec.params == public
    assert spec.unit("llm").seq_len == 8192


def test_custom_llama_matches_the_preset_and_knobs_change_the_count() -> None:
    custom = build_model(
        {
            "name": "gpt",
            "preset": None,
            "layers": 32,
            "hidden": 4096,
            "heads": 32,
            "vocab": 128256,
            "style": "llama",
            "ffn": 14336,
            "kv_heads": 8,
        }
    )
    assert custom.params == build_model({"name": "gpt", "preset": "llama3_8b"}).params
    # Full multi-head attention instead of 8 KV heads: K and V grow by 2 x 4096 x 3072 per block.
    mha = build_model({"name": "gpt", "preset": "llama3_8b", "kv_heads": 32})
    assert mha.params - custom.params == 32 * 2 * 4096 * (4096 - 1024)
    # The GPT style ties the output layer, adds biases and learned positions.
    gpt = build_model({"name": "gpt", "preset": "llama3_8b", "style": "gpt"})
    assert gpt.params != custom.params


def test_seq_len_overrides_the_preset() -> None:
    assert build_model({"name": "gpt", "preset": "llama3_8b"}, seq_len=2048).unit("llm").seq_len == 2048
    assert build_model({"name": "gpt", "preset": "gpt_5b"}, seq_len=4096).unit("llm").seq_len == 4096


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"heads": 32, "kv_heads": 5}, r"model.heads=32 is not divisible by model.kv_heads=5"),
        ({"ffn": 0}, r"model.ffn=0 must be a positive integer"),
        ({"ffn": -4096}, r"model.ffn=-4096 must be a positive integer"),
        ({"style": "mamba"}, r"model.style='mamba' is not one of: gpt, llama"),
    ],
)
def test_bad_llm_combinations_are_config_errors(overrides: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_model({"name": "gpt", "preset": "llama3_8b", **overrides})


@pytest.mark.slow
def test_bad_kv_heads_on_the_command_line_is_one_line_exit_2(cli, tmp_path: Path) -> None:
    proc = cli("model=gpt", "model.preset=llama3_8b", "model.kv_heads=3", "logger=none", f"hydra.run.dir={tmp_path}")
    assert_one_line_error(proc, tmp_path, r"model\.heads=32", r"model\.kv_heads=3", r"not divisible")


@pytest.mark.slow
def test_llama3_405b_on_16384_h100s_from_the_command_line(cli, tmp_path: Path) -> None:
    """Llama 3 paper, Table 4: 16384 GPUs, TP 8, PP 16, DP 128, sequences of 8192.
    Its 126 blocks do not divide by 16: stages differ by one block."""
    start = time.monotonic()
    proc = cli(
        "model=gpt",
        "model.preset=llama3_405b",
        "cluster=hopper",
        "cluster.nodes=2048",
        "strategy=megatron",
        "strategy.tp=8",
        "strategy.pp=16",
        "strategy.uneven_pp=true",
        "train.seq_len=8192",
        "logger=none",
        f"hydra.run.dir={tmp_path}",
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    plan = summary["plan"]
    assert summary["devices"] == 16384 and (plan["tp"], plan["pp"], plan["dp"]) == (8, 16, 128)
    assert 0 < summary["mfu"] < 1
    assert elapsed < 60, f"pricing took {elapsed:.1f} s"
