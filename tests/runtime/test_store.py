"""The payload store sums a gradient's pieces that land on the same rows, as the chain rule
sums the gradients of a tensor used several times, and refuses a value's rows twice."""

from __future__ import annotations

import pytest
import torch

from src.errors import ConfigError
from src.program import Payload
from src.runtime.store import PayloadStore

FEATURE = Payload("vision", 4, 0, "feature")


def test_pieces_of_a_gradient_on_the_same_rows_add_up() -> None:
    a, b, c = (torch.randn(4, 3) for _ in range(3))
    store = PayloadStore()
    store.put(FEATURE.gradient(), a)
    store.put(FEATURE.gradient(), b)
    store.put(FEATURE.gradient().part(1, 3), c[1:3])  # a piece of some rows only
    start, total = store.read(FEATURE.gradient())
    expected = a + b
    expected[1:3] += c[1:3]
    assert start == 0 and torch.allclose(total, expected)
    whole = PayloadStore()
    whole.put(FEATURE.gradient(), a)
    whole.put(FEATURE.gradient(), b)
    assert torch.equal(whole.tensor(FEATURE.gradient()), a + b)


def test_a_sum_keeps_the_first_pieces_precision() -> None:
    store = PayloadStore()
    store.put(FEATURE.gradient(), torch.ones(2, 3, dtype=torch.bfloat16))
    store.put(FEATURE.gradient(), torch.full((2, 3), 0.5))
    total = store.tensor(FEATURE.gradient())
    assert total.dtype == torch.bfloat16 and torch.equal(total, torch.full((2, 3), 1.5, dtype=torch.bfloat16))


def test_a_values_rows_arriving_twice_are_refused() -> None:
    store = PayloadStore()
    store.put(FEATURE.part(0, 2), torch.zeros(2, 3))
    store.put(FEATURE.part(1, 3), torch.zeros(2, 3))
    with pytest.raises(ConfigError, match="rows arrived twice"):
        store.read(FEATURE)
