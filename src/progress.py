"""Progress of long work (plan searches, simulations of big Programs) on stderr.

Lines, not redrawn bars: runs land in log files, Slurm outputs and Hydra multiruns as
often as on a terminal, where a carriage-return bar turns into one unreadable line. A
task that finishes within a second prints nothing.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

EVERY_S = 1.0


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
        print(f"{self.task} [{now - self.start:.0f} s]: {text}", file=sys.stderr, flush=True)

    def end(self, text: str) -> None:
        if self.shown:
            self.show(text)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start
