"""What each sequence of a step's batch weighs on the units that work per image: the
workload's data (train.data) as every planner prices it.

An MLLM's encoder and generator work per image; a sequence's load on each is its work
against the batch's mean sequence (the model's images_per_sequence sets the mean work every
strategy prices; the data decides how it spreads over the batch): drawn by the interleaved
sampler (src/data/interleaved.py), all alike under uniform data, or counted from the images
a run's tar shards hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from src.data.interleaved import Layout, encoder_costs, generator_costs, relative_loads, sampler
from src.errors import ConfigError
from src.models.spec import ModelSpec


PerImage = tuple[tuple[float, ...], ...]  # per sequence, each of its images' load


@dataclass(frozen=True)
class BatchLoads:
    """Each sequence of the step's batch: its encoder and generator loads (against the
    batch's mean sequence; on given sample images, against the model's nominal one), its
    image count and each of its images' share of its loads (`*_images`, summing to them)."""

    encoder: tuple[float, ...]
    generator: tuple[float, ...]
    images: tuple[int, ...]
    encoder_images: PerImage
    generator_images: PerImage

    @property
    def peak(self) -> dict[str, float]:
        return {"encoder": max(self.encoder), "llm": 1.0, "generator": max(self.generator)}

    def of(self, unit: str) -> tuple[float, ...] | None:
        return {"encoder": self.encoder, "generator": self.generator}.get(unit)

    def per_image(self, unit: str) -> PerImage:
        """Each sequence's images' loads on a unit that works per image (encoder, generator)."""
        return {"encoder": self.encoder_images, "generator": self.generator_images}[unit]


def batch_loads(
    model: ModelSpec, seed: int, batch: int, data: str, sample_images: tuple[int, ...] | None, step: int = 0
) -> BatchLoads:
    """Each sequence's loads in global batch `step`: of the images the run's shards hold
    (`sample_images`, every one at the nominal side, whatever `data` says), else of the
    sequences `data` says, drawn around the model's mean (relative to the batch's: the batch
    prices the model's work)."""
    if sample_images is not None:
        return image_loads(sample_images, model.extras["images_per_sequence"])
    if data == "uniform":
        images = model.extras["images_per_sequence"]
        ones, alike = (1.0,) * batch, ((1.0 / images,) * images,) * batch
        return BatchLoads(ones, ones, (images,) * batch, alike, alike)
    return layout_loads(model, sampler(model, seed).batch(batch, step))


def layout_loads(model: ModelSpec, layouts: Sequence[Layout]) -> BatchLoads:
    """The loads of sequences whose images the sampler drew, against their batch's mean."""
    encoder = model.unit("encoder")
    # FLOPs per token and per token squared of one nominal image, from the unit's kernels.
    linear = quadratic = 0.0
    tokens = encoder.seq_len / model.extras["images_per_sequence"]
    for layer in encoder.layers:
        for kernel in layer.kernels:
            if kernel.attention_core:
                quadratic += kernel.flops() / tokens**2
            else:
                linear += kernel.flops() / tokens
    encoder_loads, encoder_images = relative_loads([encoder_costs(l, linear, quadratic) for l in layouts])
    generator_loads, generator_images = relative_loads([generator_costs(l) for l in layouts])
    return BatchLoads(encoder_loads, generator_loads, tuple(l.images for l in layouts), encoder_images, generator_images)


def image_loads(images: tuple[int, ...], nominal: int) -> BatchLoads:
    """Images all at the nominal side: a sequence's encoder and generator work is its count's
    against the model's `nominal` images per sequence (none for a sequence of no image), so
    the batch prices the images it holds."""
    if not any(images):
        raise ConfigError(
            f"backend.data: the first step's {len(images)} samples hold no image: the plan prices the encoder and "
            f"generator by the images of that batch (give data whose first batch holds images)"
        )
    loads, each = tuple(n / nominal for n in images), tuple((1.0 / nominal,) * n for n in images)
    return BatchLoads(loads, loads, images, each, each)
