"""Synthetic MLLM samples for the real backend, deterministic from (seed, sample index).

One sample is one sequence of DistTrain's uniform data (train.data=uniform: every
sequence alike): one image at the encoder's resolution in its first `image_tokens`
positions, then text; and one image to generate. Each sample has a class: its input image
is the class's prototype plus noise, its text the class's arithmetic progression of tokens
(as SyntheticTokens), its target image the class's own picture at the generator's
resolution. The diffusion step is drawn per sample too: a timestep of SD's scaled-linear
schedule (1000 steps, betas 0.00085 to 0.012), its alpha-bar, and the noise to predict.

Without a generator (Optimus's MLLMs: `target_size` 0) a sample is its image and text
only; `image_tokens` counts the tokens of every encoder that reads the image (two
encoders of a DualEnc MLLM look at the same image, their tokens side by side).

Targets: the positions whose next token is an image token predict nothing (-100), so
every sequence scores the same number of tokens and a micro-batch's mean loss weighs
every sample alike, whatever the order of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from src.data.synthetic import CLASSES, _generator, class_image

IGNORE = -100
TIMESTEPS = 1000
BETAS = (0.00085, 0.012)


def alpha_bars() -> torch.Tensor:
    betas = torch.linspace(BETAS[0] ** 0.5, BETAS[1] ** 0.5, TIMESTEPS, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, dim=0).float()


@dataclass(frozen=True)
class SyntheticMLLM:
    seed: int
    image_size: int
    image_tokens: int
    seq_len: int
    vocab: int
    target_size: int = 0  # 0: no image to generate
    latent_channels: int = 0
    latent_size: int = 0
    noise: float = 0.5

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g, label, image = class_image(self.seed, index, self.image_size, self.noise)
        stride = 1 + label
        start = int(torch.randint(self.vocab, (1,), generator=g))
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        targets = tokens[1:].clone()
        targets[: self.image_tokens - 1] = IGNORE
        sample = {"images": image, "ids": tokens[:-1], "targets": targets}
        if not self.target_size:
            return sample
        target = torch.randn(3, self.target_size, self.target_size, generator=_generator(self.seed, -1 - CLASSES - label))
        step = int(torch.randint(TIMESTEPS, (1,), generator=g))
        latent_shape = (self.latent_channels, self.latent_size, self.latent_size)
        return {
            **sample,
            "target": target,
            "latent": torch.randn(latent_shape, generator=g),  # for a generator without the VAE (precomputed latents)
            "noise": torch.randn(latent_shape, generator=g),
            "timestep": torch.tensor(float(step)),
            "alpha": alpha_bars()[step],
        }
