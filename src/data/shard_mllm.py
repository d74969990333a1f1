"""MLLM samples from image-caption tar shards: DistTrain's uniform data with real images.

The shard's image is the encoder's input (at its resolution) and the generator's target
(at the target resolution); the caption's byte tokens follow the image tokens. Pads are
scored like any token, so every sequence scores the same number of tokens, as in
SyntheticMLLM (a micro-batch's mean loss weighs every sample alike, whatever the order of
the batch). The diffusion step, noise and precomputed latent are SyntheticMLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from src.data.shards import TarShards, pixels, tokenize
from src.data.synthetic_mllm import IGNORE, SyntheticMLLM


@dataclass(frozen=True)
class ShardMLLM:
    shards: TarShards
    synthetic: SyntheticMLLM

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s = self.synthetic
        image, caption = self.shards.read(index)
        text = tokenize(caption, s.seq_len + 1 - s.image_tokens, s.vocab)
        tokens = torch.cat([torch.zeros(s.image_tokens, dtype=torch.long), text])
        targets = tokens[1:].clone()
        targets[: s.image_tokens - 1] = IGNORE
        drawn = s[index]
        return {
            **drawn,
            "images": pixels(image, s.image_size),
            "ids": tokens[:-1],
            "targets": targets,
            "target": pixels(image, s.target_size),
        }
