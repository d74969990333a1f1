"""Progress lines on stderr: a heartbeat covers work without lines of its own, and keeps
quiet while progress lines come."""

from __future__ import annotations

import re
import time

import pytest

from src import progress
from src.progress import Progress, heartbeat


def test_a_heartbeat_speaks_when_nothing_else_does(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress, "FIRST_BEAT_S", 0.3)
    monkeypatch.setattr(progress, "BEAT_EVERY_S", 10.0)
    with heartbeat("planning x"):
        time.sleep(0.8)
    assert re.fullmatch(r"planning x \[\d s\]: still working\n", capsys.readouterr().err)
    with heartbeat("planning y"):
        pass
    assert capsys.readouterr().err == ""  # quick work: nothing


def test_progress_lines_keep_the_heartbeat_quiet(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress, "FIRST_BEAT_S", 0.5)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    with heartbeat("planning z"):
        task = Progress("search")
        for _ in range(8):
            time.sleep(0.1)
            task.show("working")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 8 and all(line.startswith("search [") for line in lines)
