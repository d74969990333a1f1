"""DistTrain's interleaved data on the real backend: each sequence holds its sample's images.

Sample `index` holds n images, 0 to `capacity`: as many as the simulator's sampler draws
for it, each at the side the sampler draws (src/data/interleaved.py's layout of the same
seed and index: mean model.images_per_sequence, sides spread by model.image_size_spread
around the encoder's nominal side), or as many as its tar shard holds
(src/data/shards.py, images="several"), each at the nominal side. An image of side s
patches is s^2 patch tokens: what the plan prices it at (the encoder runs each image's
tokens with its own CLS and attention over them alone, the LLM takes its s^2 tokens).

A sequence holds its images' tokens first (s^2 each, in order), then text: the class's
token progression (SyntheticMLLM's), or the caption's byte tokens, cut to the sequence.
Positions whose next token is an image token predict nothing. Per image, its picture
(SyntheticMLLM's draw of sample index * capacity + k, resized to s patches a side; a
shard's image at the nominal side) travels as its patches, packed: the sample's
`patches` row holds every image's s^2 patches in order, then zeros to the sequence's
length; the generator's target and SD's diffusion draws are that draw's too.

A sample carries `capacity` image slots, the first n of them real (`image_slots`, their
sides `image_sides`, 0 for an empty slot, whose draws are zero): the encoder and the
generator run on the real ones only (runtime.inputs.unit_fields). Sequences score different numbers of tokens and
generate different numbers of images, so the losses are sums over the micro-batch divided
by the step's mean per sequence (`step_means`) times its rows: a micro-batch's loss is its
share of the step's, whatever its size, its images or the batch's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F

from src.data.balance import dealt_images
from src.data.interleaved import InterleavedData
from src.data.shards import TarShards, pixels, tokenize
from src.data.synthetic_mllm import IGNORE, SyntheticMLLM
from src.errors import DataError

PER_IMAGE = ("target", "latent", "noise", "timestep", "alpha")


def patches_of(image: torch.Tensor, patch: int) -> torch.Tensor:
    """An image (3, s·patch, s·patch) as its s^2 patches, row by row: (s^2, 3·patch^2)."""
    c, height, width = image.shape
    grid = image.unfold(1, patch, patch).unfold(2, patch, patch)  # (c, s, s, patch, patch)
    return grid.permute(1, 2, 0, 3, 4).reshape(height // patch * (width // patch), c * patch * patch)


@dataclass(frozen=True)
class InterleavedMLLM:
    synthetic: SyntheticMLLM  # its image_tokens: one nominal image's LLM tokens
    patch: int  # the encoder's patch side, pixels
    layouts: InterleavedData | None = None  # the simulator's sampler; None: the shards' images
    shards: TarShards | None = None

    def __post_init__(self) -> None:
        assert (self.layouts is None) != (self.shards is None), "images come from the sampler or from shards"

    @property
    def base_side(self) -> int:
        """The encoder's nominal image side, in patches."""
        return self.synthetic.image_size // self.patch

    @property
    def capacity(self) -> int:
        """The most images a sequence holds with one text token after them: at the least
        side the sampler draws (half the nominal), or at the nominal side (a shard's)."""
        least = max(1, self.base_side // 2) if self.layouts is not None and self.layouts.side_spread > 0 else self.base_side
        return (self.synthetic.seq_len - 1) // (least * least)

    def image_sides(self, index: int) -> tuple[int, ...]:
        """The sides (in patches) of sample `index`'s images, in order."""
        if self.shards is not None:
            return (self.base_side,) * self.shards.image_count(index)
        assert self.layouts is not None
        return self.layouts.layout(index).image_sides

    def image_count(self, index: int) -> int:
        return len(self.image_sides(index))

    def image_tokens(self, index: int) -> int:
        """The tokens sample `index`'s images take in its sequence."""
        return sum(side * side for side in self.image_sides(index))

    def check(self, indices: Iterable[int]) -> None:
        """Every sample a run reads fits the model's sequence (a DataError names the first
        that does not; the sampler's sequences always do)."""
        s = self.synthetic
        for index in indices:
            n, tokens = self.image_count(index), self.image_tokens(index)
            if n > self.capacity or tokens >= s.seq_len:
                where = self.shards.where(index) if self.shards is not None else f"synthetic sample {index}"
                raise DataError(
                    f"backend.data: {where} holds {n} images of {s.image_tokens} tokens ({tokens}): the model's "
                    f"{s.seq_len}-token sequence holds at most {self.capacity} with its text after them"
                )

    def scored(self, index: int) -> int:
        """Tokens sample `index` scores: all but those whose next token is an image's."""
        return self.synthetic.seq_len - max(0, self.image_tokens(index) - 1)

    def images_mean(self, indices: list[int]) -> float:
        """Images per sequence over the samples `indices`."""
        return sum(self.image_count(i) for i in indices) / len(indices)

    def step_means(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Per sequence, over the step's samples: tokens scored and images generated."""
        scored = [self.scored(i) for i in indices]
        return {"scored_mean": torch.tensor(sum(scored) / len(scored)), "images_mean": torch.tensor(self.images_mean(indices))}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s, capacity = self.synthetic, self.capacity
        drawn = s[index]
        sides = self.image_sides(index)
        if len(sides) > capacity or sum(side * side for side in sides) >= s.seq_len:
            self.check([index])
        images = sum(side * side for side in sides)
        # Each real image's draws; an empty slot's stay zero (nothing reads them).
        draws = [s[index * capacity + k] for k in range(len(sides))]
        per_image = {key: torch.zeros((capacity,) + drawn[key].shape) for key in PER_IMAGE if key in drawn}
        for key, stacked in per_image.items():
            for k, draw in enumerate(draws):
                stacked[k] = draw[key]
        if self.shards is not None:
            found, caption = self.shards.read(index)
            pictures = [pixels(picture, s.image_size) for picture in found]
            for k, picture in enumerate(found if "target" in per_image else []):
                per_image["target"][k] = pixels(picture, s.target_size)
            text = tokenize(caption, s.seq_len + 1 - images, s.vocab)
            tokens = torch.cat([torch.zeros(images, dtype=torch.long), text])
        else:
            pictures = [_resized(draws[k]["images"], side * self.patch) for k, side in enumerate(sides)]
            # The sample's whole progression: its ids and the last target (never an image's).
            tokens = torch.cat([drawn["ids"], drawn["targets"][-1:]])
            tokens[:images] = 0
        targets = tokens[1:].clone()
        targets[: max(0, images - 1)] = IGNORE
        patches = torch.zeros(s.seq_len, 3 * self.patch * self.patch)  # a row as long as the sequence its tokens lead
        if pictures:
            patches[:images] = torch.cat([patches_of(picture, self.patch) for picture in pictures])
        side_of = torch.zeros(capacity, dtype=torch.long)
        side_of[: len(sides)] = torch.tensor(sides, dtype=torch.long)
        return {
            **per_image,
            "patches": patches,
            "image_sides": side_of,
            "image_slots": side_of > 0,
            "ids": tokens[:-1],
            "targets": targets,
        }


def image_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per row of a batch of these samples: the tokens its images take at the sequence's start."""
    return (batch["image_sides"] ** 2).sum(1)


def token_mask(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """(rows, length): whether each position of a row is one of its `tokens` first ones."""
    return torch.arange(length, device=tokens.device)[None, :] < tokens[:, None]


def dealt_slots(slots: torch.Tensor, share: int, shares: int) -> torch.Tensor:
    """The image slots (rows, capacity) of the images dealt to share `share` of `shares` of
    a micro-batch whose real images fill `slots`: its images in sequence order (a row's real
    slots come first) dealt out as the plan prices them (data.balance.dealt_images)."""
    real = slots.flatten().nonzero()[:, 0]
    block = dealt_images(len(real), shares)[share]
    out = torch.zeros(slots.numel(), dtype=torch.bool, device=slots.device)
    out[real[block.start : block.stop]] = True
    return out.view(slots.shape)


def slot_token_mask(sides: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """(rows, length): whether each position of a row is a token of one of its images that
    `slots` (rows, capacity) marks, its images' `sides` (rows, capacity) in patches laid out
    in order from the sequence's start (all its real slots: token_mask of its image_tokens)."""
    sizes = sides**2
    ends = sizes.cumsum(1)
    positions = torch.arange(length, device=sides.device)[None, None, :]
    inside = (positions >= (ends - sizes)[..., None]) & (positions < ends[..., None])
    return (inside & slots[..., None]).any(1)


def _resized(image: torch.Tensor, size: int) -> torch.Tensor:
    """A drawn picture at `size` pixels a side (itself at its own size)."""
    if image.shape[-1] == size:
        return image
    return F.interpolate(image[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
