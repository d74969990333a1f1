"""A front door's processes and the signals that stop them: the processes below it
(Linux /proc), which a stopped door must not leave behind (its forkserver, its workers in
their own sessions, a compiler it started), and SIGTERM and Ctrl-C made exceptions of its
main thread that end it within STOP_WITHIN_S."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from src.progress import doing
from src.runtime.errors import InterruptSignal, TerminateSignal

STOP_WITHIN_S = 4.0  # after a signal, the door is gone by then, whatever it was doing


def descendants(pid: int | None = None) -> dict[int, list[str]]:
    """pid -> command line of every process below `pid` (this one by default); empty where
    /proc is not there."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name in parentheses may hold spaces: the fields after it are fixed.
            parent = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found: dict[int, list[str]] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            with contextlib.suppress(OSError):
                found[child] = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            todo.append(child)
    return found


def kill_descendants() -> None:
    """SIGKILL every process below this one (a stopped one too). Workers lead sessions of
    their own: a signal to this process group would miss them."""
    for pid in descendants():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def signals_end_the_run() -> Iterator[None]:
    """SIGTERM raises TerminateSignal and SIGINT KeyboardInterrupt in the main thread
    wherever it is, once, after killing every process below this one: a second signal
    changes nothing. The process is gone STOP_WITHIN_S after the first, whatever it was
    doing (a main thread stuck where no Python runs is left to a timer). Elsewhere than in
    the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if received:
            return
        received.append(signum)
        threading.Thread(target=_deadline, args=(128 + signum,), name="mmdist-stop-deadline", daemon=True).start()
        # Now, while they are below this process: a child the exception unwinds through
        # (ninja under torch's builder) is killed on the way, and its children would be
        # orphans out of reach.
        kill_descendants()
        raise TerminateSignal(doing()) if signum == signal.SIGTERM else InterruptSignal(doing())

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _deadline(code: int) -> None:
    threading.Event().wait(STOP_WITHIN_S)
    kill_descendants()
    leave(code)


def leave(code: int) -> None:
    """Exit now, output flushed: without the seconds an interpreter holding torch takes to
    tear itself down (interpreter exit handlers are skipped: call it when nothing is left
    to finish)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    logging.shutdown()
    os._exit(code)
