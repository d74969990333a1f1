"""Random real-backend command lines (src.fuzz --backend torch), a fixed seed, through the
front door's steps up to its workers' start, none started: each is runnable or refused in
one line, none raises anything else. `python -m src.fuzz --backend torch --draws 2000` runs
thousands."""

from __future__ import annotations

import pytest

import src.fuzz
from src.fuzz import FAILED, fuzz
from tests import composing


def test_random_real_backend_command_lines_are_runnable_or_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(src.fuzz, "composed", composing.composed)  # as tests/test_fuzz.py: the same draws, faster
    outcomes = fuzz(24, seed=2, limit_s=60.0, backend="torch")
    bad = [f"[{o.status}] python -m src.run {' '.join(o.overrides)}\n{o.detail}" for o in outcomes if o.status in FAILED]
    assert not bad, "\n\n".join(bad)
    assert {"ok", "refused"} <= {o.status for o in outcomes}
    assert all("backend=torch" in o.overrides for o in outcomes)
