"""Synthetic data, deterministic from (seed, sample index), with structure to learn.

Image-text pairs: each sample has a class; its image is the class's prototype plus noise
and its caption draws tokens from the class's own slice of the vocabulary, so a
contrastive model can learn to match them. Token sequences (GPT): a class's arithmetic
progression of tokens with a random start, so next-token prediction is learnable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CLASSES = 16


def _generator(seed: int, index: int) -> torch.Generator:
    # A large odd multiplier keeps (seed, index) pairs from colliding for any sane index.
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def class_image(seed: int, index: int, size: int, noise: float) -> tuple[torch.Generator, int, torch.Tensor]:
    """Sample `index`'s generator (for what else it draws), class, and image: the class's
    prototype plus noise."""
    g = _generator(seed, index)
    label = int(torch.randint(CLASSES, (1,), generator=g))
    prototype = torch.randn(3, size, size, generator=_generator(seed, -1 - label))
    return g, label, prototype + noise * torch.randn(prototype.shape, generator=g)


@dataclass(frozen=True)
class SyntheticImageText:
    seed: int
    image_size: int
    text_len: int
    vocab: int
    noise: float = 0.5

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g, label, image = class_image(self.seed, index, self.image_size, self.noise)
        width = max(1, self.vocab // CLASSES)
        ids = label * width % self.vocab + torch.randint(width, (self.text_len,), generator=g)
        return {"images": image, "ids": ids % self.vocab}


@dataclass(frozen=True)
class SyntheticTokens:
    seed: int
    seq_len: int
    vocab: int

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = _generator(self.seed, index)
        stride = 1 + int(torch.randint(CLASSES, (1,), generator=g))
        start = int(torch.randint(self.vocab, (1,), generator=g))
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        return {"ids": tokens[:-1], "targets": tokens[1:]}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
