"""An MLLM's interleaved sequences on the real backend (src/data/interleaved_mllm.py): the
simulator's image counts and sides (their patches packed), or a shard's; image tokens first,
then text; too many images or images without text named in one line."""

from __future__ import annotations

import pytest
import torch

from src.data.interleaved import sampler
from src.data.interleaved_mllm import _resized, patches_of
from src.data.synthetic_mllm import IGNORE
from src.errors import ConfigError, DataError
from src.models.registry import build_model
from src.runtime.inputs import dataset_for, unit_fields
from src.data.synthetic import collate
from tests.runtime.support import mllm_shard

TINY = {"name": "mllm_9b", "scale": "tiny", "images_per_sequence": 2}
TOKENS = 16  # a tiny MLLM's image: 4x4 patches


def test_synthetic_sequences_hold_the_images_the_simulator_draws():
    model = build_model(TINY | {"image_size_spread": 0})  # every image at the nominal side
    data = dataset_for(model, 3, "synthetic", content="interleaved")
    counts = [data.image_count(i) for i in range(64)]
    assert counts == [sampler(model, 3).layout(i).images for i in range(64)]
    assert len(set(counts)) > 1
    sample = data[counts.index(2)]
    assert sample["image_slots"].tolist() == [True, True, False]
    assert (sample["ids"][: 2 * TOKENS] == 0).all() and (sample["targets"][: 2 * TOKENS - 1] == IGNORE).all()
    assert (sample["targets"][2 * TOKENS - 1 :] != IGNORE).all()


def test_sampled_images_are_at_their_drawn_sides_their_patches_packed_in_order():
    model = build_model(TINY)  # the model's default spread, 0.3
    data = dataset_for(model, 3, "synthetic", content="interleaved")
    layouts = [sampler(model, 3).layout(i) for i in range(8)]
    assert [data.image_sides(i) for i in range(8)] == [layout.image_sides for layout in layouts]
    assert len({side for layout in layouts for side in layout.image_sides}) > 1  # drawn, not all nominal
    assert data.capacity == 63 // (2 * 2)  # images of half the nominal side
    for index, layout in enumerate(layouts):
        sample, tokens = data[index], layout.image_tokens
        sides = sample["image_sides"][sample["image_slots"]]
        assert sides.tolist() == list(layout.image_sides) and not sample["image_sides"][~sample["image_slots"]].any()
        assert (sample["ids"][:tokens] == 0).all() and (sample["targets"][: tokens - 1] == IGNORE).all()
        assert (sample["targets"][tokens - 1 :] != IGNORE).all() and sample["ids"][tokens:].any()
        assert sample["patches"][:tokens].abs().sum(1).gt(0).all() and not sample["patches"][tokens:].any()
        first = layout.image_sides[0]
        drawn = _resized(data.synthetic[index * data.capacity]["images"], first * 8)  # its first image's draw, at its side
        assert torch.equal(sample["patches"][: first * first], patches_of(drawn, 8))
    batch = collate([data[i] for i in range(8)]) | data.step_means(list(range(8)))
    encoder = unit_fields(model, "encoder", batch)
    assert encoder["patch_sides"].tolist() == [side for layout in layouts for side in layout.image_sides]
    assert encoder["patches"].shape == (sum(layout.image_tokens for layout in layouts), 3 * 8 * 8)
    assert unit_fields(model, "llm", batch)["image_tokens"].tolist() == [layout.image_tokens for layout in layouts]


def test_a_shard_sample_holds_none_to_several_images_and_units_take_the_real_ones(tmp_path):
    mllm_shard(tmp_path / "a.tar", [2, 0, 3, 1])
    model = build_model(TINY)
    data = dataset_for(model, 0, f"{tmp_path}/*.tar")
    assert [data.image_count(i) for i in range(4)] == [2, 0, 3, 1]
    batch = collate([data[i] for i in range(4)]) | data.step_means(list(range(4)))
    encoder = unit_fields(model, "encoder", batch)
    assert encoder["patches"].shape == (6 * TOKENS, 3 * 8 * 8) and encoder["patch_sides"].tolist() == [4] * 6
    generator = unit_fields(model, "generator", batch)
    assert generator["noise"].shape[0] == 6 and float(generator["loss_norm"]) == pytest.approx(1.5)
    llm = unit_fields(model, "llm", batch)
    scored = (llm["targets"] != IGNORE).sum(1).float()
    assert scored.mean() == pytest.approx(float(batch["scored_mean"]))
    assert torch.equal(scored, torch.tensor([64.0 - 31, 64, 64 - 47, 64 - 15]))


def test_images_without_text_name_the_shard_and_sample(tmp_path):
    mllm_shard(tmp_path / "a.tar", [1, 2])
    import tarfile

    with tarfile.open(tmp_path / "b.tar", "w") as tar:
        tar.add(tmp_path / "a.tar", arcname="s007.0.png")
    with pytest.raises(DataError, match=rf"^backend.data: shard {tmp_path}/b.tar sample s007: 1 image\(s\) but no text"):
        dataset_for(build_model(TINY), 0, f"{tmp_path}/*.tar")


def test_more_images_than_the_sequence_holds_name_the_sample(tmp_path):
    mllm_shard(tmp_path / "a.tar", [1, 4])
    data = dataset_for(build_model(TINY), 0, f"{tmp_path}/*.tar")
    with pytest.raises(
        DataError,
        match=rf"shard {tmp_path}/a.tar sample s001 holds 4 images of 16 tokens \(64\): the model's 64-token sequence holds at most 3",
    ):
        data.check(range(2))
    with pytest.raises(ConfigError, match=r"^model.images_per_sequence=4: 4 images of 16 tokens \(64\) exceed what the LLM's 64"):
        build_model(TINY | {"images_per_sequence": 4})
