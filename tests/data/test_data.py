"""Training data: synthetic samples are a function of (seed, index); tar shards read back
what was written."""

from __future__ import annotations

import io
import tarfile

import pytest
import torch

from src.data.shards import TarShards, tokenize
from src.data.synthetic import SyntheticImageText, SyntheticTokens
from src.errors import ConfigError


def test_synthetic_samples_depend_only_on_seed_and_index():
    data = SyntheticImageText(seed=3, image_size=16, text_len=8, vocab=64)
    again = SyntheticImageText(seed=3, image_size=16, text_len=8, vocab=64)
    assert torch.equal(data[5]["images"], again[5]["images"]) and torch.equal(data[5]["ids"], again[5]["ids"])
    assert not torch.equal(data[5]["images"], data[6]["images"])
    assert not torch.equal(data[5]["images"], SyntheticImageText(4, 16, 8, 64)[5]["images"])
    assert data[5]["images"].shape == (3, 16, 16) and int(data[5]["ids"].max()) < 64


def test_synthetic_tokens_are_next_token_pairs():
    sample = SyntheticTokens(seed=0, seq_len=10, vocab=32)[2]
    assert torch.equal(sample["ids"][1:], sample["targets"][:-1])


def _write_shard(path, captions: list[str]) -> None:
    from PIL import Image

    with tarfile.open(path, "w") as tar:
        for i, caption in enumerate(captions):
            buffer = io.BytesIO()
            Image.new("RGB", (20, 10), (10 * i, 200, 0)).save(buffer, format="PNG")
            for name, data in ((f"s{i:03d}.png", buffer.getvalue()), (f"s{i:03d}.txt", caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_tar_shards_are_read_in_order_and_resized(tmp_path):
    _write_shard(tmp_path / "a-0.tar", ["red", "green"])
    _write_shard(tmp_path / "a-1.tar", ["blue"])
    shards = TarShards(str(tmp_path / "a-*.tar"), image_size=8, text_len=6, vocab=100)
    assert len(shards) == 3
    sample = shards[2]
    assert sample["images"].shape == (3, 8, 8)
    assert torch.equal(sample["ids"], tokenize("blue", 6, 100))
    assert torch.equal(shards[3]["ids"], shards[0]["ids"])  # a second epoch wraps around


def test_a_pattern_matching_no_shards_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="matches no tar shards"):
        TarShards(str(tmp_path / "none-*.tar"), 8, 6, 100)
