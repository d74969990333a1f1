"""Random command lines over the whole config space (src.fuzz), through Hydra's parser as the
front door reads them, a fixed seed: each ends in a one-line refusal with no progress line
ahead of it, or in a summary that keeps every promise (0 < MFU <= 1, a breakdown that adds
up, a plan that fits memory); none raises anything else, none stays silent past the limit
or works past src.fuzz.SAY_AFTER_S of CPU without a progress line.
`python -m src.fuzz --draws 5000` runs thousands of draws."""

from __future__ import annotations

import pytest

import src.fuzz
from src.config import composed
from src.fuzz import FAILED, check, fuzz
from tests import composing

LIMIT_S = 60.0


# A refusal costs about a quarter of a second, a plan up to seconds (the fourth draw, DistTrain
# on 9B, five): the quick tier takes the first 4 of the 30, which reach both ends
# (`python -m src.fuzz` runs thousands; the suite keeps to its 10 minutes: 60 draws took 45 s
# of a 715 s suite on a loaded 2-core machine).
@pytest.mark.parametrize("draws", [4, pytest.param(30, marks=pytest.mark.slow)])
def test_random_command_lines_are_answered(draws: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A draw picks its knobs from the config its model, strategy and cluster compose to,
    # which src.fuzz asks Hydra for (a third of the draws' time); the tests' composer gives
    # the same config (tests/test_configs.py), so the same command lines are drawn, and each
    # still goes through the front door's own Hydra composition.
    monkeypatch.setattr(src.fuzz, "composed", composing.composed)
    outcomes = fuzz(draws, seed=2026, limit_s=LIMIT_S)
    bad = [f"[{o.status}] python -m src.run {' '.join(o.overrides)}\n{o.detail}" for o in outcomes if o.status in FAILED]
    assert not bad, "\n\n".join(bad)
    # The draws reach both ends: plans that run and inputs that are refused.
    assert {"ok", "refused"} <= {o.status for o in outcomes}


def test_a_summary_over_a_tiny_device_s_memory_names_both_sizes() -> None:
    """A tiny model's peak memory over a tiny device's is told in significant digits, not 0.0 GiB."""
    config = composed(["cluster=local", "cluster.memory_gib=0.0055", "cluster.reserved_memory_gib=0"])
    summary = {"mfu": 0.5, "breakdown_s": {"compute": 1.0}, "iteration_time_s": 1.0, "peak_memory_gib": 0.00725}
    assert check(summary, config) == "peak memory 0.00725 GiB > usable 0.0055 GiB"
    assert check(summary | {"peak_memory_gib": 0.005}, config) == ""
