"""Synthetic diffusion samples for a pixel-space U-Net (Par4D's ADM U-Nets), deterministic
from (seed, sample index): the image to denoise is a class's prototype plus noise (as the
image-text data's), then a timestep of Improved DDPM's cosine schedule (Nichol & Dhariwal:
4000 steps, offset s = 0.008, betas capped at 0.999, the schedule of their CIFAR-10 runs),
its alpha-bar, and the noise the U-Net learns to predict.

Keys are the generator's (src/runtime/modules/generator.py): `latent` is what the U-Net
noises, here the image itself (no VAE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from src.data.synthetic import class_image

TIMESTEPS = 4000
COSINE_OFFSET = 0.008
MAX_BETA = 0.999


@lru_cache(maxsize=1)
def cosine_alpha_bars() -> torch.Tensor:
    def f(t: float) -> float:
        return math.cos((t / TIMESTEPS + COSINE_OFFSET) / (1 + COSINE_OFFSET) * math.pi / 2) ** 2

    betas = [min(1 - f(t + 1) / f(t), MAX_BETA) for t in range(TIMESTEPS)]
    return torch.cumprod(1 - torch.tensor(betas, dtype=torch.float64), dim=0).float()


@dataclass(frozen=True)
class SyntheticDiffusion:
    seed: int
    image_size: int
    noise: float = 0.5

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g, _, image = class_image(self.seed, index, self.image_size, self.noise)
        step = int(torch.randint(TIMESTEPS, (1,), generator=g))
        return {
            "latent": image,
            "noise": torch.randn(image.shape, generator=g),
            "timestep": torch.tensor(float(step)),
            "alpha": cosine_alpha_bars()[step],
        }
