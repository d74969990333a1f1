"""Progress of long work (plan searches, simulations of big Programs, a real run's start)
on stderr, and in the run's run.log.

Lines, not redrawn bars: runs land in log files, Slurm outputs and Hydra multiruns as
often as on a terminal, where a carriage-return bar turns into one unreadable line. Every
line also goes to the `progress` logger, which the front door's logging config
(conf/hydra/job_logging) writes to run.log.

When the first line of a task is due: once its process's main thread has run FIRST_CPU_S
on a CPU, or has waited FIRST_WAIT_S on something other than a CPU (a lock, a child
process, a disk), since the task began, or since the run it belongs to last said anything
(`run_clock`: a run of several short tasks, planning then simulating, is not silent for
longer than one long task). Time spent waiting for a CPU on a busy machine counts for neither (the
kernel's scheduler statistics tell it apart, on Linux), because a refusal of bad input is
one line on any machine: the checks ahead of a refusal run well under FIRST_CPU_S, however
much a loaded machine stretches their wall time. Work that follows every check (a real
run's imports, DeepSpeed's op build, the workers' start) speaks by wall time from its
start (`at_once`): nothing it does is a refusal, and a person waits on its wall time.

A loop that knows its progress says it through Progress. Whatever work has no such line
(a planner's phase between two of its lines, a model being built) is covered by a
heartbeat around it, which also names what the process is doing (`doing()`: the front
door's line when a signal ends the run).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

EVERY_S = 1.0  # at most one line a second from a task
FIRST_CPU_S = 5.0  # a task speaks once it has run this long on a CPU
FIRST_WAIT_S = 20.0  # or waited this long on anything but a CPU
CHECK_EVERY_S = 0.25  # how often whether a first line is due is asked of the kernel
SCHEDSTAT = Path("/proc/self/schedstat")  # the main thread's ns on a CPU, ns waiting for one, timeslices
AT_ONCE_FIRST_S = 3.0  # work past every check speaks after this long
BEAT_EVERY_S = 15.0  # a heartbeat speaks again after so long without a progress line
LOG = logging.getLogger("progress")
_last_line = [0.0]  # when any progress line was last printed (perf_counter)
_quiet: list[Since | None] = [None]  # since when the run has said nothing: its start, then its last line
_doing: list[str] = []  # the heartbeats' tasks, innermost last


@dataclass(frozen=True)
class Since:
    """A task's start: wall time, and its process's main thread's time on and waiting for a CPU."""

    wall: float
    ran: float
    queued: float

    @classmethod
    def now(cls) -> Since:
        return cls(time.perf_counter(), *scheduled())

    def first_due(self, now: float) -> bool:
        """Whether the task has worked (FIRST_CPU_S) or waited (FIRST_WAIT_S) long enough
        for its first line, or its run has without a line: time spent waiting for a CPU
        counts for neither."""
        quiet = _quiet[0]
        return self._worked(now) or (quiet is not None and quiet._worked(now))

    def _worked(self, now: float) -> bool:
        ran, queued = scheduled()
        ran, queued = ran - self.ran, queued - self.queued
        return ran >= FIRST_CPU_S or (now - self.wall) - ran - queued >= FIRST_WAIT_S


def scheduled() -> tuple[float, float]:
    """Seconds the main thread ran on a CPU and waited for one (Linux's scheduler
    statistics); elsewhere, the process's CPU time and none."""
    try:
        ran, queued = SCHEDSTAT.read_text().split()[:2]
        return int(ran) / 1e9, int(queued) / 1e9
    except (OSError, ValueError):
        return time.process_time(), 0.0


@dataclass
class Progress:
    """`due()` says whether a line is wanted now (at most one per EVERY_S, none before the
    task's first line is due); `show()` prints it; `end()` prints a last line only if any
    was shown."""

    task: str
    at_once: bool = False  # speak by wall time from the start (work past every check)
    since: Since = field(default_factory=Since.now)
    last: float = 0.0
    checked: float = 0.0
    shown: bool = False

    def __post_init__(self) -> None:
        self.last = self.checked = self.since.wall

    def due(self) -> bool:
        now = time.perf_counter()
        if now - self.last < EVERY_S:
            return False
        if self.shown or self.at_once:
            return True
        if now - self.checked < CHECK_EVERY_S:
            return False
        self.checked = now
        return self.since.first_due(now)

    def show(self, text: str) -> None:
        now = time.perf_counter()
        self.last, self.shown = now, True
        say(f"{self.task} [{now - self.since.wall:.0f} s]: {text}", now)

    def end(self, text: str) -> None:
        if self.shown:
            self.show(text)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.since.wall


@contextlib.contextmanager
def run_clock() -> Iterator[None]:
    """Around a run's work (the front door's): its tasks' first lines are due also once
    the run has worked, or waited, long enough without any line."""
    _quiet[0] = Since.now()
    try:
        yield
    finally:
        _quiet[0] = None


def say(line: str, now: float | None = None) -> None:
    """A progress line on stderr and to the `progress` logger (run.log)."""
    _last_line[0] = time.perf_counter() if now is None else now
    if _quiet[0] is not None:
        _quiet[0] = Since.now()
    print(line, file=sys.stderr, flush=True)
    LOG.info(line)


def doing() -> str | None:
    """What the innermost running heartbeat covers ('planning megatron for clip on local')."""
    return _doing[-1] if _doing else None


@contextlib.contextmanager
def heartbeat(task: str, at_once: bool = False, detail: Callable[[], str] | None = None) -> Iterator[None]:
    """Around work that may take long without a progress line of its own: once its first
    line is due (`at_once`: after AT_ONCE_FIRST_S) while no other came, and then whenever
    BEAT_EVERY_S pass without any progress line, print '<task> [N s]: <detail()>' ('still
    working' without `detail`)."""
    since = Since.now()
    start = since.wall
    done = threading.Event()

    def beat() -> None:
        while not done.wait(CHECK_EVERY_S):
            now = time.perf_counter()
            if _last_line[0] > start:  # lines came (its own or a task's): quiet while they keep coming
                due = now - _last_line[0] >= BEAT_EVERY_S
            else:
                due = now - start >= AT_ONCE_FIRST_S if at_once else since.first_due(now)
            if due:
                say(f"{task} [{now - start:.0f} s]: {detail() if detail else 'still working'}", now)

    _doing.append(task)
    thread = threading.Thread(target=beat, name="progress-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        _doing.remove(task)
        thread.join()
