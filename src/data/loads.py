"""What each sequence of a step's batch weighs on the units that work per image: the
workload's data (train.data) as every planner prices it.

An MLLM's encoder and generator (an Optimus MLLM's encoders) work per image; a sequence's
load on each is its work
against the batch's mean sequence (the model's images_per_sequence sets the mean work every
strategy prices; the data decides how it spreads over the batch): drawn by the interleaved
sampler (src/data/interleaved.py), all alike under uniform data, or counted from the images
a run's tar shards hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from src.data.interleaved import Layout, encoder_costs, generator_costs, relative_loads, sampler
from src.errors import ConfigError
from src.models.spec import ModelSpec


PerImage = tuple[tuple[float, ...], ...]  # per sequence, each of its images' load


@dataclass(frozen=True)
class BatchLoads:
    """Each sequence of the step's batch: per unit that works per image, its load (against
    the batch's mean sequence; on given sample images, against the model's nominal one) and
    each of its images' share of it (`per_image`, summing to it); its image count."""

    by_unit: Mapping[str, tuple[float, ...]]
    images: tuple[int, ...]
    per_image_by_unit: Mapping[str, PerImage]

    @property
    def peak(self) -> dict[str, float]:
        return {unit: max(loads) for unit, loads in self.by_unit.items()} | {"llm": 1.0}

    def of(self, unit: str) -> tuple[float, ...] | None:
        return self.by_unit.get(unit)

    def per_image(self, unit: str) -> PerImage:
        """Each sequence's images' loads on a unit that works per image."""
        return self.per_image_by_unit[unit]


def batch_loads(
    model: ModelSpec, seed: int, batch: int, data: str, sample_images: tuple[int, ...] | None, step: int = 0
) -> BatchLoads:
    """Each sequence's loads in global batch `step`: of the images the run's shards hold
    (`sample_images`, every one at the nominal side, whatever `data` says), else of the
    sequences `data` says, drawn around the model's mean (relative to the batch's: the batch
    prices the model's work)."""
    if sample_images is not None:
        return image_loads(model, sample_images)
    units = model.per_image_units()
    if data == "uniform":
        images = model.extras["images_per_sequence"]
        ones, alike = (1.0,) * batch, ((1.0 / images,) * images,) * batch
        return BatchLoads({u: ones for u in units}, (images,) * batch, {u: alike for u in units})
    return layout_loads(model, sampler(model, seed).batch(batch, step))


def layout_loads(model: ModelSpec, layouts: Sequence[Layout]) -> BatchLoads:
    """The loads of sequences whose images the sampler drew, against their batch's mean: a
    unit that reads the images (a ViT) by their FLOPs at their own sides, one that generates
    them by their count (each at the model's fixed resolution)."""
    loads, per_image = {}, {}
    for unit in model.per_image_units():
        spec = model.unit(unit)
        if spec.arch.reads_images:
            costs = [encoder_costs(layout, *_token_flops(model, unit)) for layout in layouts]
        else:
            costs = [generator_costs(layout) for layout in layouts]
        loads[unit], per_image[unit] = relative_loads(costs)
    return BatchLoads(loads, tuple(layout.images for layout in layouts), per_image)


def _token_flops(model: ModelSpec, unit: str) -> tuple[float, float]:
    """FLOPs per token and per token squared of one nominal image through `unit`, from its
    kernels."""
    spec = model.unit(unit)
    linear = quadratic = 0.0
    tokens = spec.seq_len / model.extras["images_per_sequence"]
    for layer in spec.layers:
        for kernel in layer.kernels:
            if kernel.attention_core:
                quadratic += kernel.flops() / tokens**2
            else:
                linear += kernel.flops() / tokens
    return linear, quadratic


def image_loads(model: ModelSpec, images: tuple[int, ...]) -> BatchLoads:
    """Images all at the nominal side: a sequence's work on every per-image unit is its
    count's against the model's nominal images per sequence (none for a sequence of no
    image), so the batch prices the images it holds."""
    if not any(images):
        raise ConfigError(
            f"backend.data: the first step's {len(images)} samples hold no image: the plan prices the encoder and "
            f"generator by the images of that batch (give data whose first batch holds images)"
        )
    nominal = model.extras["images_per_sequence"]
    loads, each = tuple(n / nominal for n in images), tuple((1.0 / nominal,) * n for n in images)
    units = model.per_image_units()
    return BatchLoads({u: loads for u in units}, images, {u: each for u in units})
