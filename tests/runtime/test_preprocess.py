"""Disaggregated preprocessing: a producer process makes exactly the batches the trainer
would make itself, in the plan's sample order, and a failure in it is the trainer's."""

from __future__ import annotations

import pytest
import torch

from src.models.registry import build_model
from src.batch_layout import BatchLayout
from src.runtime.inputs import Batches, StepSamples, dataset_for
from src.runtime.preprocess import Producer


def _samples(dataset=None) -> StepSamples:
    model = build_model({"name": "clip", "scale": "tiny"})
    two = BatchLayout(8, dp=2, micro_batch=2, groups=1)
    reads = {"vision": (two, 1), "text": (two, 1)}
    order = (7, 6, 5, 4, 3, 2, 1, 0)
    return StepSamples(model, dataset or dataset_for(model, 0, "synthetic"), 8, reads, order)


class _Unreadable:
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        raise OSError(f"sample {index} is not an image")


@pytest.mark.slow
def test_a_producer_makes_the_trainers_batches_ahead():
    samples = _samples()
    producer = Producer(samples, steps=range(3), depth=1, timeout_s=60, rank=0)
    try:
        batches = Batches(samples, producer=producer)
        for step in range(3):
            batches.start_step(step)
            for (unit, microbatch), fields in samples.make(step).items():
                made = batches(unit, microbatch)
                assert made.keys() == fields.keys()
                assert all(torch.equal(made[name], fields[name]) for name in fields)
    finally:
        producer.close()
    assert producer.process.exitcode == 0


@pytest.mark.slow
def test_a_failing_producer_raises_its_error_in_the_trainer():
    producer = Producer(_samples(_Unreadable()), steps=range(2), depth=1, timeout_s=60, rank=3)
    try:
        with pytest.raises(OSError, match="sample 3 is not an image"):
            producer.get(0)  # replica 1 reads positions 4-7 first: sample 3 in this order
    finally:
        producer.close()
