"""Synthetic LAION-like interleaved image-text sequences (DistTrain §2.3 Fig. 5, §8 Datasets).

A sample is one `seq_len`-token sequence (8192 in DistTrain) of interleaved (image,
caption) subsequences, zero-padded at the end. Its layout is a pure function of (seed,
index), drawn with Python's own generator, so the simulator and the real backend see the
same batches. The distribution (DistTrain plots its three marginals, all skewed, but
gives no parameters; ours are stated here and are the only place they live):

- image count n = 1 + Poisson(lam), lam = (mean_images - 1) * Exponential(1): a
  Gamma-Poisson (geometric) mixture of mean `mean_images`; most sequences hold few
  images, a long tail many (Fig. 5(c)). mean_images = 1 gives one image per sequence.
- image side in patches: round(base * exp(N(0, spread))) clipped to [base/2, 2*base],
  `base` = the encoder's nominal side (16 patches: ViT-Huge/14 at 224 px), `spread` the
  model's image_size_spread (0.3 by default; 0: every image at the nominal side). An
  image is side^2 patch tokens (+ CLS in the encoder): median 256 tokens, 64 to 1024 at
  spread 0.3 (Fig. 5(b)).
- caption tokens: round(exp(N(ln 20, 0.8))) clipped to [2, 200] (LAION captions are
  short with a long tail, Fig. 5(a)).
- pairs are dropped from the end while the sequence would overflow `seq_len` (one image
  always stays; its caption is cut if it alone overflows); an image's tokens count once
  per encoder that reads it (`copies`: Optimus's DualEnc MLLMs put both encoders' tokens of
  each image in the sequence).

Costs: a sequence's encoder work is the FLOPs of its images at their own sizes (linear
plus attention terms in the image's tokens); its generator work is one generated image
per image at the model's fixed generation resolution (DistTrain §8); the LLM's work is
fixed (the sequence length is). `relative_loads` turns costs into Work.load factors
against the batch's mean sequence: the model's images_per_sequence sets the mean work
every strategy prices, the data decides how it is spread over the batch. Costs are kept
per image too: a unit replicated over a TP group deals a micro-batch's images out whole.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence

from src.errors import ConfigError
from src.models.spec import ModelSpec

CAPTION_MEDIAN = 20  # tokens
CAPTION_SPREAD = 0.8  # sigma of log(caption tokens)
CAPTION_RANGE = (2, 200)


@dataclass(frozen=True)
class Layout:
    """One sequence: its images' sides (in patches) and their captions' tokens, in order."""

    image_sides: tuple[int, ...]
    caption_tokens: tuple[int, ...]
    seq_len: int
    # Each image's tokens in the sequence: one set per encoder that reads it (left out of the
    # repr, which digests of drawn layouts were taken of before it came).
    copies: int = field(default=1, repr=False)

    @property
    def images(self) -> int:
        return len(self.image_sides)

    @property
    def image_tokens(self) -> int:
        return self.copies * sum(side * side for side in self.image_sides)

    @property
    def text_tokens(self) -> int:
        return sum(self.caption_tokens)

    @property
    def padding(self) -> int:
        return self.seq_len - self.image_tokens - self.text_tokens


@dataclass(frozen=True)
class InterleavedData:
    seed: int
    seq_len: int
    mean_images: float
    base_side: int  # patches per side of the encoder's nominal image
    side_spread: float  # sigma of log(image side)
    copies: int = 1  # each image's tokens in the sequence: one set per encoder that reads it

    def __post_init__(self) -> None:
        if self.mean_images < 1:
            raise ValueError(f"mean_images={self.mean_images}: every sequence holds at least one image")
        if not nominal_fits(self.seq_len, self.base_side, self.copies):
            raise ValueError(
                f"a {self.base_side}x{self.base_side}-patch image x{self.copies} does not fit a {self.seq_len}-token sequence"
            )

    def layout(self, index: int) -> Layout:
        rng = random.Random(self.seed * 1_000_003 + index)
        lam = (self.mean_images - 1) * rng.expovariate(1.0)
        count = 1 + _poisson(rng, lam)
        low, high = max(1, self.base_side // 2), 2 * self.base_side
        # Drawn also at spread 0, so that every spread draws the captions from the same stream.
        sides = [min(high, max(low, round(self.base_side * math.exp(rng.gauss(0.0, self.side_spread))))) for _ in range(count)]
        captions = [
            min(CAPTION_RANGE[1], max(CAPTION_RANGE[0], round(math.exp(rng.gauss(math.log(CAPTION_MEDIAN), CAPTION_SPREAD)))))
            for _ in range(count)
        ]
        copies = self.copies
        while len(sides) > 1 and copies * sum(s * s for s in sides) + sum(captions) > self.seq_len:
            sides.pop()
            captions.pop()
        sides[0] = min(sides[0], math.isqrt((self.seq_len - CAPTION_RANGE[0]) // copies))
        captions[0] = min(captions[0], self.seq_len - copies * sides[0] * sides[0])
        return Layout(tuple(sides), tuple(captions), self.seq_len, copies)

    def batch(self, size: int, step: int = 0) -> list[Layout]:
        """The `size` sequences of global batch `step`, in data order."""
        return [self.layout(step * size + i) for i in range(size)]


def nominal_fits(seq_len: int, side: int, copies: int) -> bool:
    """Whether one image at the nominal side (its tokens once per encoder) leaves room for
    the shortest caption."""
    return copies * side * side + CAPTION_RANGE[0] <= seq_len


def sampler(model: ModelSpec, seed: int) -> InterleavedData:
    """An MLLM's sequences (model.images_per_sequence images on average, their sides spread
    by model.image_size_spread around the encoder's nominal side): what DistTrain's planner
    prices and the real backend trains on (data.interleaved_mllm). An image takes a set of
    tokens per encoder that reads it (an Optimus DualEnc MLLM: two)."""
    side = round(model.extras["image_tokens"] ** 0.5)
    extras = model.extras
    copies = max(1, sum(1 for u in model.per_image_units() if model.unit(u).arch.reads_images))
    seq = model.unit("llm").seq_len
    if not nominal_fits(seq, side, copies):
        raise ConfigError(
            f"train.data=interleaved: one image at the nominal side takes {copies} x {side * side} tokens, which with a "
            f"caption's {CAPTION_RANGE[0]} do not fit the LLM's {seq}-token sequence (model.image_size, model.patch_size "
            f"or train.seq_len)"
        )
    return InterleavedData(seed, seq, extras["images_per_sequence"], side, extras["image_size_spread"], copies)


def _poisson(rng: random.Random, lam: float) -> int:
    """Poisson draw by inversion (lam is at most a few tens here)."""
    if lam <= 0:
        return 0
    k, p = 0, math.exp(-lam)
    cumulative, u = p, rng.random()
    while u > cumulative and k < 10_000:
        k += 1
        p *= lam / k
        cumulative += p
    return k


def encoder_costs(layout: Layout, per_token: float, per_token_squared: float) -> tuple[float, ...]:
    """The encoder FLOPs of each of a sequence's images: an image of t tokens (+ CLS) costs
    per_token * t + per_token_squared * t^2 (its attention scores)."""
    return tuple(per_token * (s * s + 1) + per_token_squared * (s * s + 1) ** 2 for s in layout.image_sides)


def generator_costs(layout: Layout) -> tuple[float, ...]:
    """Every image of the sequence is generated at the model's fixed resolution: each costs
    the same."""
    return (1.0,) * layout.images


def relative_loads(costs: Sequence[tuple[float, ...]]) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """Each sequence's cost (the sum of its images') and each of its images' costs, against
    the batch's mean sequence: a batch whose sequences are alike has every load 1."""
    totals = [sum(each) for each in costs]
    mean = sum(totals) / len(totals)
    return tuple(t / mean for t in totals), tuple(tuple(c / mean for c in each) for each in costs)
