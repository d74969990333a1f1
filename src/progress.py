"""Progress of long work (plan searches, simulations of big Programs) on stderr.

Lines, not redrawn bars: runs land in log files, Slurm outputs and Hydra multiruns as
often as on a terminal, where a carriage-return bar turns into one unreadable line. A
task that finishes within a second prints nothing.

A loop that knows its progress says it through Progress. Whatever work has no such line
(a planner's phase between two of its lines, a model being built) is covered by a
heartbeat around it: a line whenever no progress line came for a while, so that no run
stays silent past a few seconds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

EVERY_S = 1.0
FIRST_BEAT_S = 3.0  # a run longer than a few seconds says it is working
BEAT_EVERY_S = 15.0  # and says it again after so long without a progress line
_last_line = [0.0]  # when any progress line was last printed (perf_counter)


@dataclass
class Progress:
    """`due()` says whether a line is wanted now (at most one per second, none in the first
    second); `show()` prints it; `end()` prints a last line only if any was shown."""

    task: str
    start: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    shown: bool = False

    def __post_init__(self) -> None:
        self.last = self.start

    def due(self) -> bool:
        return time.perf_counter() - self.last >= EVERY_S

    def show(self, text: str) -> None:
        now = time.perf_counter()
        self.last, self.shown = now, True
        _say(f"{self.task} [{now - self.start:.0f} s]: {text}", now)

    def end(self, text: str) -> None:
        if self.shown:
            self.show(text)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start


def _say(line: str, now: float) -> None:
    _last_line[0] = now
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def heartbeat(task: str) -> Iterator[None]:
    """Around work that may take long without a progress line of its own: after
    FIRST_BEAT_S, and then whenever BEAT_EVERY_S pass without any progress line, print
    '<task> [N s]: still working'."""
    start = time.perf_counter()
    done = threading.Event()

    def beat() -> None:
        quiet = FIRST_BEAT_S
        while not done.wait(0.25):
            now = time.perf_counter()
            if now - max(start, _last_line[0]) >= quiet:
                _say(f"{task} [{now - start:.0f} s]: still working", now)
                quiet = BEAT_EVERY_S

    thread = threading.Thread(target=beat, name="progress-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
