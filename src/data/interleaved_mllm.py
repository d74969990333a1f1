"""DistTrain's interleaved data on the real backend: each sequence holds its sample's images.

Sample `index` holds n images, 0 to `capacity`: as many as the simulator's sampler draws
for it (src/data/interleaved.py's layout of the same seed and index, mean
model.images_per_sequence), or as its tar shard holds (src/data/shards.py, images="several").
Every image is run at the encoder's nominal side, so an image costs the encoder and the LLM
its `image_tokens`: what the plan prices for a shard's images and for the sampler's at
model.image_size_spread=0; a spread > 0 draws sides the plan prices and this data would not
run, which runtime.checks refuses.

A sequence holds its images' tokens first (`image_tokens` each), then text: the class's
token progression (SyntheticMLLM's), or the caption's byte tokens, cut to the sequence.
Positions whose next token is an image token predict nothing. Per image, its picture
(the encoder's input, the generator's target) and SD's diffusion draws are SyntheticMLLM's
sample index * capacity + k (a shard's image replaces the picture).

A sample carries `capacity` image slots, the first n of them real (`image_slots`): the
encoder and the generator run on the real ones only (runtime.inputs.unit_fields).
Sequences score different numbers of tokens and generate different numbers of images, so
the losses are sums over the micro-batch divided by the step's mean per sequence
(`step_means`) times its rows: a micro-batch's loss is its share of the step's, whatever
its size, its images or the batch's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from src.data.interleaved import InterleavedData
from src.data.shards import TarShards, pixels, tokenize
from src.data.synthetic_mllm import IGNORE, SyntheticMLLM
from src.errors import DataError

PER_IMAGE = ("images", "target", "latent", "noise", "timestep", "alpha")


@dataclass(frozen=True)
class InterleavedMLLM:
    synthetic: SyntheticMLLM  # its image_tokens: one image's LLM tokens
    layouts: InterleavedData | None = None  # the simulator's sampler; None: the shards' images
    shards: TarShards | None = None

    def __post_init__(self) -> None:
        assert (self.layouts is None) != (self.shards is None), "images come from the sampler or from shards"

    @property
    def capacity(self) -> int:
        """The most images a sequence holds with one text token after them."""
        return (self.synthetic.seq_len - 1) // self.synthetic.image_tokens

    def image_count(self, index: int) -> int:
        if self.shards is not None:
            return self.shards.image_count(index)
        assert self.layouts is not None
        return self.layouts.layout(index).images

    def check(self, indices: Iterable[int]) -> None:
        """Every sample a run reads fits the model's sequence (a DataError names the first
        that does not; the model refuses a mean the sampler draws around that does not)."""
        s = self.synthetic
        for index in indices:
            n = self.image_count(index)
            if n > self.capacity:
                where = self.shards.where(index) if self.shards is not None else f"synthetic sample {index}"
                raise DataError(
                    f"backend.data: {where} holds {n} images of {s.image_tokens} tokens ({n * s.image_tokens}): the model's "
                    f"{s.seq_len}-token sequence holds at most {self.capacity} with its text after them"
                )

    def scored(self, images: int) -> int:
        return self.synthetic.seq_len - max(0, images * self.synthetic.image_tokens - 1)

    def images_mean(self, indices: list[int]) -> float:
        """Images per sequence over the samples `indices`."""
        return sum(self.image_count(i) for i in indices) / len(indices)

    def step_means(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Per sequence, over the step's samples: tokens scored and images generated."""
        scored = [self.scored(self.image_count(i)) for i in indices]
        return {"scored_mean": torch.tensor(sum(scored) / len(scored)), "images_mean": torch.tensor(self.images_mean(indices))}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s, capacity = self.synthetic, self.capacity
        drawn = s[index]
        if self.shards is not None:
            pictures, caption = self.shards.read(index)
            n = len(pictures)
            text = tokenize(caption, s.seq_len + 1 - n * s.image_tokens, s.vocab)
            tokens = torch.cat([torch.zeros(n * s.image_tokens, dtype=torch.long), text])
        else:
            pictures, n = [], self.image_count(index)
            # The sample's whole progression: its ids and the last target (never an image's).
            tokens = torch.cat([drawn["ids"], drawn["targets"][-1:]])
            tokens[: n * s.image_tokens] = 0
        if n > capacity:
            self.check([index])
        targets = tokens[1:].clone()
        targets[: max(0, n * s.image_tokens - 1)] = IGNORE
        draws = [s[index * capacity + k] for k in range(capacity)]
        per_image = {key: torch.stack([d[key] for d in draws]) for key in PER_IMAGE if key in drawn}
        for k, picture in enumerate(pictures):
            per_image["images"][k] = pixels(picture, s.image_size)
            if "target" in per_image:
                per_image["target"][k] = pixels(picture, s.target_size)
        return {**per_image, "image_slots": torch.arange(capacity) < n, "ids": tokens[:-1], "targets": targets}
