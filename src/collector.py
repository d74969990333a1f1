"""Python's cyclic garbage collector paused while a phase builds or walks a graph of
long-lived objects.

A planner's stages and Programs, and the simulator's events over them, are millions of
objects that live until the phase ends and hold next to no reference cycles (reference
counting frees them). Each full collection walks them all again: with it running, the
simulation of Optimus's 290k-instruction frontier Program took 3.2-3.5 s CPU, paused 1.9 s,
at the same peak memory.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside (and in the processes forked there), as it was after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
