"""What ties a worker to the local driver that started it: a heartbeat the driver watches,
and a watch on the front door, so that no worker outlives it.

The board: a small file of one slot per rank that the driver creates and every worker
maps (mmap). A thread of the worker writes the time into its slot every BEAT_S whatever
the worker does (a collective waiting for a peer included), and the worker writes where
it is as it goes: its run, its step and the instruction it runs (the executor, per
instruction: one store into the mapped slot). A rank whose beat stops (a stopped process,
SIGSTOP or a debugger; a process hung with the interpreter's lock held) is named by the
driver with its last instruction, within backend.timeout_s, before any peer's collective
times out (runtime.driver). A failing worker writes its error line into the board too
(`failed`): the board's pages were allocated when the driver made it, so the line reaches
the driver on a full disk, where no file can be written.

The same thread watches the front door's process through a pidfd (which no later process
reusing the pid can answer for): when the door dies (SIGKILL, a crash), the worker writes
the run's error.txt, unless the run had written its results, and kills its own process
group (itself and its preprocessing producer) at once, so it neither trains on nor writes
a summary into a run nobody waits for. The forkserver the workers were forked from dies
with the door by a parent-death signal (`die_with_parent`). Workers under torchrun or srun have neither a board
nor a door to watch: their launcher tears them down.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from src.report.files import writing
from src.write_failures import write_error_file

PR_SET_PDEATHSIG = 1  # prctl(2)
BOARD_ENV = "MMDIST_BOARD"  # the board's path, set by the driver
DOOR_ENV = "MMDIST_DOOR_PID"  # the front door's pid, set by the driver
BEAT_S = 0.5
SLOT_WORDS = 8  # int64 words per rank: a 64-byte slot
BEAT, STATE, RUN, STEP, INSTRUCTION, FAILED = range(6)  # word offsets in a slot (FAILED: when its error line was written)
LINE_BYTES = 1024  # each rank's error line, after all the slots
# What a rank is doing (STATE): its step and instruction mean something while TRAINING.
IDLE, STARTING, TRAINING, SAVING, REPORTING, DONE = range(6)
DOING = {STARTING: "starting", REPORTING: "writing its results", DONE: "leaving"}
# INSTRUCTION outside the instruction list: a step's batch and barrier; its loss and timing all-reduces.
BEFORE_INSTRUCTIONS, AFTER_INSTRUCTIONS = -1, -2


@dataclass(frozen=True)
class Beat:
    """One rank's slot as the driver reads it."""

    time_ns: int  # time.monotonic_ns() of its last beat (0: none yet)
    state: int
    run: int  # index of the run directory it is on
    step: int
    instruction: int  # index in its rank class's instruction list, or BEFORE/AFTER_INSTRUCTIONS

    def doing(self) -> str:
        """'in step 3, at instruction 12', or what it does outside a step."""
        if self.state == TRAINING:
            where = {BEFORE_INSTRUCTIONS: "before its first instruction", AFTER_INSTRUCTIONS: "after its last instruction"}
            return f"in step {self.step}, {where.get(self.instruction, f'at instruction {self.instruction}')}"
        if self.state == SAVING:
            return f"saving the checkpoint of {self.step} steps"
        return DOING.get(self.state, "not started")


class Board:
    """The driver's side: the file the workers' slots live in."""

    def __init__(self, path: Path, world: int) -> None:
        self.path, self.world = path, world
        with writing(path):
            path.write_bytes(bytes(world * (SLOT_WORDS * 8 + LINE_BYTES)))
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        self._words = memoryview(self._map).cast("q")

    def read(self, rank: int) -> Beat:
        base = rank * SLOT_WORDS
        return Beat(*(int(self._words[base + i]) for i in range(INSTRUCTION + 1)))

    def error_line(self, rank: int) -> tuple[int, str] | None:
        """(when, the line) of the error `rank` wrote, if it wrote one."""
        when = int(self._words[rank * SLOT_WORDS + FAILED])
        if not when:
            return None
        start = self.world * SLOT_WORDS * 8 + rank * LINE_BYTES
        return when, bytes(self._map[start : start + LINE_BYTES]).rstrip(b"\0").decode(errors="replace")

    def close(self) -> None:
        self._words.release()
        self._map.close()
        self.path.unlink(missing_ok=True)


class Lifeline:
    """The worker's side. Until `attach`, its slot is a private buffer: under a launcher
    the same stores cost the same and go nowhere."""

    def __init__(self) -> None:
        self._words = memoryview(bytearray(SLOT_WORDS * 8)).cast("q")
        self.attached = False
        self.rank = -1
        self.run_dir: Path | None = None
        self._finished = False  # the current run's results are written: the door's death no longer fails it
        self._writing = threading.Lock()

    def attach(self, board: Path, rank: int, door_pid: int) -> None:
        """Map this rank's slot, then beat and watch the door from a daemon thread."""
        self._board = board
        with open(board, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        world = len(self._map) // (SLOT_WORDS * 8 + LINE_BYTES)
        self._words = memoryview(self._map).cast("q")[rank * SLOT_WORDS : (rank + 1) * SLOT_WORDS]
        self._line = world * SLOT_WORDS * 8 + rank * LINE_BYTES
        self.attached, self.rank = True, rank
        self.state(STARTING)
        self._words[BEAT] = time.monotonic_ns()
        threading.Thread(target=self._watch, args=(door_pid,), name="mmdist-lifeline", daemon=True).start()

    # ---- where the worker is (cheap: stores into the mapped slot) ------------------------
    def state(self, state: int) -> None:
        self._words[STATE] = state

    def start_run(self, index: int, run_dir: Path) -> None:
        self.run_dir, self._finished = run_dir, False
        self._words[RUN] = index
        self.state(STARTING)

    def at_step(self, step: int, state: int = TRAINING) -> None:
        self._words[STEP] = step
        self._words[INSTRUCTION] = BEFORE_INSTRUCTIONS
        self._words[STATE] = state

    def at_instruction(self, index: int) -> None:
        self._words[INSTRUCTION] = index

    def after_instructions(self) -> None:
        self._words[INSTRUCTION] = AFTER_INSTRUCTIONS

    def writing_results(self) -> threading.Lock:
        """Held by rank 0 while it writes the run's results, `finished()` inside: a door that
        dies meanwhile finds the run complete and leaves it so."""
        return self._writing

    def finished(self) -> None:
        self._finished = True

    def failed(self, line: str) -> None:
        """This rank's error line, for the driver (attached only; no disk space needed)."""
        if not self.attached:
            return
        data = line.encode()[: LINE_BYTES - 1]
        self._map[self._line : self._line + len(data)] = data
        self._words[FAILED] = time.monotonic_ns()  # last: the line is whole once this is set

    # ---- the thread -------------------------------------------------------------------
    def _watch(self, door_pid: int) -> None:
        door = _pidfd(door_pid)
        while True:
            self._words[BEAT] = time.monotonic_ns()
            if door is not None:
                if select.select([door], [], [], BEAT_S)[0]:
                    break
            else:
                time.sleep(BEAT_S)
                if not _alive(door_pid):
                    break
        self._door_died(door_pid)

    def _door_died(self, door_pid: int) -> None:
        """Rank 0, which writes the run's results, says why there are none; every rank
        leaves at once."""
        with self._writing:
            if self.rank == 0 and not self._finished and self.run_dir is not None:
                beat = Beat(0, *(int(self._words[i]) for i in range(STATE, INSTRUCTION + 1)))
                line = f"the front door (pid {door_pid}) died while rank 0 was {beat.doing()}"
                write_error_file(self.run_dir, f"{line}: workers stopped, no results written")
                with contextlib.suppress(OSError):
                    self._board.unlink(missing_ok=True)  # the door's to remove, had it lived
        # This worker leads its own session (runtime.driver): its group is it and what it started.
        os.killpg(os.getpgrp(), signal.SIGKILL) if os.getpgrp() == os.getpid() else os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere nothing).
    For the local driver's forkserver (runtime.preload), which holds nothing to clean up:
    on its own it leaves only when the door's end of a pipe closes, and then tears down
    torch's and DeepSpeed's modules for seconds (3 s measured on a loaded 2-core host)."""
    parent = os.getppid()
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux 5.3+), None elsewhere."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


LIFELINE = Lifeline()


def attach_from_env(rank: int) -> None:
    """Under the local driver (its environment names the board and the door), attach."""
    board, door = os.environ.get(BOARD_ENV), os.environ.get(DOOR_ENV)
    if board and door:
        LIFELINE.attach(Path(board), rank, int(door))
