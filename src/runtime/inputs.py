"""Each unit's micro-batches for one step, cut from the global batch of that step.

Step s uses global samples [s·B, (s+1)·B), which each unit cuts by its BatchLayout
(src/batch_layout.py): into the step's batch-sync groups, each split over the unit's
data-parallel replicas, each replica's share cut into micro-batches in order. Every unit
thus sees the samples of a batch-sync at the same step positions whatever its replicas
and micro-batches (towers of different dp pair up row by row), and any plan trains on the
very samples of a 1-process run.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch

from src.batch_layout import BatchLayout
from src.data.balance import Balancing, dealt_images
from src.data.disaggregated import Reordering
from src.data.interleaved import sampler
from src.data.loads import image_loads, layout_loads
from src.data.interleaved_mllm import InterleavedMLLM, dealt_slots, image_tokens, slot_token_mask
from src.data.shards import TarShards
from src.data.synthetic import SyntheticImageText, SyntheticTokens, collate
from src.data.synthetic_diffusion import SyntheticDiffusion
from src.data.synthetic_mllm import SyntheticMLLM
from src.errors import ConfigError
from src.models.sd21 import LATENT_CHANNELS
from src.models.spec import ModelSpec
from src.program import Plan, UnitPlan
from src.runtime.row_shares import Share

if TYPE_CHECKING:
    from src.runtime.preprocess import Producer

IGNORE = -100  # cross_entropy's ignore_index


def batch_layout(plan: UnitPlan, global_batch: int) -> BatchLayout:
    """How a rank's samples of the unit are cut from the step's batch: its replica's
    micro-batches (a unit replicated over its TP group: the group's replica's whole
    micro-batches, of which each rank runs its share: runtime.row_shares)."""
    return BatchLayout.of_replica_batch(global_batch, plan.batch_per_replica, plan.micro_batch, plan.sample_groups)


def rank_reads(plan: Plan, global_batch: int, replica: Mapping[str, int]) -> dict[str, tuple[BatchLayout, int]]:
    """What each of a rank's units (`replica`: its place in each one's data group) reads:
    the layout of the unit whose samples it takes (its own, or the one `samples_of` names)
    and the rank's replica there (a replicated unit's data group runs its rows fastest:
    row_shares.data_group)."""
    reads = {}
    for unit in replica:
        reader = plan.unit(plan.unit(unit).samples_of or unit)
        reads[unit] = (batch_layout(reader, global_batch), replica[reader.unit] // reader.row_shares)
    return reads


def dataset_for(model: ModelSpec, seed: int, source: str, errors: str = "fail", content: str = "uniform") -> Any:
    """The run's dataset: synthetic from the seed, or tar shards matching `source` (whose
    bad members fail the run, or are left out with errors="skip": backend.data_errors).
    An MLLM's synthetic sequences hold what `content` says; its shards' what they hold."""
    names = [u.name for u in model.units]
    if "vision" in names and "text" in names:
        image = model.unit("vision").arch.image_size
        text = model.unit("text")
        if source == "synthetic":
            return SyntheticImageText(seed, image, text.seq_len, text.arch.vocab)
        return TarShards(source, image, text.seq_len, text.arch.vocab, errors)
    if names == ["llm"]:
        llm = model.unit("llm")
        return SyntheticTokens(seed, llm.seq_len, llm.arch.vocab)
    if _sequences_of_images(model):
        return _mllm_data(model, seed, source, errors, content)
    if names == ["unet"]:
        if source != "synthetic":
            raise ConfigError(f"backend.data={source!r}: the real backend has only synthetic data for {model.name} (use synthetic)")
        return SyntheticDiffusion(seed, model.unit("unet").arch.image_size)
    if names[-1] == "llm" and all(model.unit(n).arch.reads_images for n in names[:-1]):
        return _encoders_llm_data(model, seed, source, names[:-1], content)
    raise ConfigError(
        f"the real backend has no data for model {model.name} (units {names}): it trains CLIP, CoCa, LiT, GPT, U-Nets and the MLLMs"
    )


def _sequences_of_images(model: ModelSpec) -> bool:
    """An MLLM whose sequences hold images to encode and to generate (encoder, LLM, generator)."""
    return [u.name for u in model.units] == ["encoder", "llm", "generator"]


def shard_images(model: ModelSpec, source: str, errors: str, samples: int) -> tuple[int, ...] | None:
    """Images per sample of the first `samples` samples of an MLLM's tar shards (`source`),
    from their index (nothing decoded); None for synthetic data and other models' shards."""
    if source == "synthetic" or not _sequences_of_images(model):
        return None
    data = _mllm_data(model, 0, source, errors, "interleaved")
    assert isinstance(data, InterleavedMLLM)
    return tuple(data.image_count(i) for i in range(samples))


def _mllm_data(model: ModelSpec, seed: int, source: str, errors: str, content: str) -> SyntheticMLLM | InterleavedMLLM:
    """Synthetic uniform data (one image per sequence, in and out), or sequences of none to
    several images (data.interleaved_mllm): drawn as the simulator draws them, or read from
    tar shards whose samples hold several images."""
    encoder, llm, generator = model.unit("encoder"), model.unit("llm"), model.unit("generator")
    image, vocab, out = encoder.arch.image_size, llm.arch.vocab, generator.arch
    uniform = source == "synthetic" and content == "uniform"
    if uniform and encoder.arch.images != 1:
        raise ConfigError(
            f"model.images_per_sequence={encoder.arch.images}: the real backend runs uniform MLLM data with one image "
            f"per sequence (train.data=interleaved draws each sequence's images)"
        )
    # Uniform: the sequence's image tokens; interleaved: one image's (each drawn alone).
    tokens = llm.arch.image_tokens if uniform else model.extras["image_tokens"]
    synthetic = SyntheticMLLM(seed, image, tokens, llm.seq_len, vocab, out.image_size, LATENT_CHANNELS, out.latent_size)
    if uniform:
        return synthetic
    patch = encoder.arch.patch_size
    if source == "synthetic":
        return InterleavedMLLM(synthetic, patch, layouts=sampler(model, seed))
    return InterleavedMLLM(synthetic, patch, shards=TarShards(source, image, llm.seq_len, vocab, errors, images="several"))


def _encoders_llm_data(model: ModelSpec, seed: int, source: str, encoders: list[str], content: str) -> SyntheticMLLM | InterleavedMLLM:
    """ViT encoders chained into an LLM (the multi-encoder MLLMs): one image per sequence, which
    every encoder reads, its tokens of all encoders first in the sequence; or, with one
    encoder, interleaved sequences of none to several images as the simulator draws them."""
    llm = model.unit("llm")
    if source != "synthetic":
        raise ConfigError(f"backend.data={source!r}: the real backend has only synthetic data for {model.name} (use synthetic)")
    if content != "uniform":
        if len(encoders) > 1:
            raise ConfigError(
                f"train.data={content}: the real backend gives interleaved images to one encoder, model {model.name} "
                f"has {len(encoders)} ({', '.join(encoders)}); the simulator prices it"
            )
        encoder = model.unit(encoders[0])
        synthetic = SyntheticMLLM(seed, encoder.arch.image_size, model.extras["image_tokens"], llm.seq_len, llm.arch.vocab)
        return InterleavedMLLM(synthetic, encoder.arch.patch_size, layouts=sampler(model, seed))
    images = llm.arch.images
    if images != 1:
        raise ConfigError(f"model.images_per_sample={images}: the real backend runs these MLLMs with one image per sequence")
    sizes = {model.unit(name).arch.image_size for name in encoders}
    if len(sizes) > 1:
        raise ConfigError(f"encoders {encoders} read images of sizes {sorted(sizes)}: the real backend gives them one image")
    return SyntheticMLLM(seed, sizes.pop(), llm.arch.image_tokens, llm.seq_len, llm.arch.vocab)


def skipped_members(dataset: Any) -> set[str]:
    """The bad shard members a dataset left out so far (backend.data_errors=skip)."""
    shards = getattr(dataset, "shards", dataset)
    return set(shards.skipped) if isinstance(shards, TarShards) else set()


def tell_repeats(dataset: Any, global_batch: int, steps: int) -> None:
    """One line when a run reads more samples than its shards hold: epochs wrap around, so
    each sample is trained on several times."""
    shards = getattr(dataset, "shards", dataset)
    reads = global_batch * steps
    if isinstance(shards, TarShards) and reads > len(shards):
        print(
            f"backend.data: {len(shards)} samples for {steps} steps of {global_batch}: each sample is read "
            f"{reads / len(shards):.3g} times on average (epochs wrap around)",
            file=sys.stderr,
            flush=True,
        )


def unit_fields(model: ModelSpec, unit: str, batch: Mapping[str, torch.Tensor], share: Share | None = None) -> dict[str, torch.Tensor]:
    """What a unit reads: images (a ViT), token ids, and next-token targets when it ends
    in a language-model head (GPT; CoCa's captioner: the caption shifted by one); an SD
    generator its target image (or latent, without the VAE), noise and timestep. `share`:
    the rank's share of the micro-batch, of a unit replicated over its TP group: its
    images where it deals them out (interleaved data), else its rows (runtime.row_shares)."""
    spec = model.unit(unit)
    if share is not None and "image_slots" not in batch:
        return _share_of_rows(unit_fields(model, unit, batch), share)
    # Interleaved sequences (data.interleaved_mllm): the encoder takes the patches of the
    # images it runs (the micro-batch's real ones, or those dealt to its share), packed, and
    # their sides; the generator their slots' draws; every unit the slots of the images it
    # runs, the sides of all the micro-batch's and the tokens they take in each sequence;
    # each loss its normaliser.
    slots = batch.get("image_slots")
    held: dict[str, torch.Tensor] = {}
    if slots is not None:
        slots = slots if share is None else dealt_slots(slots, share.index, share.count)
        held = {"image_slots": slots, "image_sides": batch["image_sides"], "image_tokens": image_tokens(batch)}
    if spec.arch.reads_images:
        if slots is None:
            return {"images": batch["images"]}
        packed = batch["patches"][slot_token_mask(batch["image_sides"], slots, batch["patches"].shape[1])]
        return {"patches": packed, "patch_sides": batch["image_sides"][slots]} | held
    if spec.kind == "contrastive":
        return {}
    if spec.kind == "unet":
        vae = any(layer.name.startswith("vae.") for layer in spec.layers)
        keys = ("target" if vae else "latent", "noise", "timestep", "alpha")
        if slots is None:
            return {key: batch[key] for key in keys}
        # A share's loss is its part of the micro-batch's, as a share of its rows would be.
        norm = batch["images_mean"] / (1 if share is None else share.count)
        return {key: batch[key][slots] for key in keys} | held | {"loss_norm": norm}
    out = {"ids": batch["ids"]}
    if spec.layers[-1].name in ("head", "caption_head"):
        if "targets" in batch:
            out["targets"] = batch["targets"]
        else:
            ids = batch["ids"]
            out["targets"] = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    if slots is not None:
        out |= held | {"loss_norm": batch["scored_mean"]}
    return out


def _share_of_rows(fields: dict[str, torch.Tensor], share: Share) -> dict[str, torch.Tensor]:
    """`share`'s block of a micro-batch's rows (data.balance.dealt_images, as the plan prices
    it), each loss normalised so that it is the share's part of the micro-batch's (a loss
    over its rows' images, or their scored tokens, over the micro-batch's per share)."""
    rows = len(next(iter(fields.values())))
    block = dealt_images(rows, share.count)[share.index]
    out = {key: value[block.start : block.stop] for key, value in fields.items()}
    if "noise" in fields:
        out["loss_norm"] = torch.full((rows,), 1 / share.count)
    elif "targets" in fields:
        out["loss_norm"] = (fields["targets"] != IGNORE).sum(1) / share.count
    return out


@dataclass(frozen=True)
class StepSamples:
    """Every micro-batch one trainer reads in a step, cut from the step's global batch (CPU
    tensors). Picklable: a preprocessing producer process makes them too.

    reads[unit]: the layout the unit reads its samples by and its replica there (rank_reads).
    order[p]: which of the step's samples (in data order) position p of the batch holds
    (a plan that reorders its batch); None: data order. balancing: the policy that placed
    `order` for the first step, to place every step's batch by its own loads (Plan.balancing).
    shares[unit]: the trainer's share of each micro-batch of a unit replicated over its TP
    group (row_shares.rank_shares)."""

    model: ModelSpec
    dataset: Any
    global_batch: int
    reads: Mapping[str, tuple[BatchLayout, int]]
    order: tuple[int, ...] | None = None
    balancing: Balancing | Reordering | None = None
    shares: Mapping[str, Share] = field(default_factory=dict)

    def order_of(self, step: int) -> tuple[int, ...] | None:
        """The step's order: the plan's, or its balancing's on the step's sequences."""
        if self.balancing is None or not isinstance(self.dataset, InterleavedMLLM):
            return self.order
        indices = self.step_samples(step)
        if self.dataset.shards is not None:
            images = tuple(self.dataset.image_count(i) for i in indices)
            if not any(images):
                return None  # no sequence weighs on the per-image units more than another
            loads = image_loads(self.model, images)
        else:
            assert self.dataset.layouts is not None, "drawn images come from the sampler"
            loads = layout_loads(self.model, [self.dataset.layouts.layout(i) for i in indices])
        return self.balancing.place(loads)

    def step_samples(self, step: int) -> list[int]:
        """The indices of the step's samples, in data order."""
        return list(range(step * self.global_batch, (step + 1) * self.global_batch))

    def images_per_sequence(self, step: int) -> float | None:
        """The mean images per sequence of the step's samples where each holds its own
        (interleaved data, an MLLM's shards); None: the model's images_per_sequence."""
        return self.dataset.images_mean(self.step_samples(step)) if isinstance(self.dataset, InterleavedMLLM) else None

    def make(self, step: int) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
        """Units that read the same samples (two towers) share one collated batch."""
        made: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        rows: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        means = self.dataset.step_means(self.step_samples(step)) if isinstance(self.dataset, InterleavedMLLM) else {}
        order = self.order_of(step)
        for unit, (layout, replica) in self.reads.items():
            for microbatch in range(layout.microbatches):
                first = layout.first_sample(replica, microbatch)
                positions = range(first, first + layout.micro_batch)
                key = tuple(step * self.global_batch + (p if order is None else order[p]) for p in positions)
                if key not in rows:
                    rows[key] = collate([self.dataset[i] for i in key]) | {name: m.repeat(len(key)) for name, m in means.items()}
                made[(unit, microbatch)] = unit_fields(self.model, unit, rows[key], self.shares.get(unit))
        return made

    def skipped(self) -> set[str]:
        return skipped_members(self.dataset)


class Batches:
    """The step's micro-batches on the trainer's device, made here (inline) or taken from
    a producer process that made them ahead (disaggregated). `wait_s`: how long the last
    start_step kept the trainer waiting for them."""

    def __init__(self, samples: StepSamples, device: torch.device = torch.device("cpu"), producer: Producer | None = None) -> None:
        self.samples, self.device, self.producer = samples, device, producer
        self.wait_s = 0.0
        self._cache: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def start_step(self, step: int) -> None:
        """Make every micro-batch of the step before its timed window opens."""
        begin = time.perf_counter()
        made = self.samples.make(step) if self.producer is None else self.producer.get(step)
        self._cache = {key: {name: t.to(self.device) for name, t in fields.items()} for key, fields in made.items()}
        self.wait_s = time.perf_counter() - begin

    @property
    def skipped(self) -> set[str]:
        """The bad shard members this trainer's batches left out (backend.data_errors=skip)."""
        return skipped_members(self.samples.dataset) | (self.producer.skipped if self.producer is not None else set())

    def __call__(self, unit: str, microbatch: int) -> dict[str, torch.Tensor]:
        return self._cache[(unit, microbatch)]
