"""Progress lines on stderr and in the `progress` logger (run.log): a heartbeat covers work
without lines of its own and keeps quiet while progress lines come; a task's first line
is due by the time it ran on a CPU or waited on something else, never by its time in a
busy machine's run queue, so that a slow machine prints no line ahead of a refusal; work
past every check speaks by wall time."""

from __future__ import annotations

import logging
import re
import time

import pytest

from src import progress
from src.progress import Progress, doing, heartbeat


def _burn(seconds: float) -> None:
    """Use `seconds` of this process's CPU."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_heartbeat_speaks_once_its_work_used_the_cpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress, "FIRST_CPU_S", 0.2)
    with heartbeat("planning x"):
        _burn(0.6)
    assert re.fullmatch(r"planning x \[\d s\]: still working\n", capsys.readouterr().err)
    with heartbeat("planning y"):
        pass
    assert capsys.readouterr().err == ""  # quick work: nothing


def test_waiting_for_a_cpu_counts_for_nothing_waiting_on_anything_else_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loaded machine stretches wall time in its run queue: no line for that. Work that
    waits on something else (here a sleep: a lock, a child, a disk) speaks after
    FIRST_WAIT_S."""
    monkeypatch.setattr(progress, "FIRST_WAIT_S", 0.3)
    start = time.perf_counter()
    with monkeypatch.context() as loaded:
        loaded.setattr(progress, "scheduled", lambda: (0.0, time.perf_counter() - start))  # all of it in the run queue
        with heartbeat("planning x"):
            time.sleep(0.8)
    assert capsys.readouterr().err == ""
    with heartbeat("planning x"):
        time.sleep(0.8)
    assert re.fullmatch(r"planning x \[\d s\]: still working\n", capsys.readouterr().err)


def test_progress_lines_keep_the_heartbeat_quiet(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress, "FIRST_CPU_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    with heartbeat("planning z"):
        task = Progress("search")
        for _ in range(8):
            time.sleep(0.1)
            task.show("working")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 8 and all(line.startswith("search [") for line in lines)


def test_a_task_is_due_by_its_cpu_and_work_past_the_checks_by_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "EVERY_S", 0.1)
    monkeypatch.setattr(progress, "CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "FIRST_CPU_S", 0.3)
    monkeypatch.setattr(progress, "FIRST_WAIT_S", 60.0)
    checked, started = Progress("search"), Progress("starting workers", at_once=True)
    time.sleep(0.2)
    assert not checked.due() and started.due()
    _burn(0.4)
    assert checked.due()


def test_a_run_of_short_tasks_speaks_once_it_worked_long_enough_without_a_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Planning then simulating, each under FIRST_CPU_S: the second speaks once the run has
    worked FIRST_CPU_S since it began (or since its last line); outside a run, tasks keep
    their own clocks."""
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    monkeypatch.setattr(progress, "CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "FIRST_CPU_S", 0.3)
    monkeypatch.setattr(progress, "FIRST_WAIT_S", 60.0)

    def two_tasks() -> bool:
        _burn(0.2)  # planning
        simulation = Progress("simulation")
        _burn(0.2)
        return simulation.due()

    assert not two_tasks()
    with progress.run_clock():
        assert two_tasks()
        progress.say("simulation: a line")  # the run's quiet starts over
        assert not Progress("writing").due()
    assert not two_tasks()


def test_every_line_goes_to_the_progress_logger_and_says_what_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress, "AT_ONCE_FIRST_S", 0.2)
    caplog.set_level(logging.INFO, logger="progress")
    assert doing() is None
    with heartbeat("building the op", at_once=True, detail=lambda: "compiling shm.cpp"):
        with heartbeat("an inner task"):
            assert doing() == "an inner task"
        assert doing() == "building the op"
        time.sleep(0.6)
    assert doing() is None
    assert [r.getMessage() for r in caplog.records if r.name == "progress"] == ["building the op [0 s]: compiling shm.cpp"]
