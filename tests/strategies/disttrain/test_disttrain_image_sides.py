"""DistTrain's plan prices the images the real backend runs, at the sides the sampler draws
(the model's default spread), in the plan's reordered sample order: every encoder
micro-batch's load is its images' encoder work (each image's tokens with its CLS, and
those squared for its attention) against the batch's mean, as the real data path packs
that micro-batch's images for the encoder."""

from __future__ import annotations

import pytest

from src.data.interleaved import encoder_costs, sampler
from src.program import Compute
from src.runtime.placement import placements
from src.setup import plan_run, validate
from tests.composing import composed

pytestmark = pytest.mark.torch  # the real backend's data path


def test_each_encoder_micro_batch_is_priced_for_the_sides_it_packs():
    from src.runtime.inputs import StepSamples, dataset_for, rank_reads

    overrides = ["backend=torch", "cluster=local", "model=mllm_9b", "model.scale=tiny", "model.images_per_sequence=2"]
    s = validate(composed([*overrides, "train.global_batch=8", "strategy=disttrain", "strategy.reorder=both", "logger=none"]))
    plan = plan_run(s)
    encoder = s.model.unit("encoder")
    # The planner's pricing of an image of t tokens: linear * t + quadratic * t^2.
    tokens = encoder.seq_len / s.model.extras["images_per_sequence"]
    quadratic = sum(k.flops() for layer in encoder.layers for k in layer.kernels if k.attention_core) / tokens**2
    linear = sum(k.flops() for layer in encoder.layers for k in layer.kernels if not k.attention_core) / tokens
    layouts = sampler(s.model, s.train.seed).batch(s.train.global_batch)
    mean = sum(sum(encoder_costs(layout, linear, quadratic)) for layout in layouts) / len(layouts)
    data = dataset_for(s.model, s.train.seed, "synthetic", content=plan.sample_content)
    units = {u.unit: u for u in plan.units}
    pairs = []
    for rank in range(plan.devices):
        place = placements(plan, rank).get("encoder")
        if place is None:
            continue
        reads = rank_reads(plan, s.train.global_batch, {"encoder": place.dp_ranks.index(rank)})
        made = StepSamples(s.model, data, s.train.global_batch, reads, plan.sample_order).make(0)
        for c in plan.program.instructions_for(rank):
            if isinstance(c, Compute) and c.work.unit == "encoder" and c.work.phase == "fwd":
                tokens_each = (made[("encoder", c.microbatch)]["patch_sides"] ** 2 + 1).tolist()
                packed = sum(linear * t + quadratic * t * t for t in tokens_each)
                pairs.append((c.work.load, packed / (units["encoder"].micro_batch * mean)))
    assert [priced for priced, _ in pairs] == pytest.approx([packed for _, packed in pairs], rel=1e-9)
    assert len({round(packed, 6) for _, packed in pairs}) > 1  # micro-batches of different work: the equality says something
    sides = {side for layout in layouts for side in layout.image_sides}
    assert len(sides) > 1  # drawn sides, not all nominal
