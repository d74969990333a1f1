"""A unit's cut of the step's batch (src/batch_layout.py): its micro-batches tile the batch,
a sample group holds the same samples whatever the replicas and micro-batches, and a batch
that does not divide is refused with its numbers."""

from __future__ import annotations

import pytest

from src.batch_layout import BatchLayout
from src.errors import ConfigError

LAYOUTS = [(24, 1, 24, None), (24, 2, 3, None), (24, 2, 3, 2), (24, 4, 1, 6), (24, 3, 2, 1), (36, 6, 2, 3)]


@pytest.mark.parametrize(("global_batch", "dp", "micro_batch", "groups"), LAYOUTS)
def test_the_micro_batches_tile_the_batch_and_keep_each_group_contiguous(global_batch, dp, micro_batch, groups) -> None:
    layout = BatchLayout(global_batch, dp, micro_batch, groups)
    per_group = layout.microbatches // layout.sample_groups
    span = global_batch // layout.sample_groups
    taken = []
    for replica in range(dp):
        for microbatch in range(layout.microbatches):
            first = layout.first_sample(replica, microbatch)
            group = microbatch // per_group
            assert group * span <= first and first + micro_batch <= (group + 1) * span
            taken += range(first, first + micro_batch)
    assert sorted(taken) == list(range(global_batch))


def test_the_counts_it_derives() -> None:
    layout = BatchLayout(24, dp=2, micro_batch=3, groups=2)
    assert (layout.per_replica, layout.microbatches, layout.sample_groups) == (12, 4, 2)
    # Replica 1 takes the second half of each group of 12: micro-batches 0 and 2 open them.
    assert [layout.first_sample(1, j) for j in range(4)] == [6, 9, 18, 21]
    # One group per micro-batch index: each index takes dp x micro-batch samples in turn.
    assert [BatchLayout(24, 2, 3).first_sample(1, j) for j in range(4)] == [3, 9, 15, 21]


def test_a_batch_that_does_not_divide_is_refused_with_its_numbers() -> None:
    with pytest.raises(ConfigError, match=r"^global batch 6 is not divisible by dp=4$"):
        BatchLayout(6, 4)
    with pytest.raises(ConfigError, match=r"^global batch 12 is not divisible by dp x micro-batch = 2 x 4 = 8$"):
        BatchLayout(12, 2, 4)
    with pytest.raises(ConfigError, match=r"3 micro-batches per replica .* do not split into 2 sample groups$"):
        BatchLayout(12, 2, 2, groups=2)
