"""When the disk says no: a write that fails (a full disk or quota, a read-only or failing
file system, a file past `ulimit -f`) is one line naming the file and the error, and the
run is still marked failed in its error.txt.

The file: an OSError raised by open() names it; one raised by a write or a close (the
disk filled up after the file was opened) does not, and the file object being written is
found in the frames the error passed through, innermost first (pathlib's write_text,
json.dump's fp, shutil's copy, our own writers alike).

error.txt on a full disk: every run directory holds a few KiB of reserved room from its
start (`reserve`), given back just before error.txt is written (`write_error_file`) and
removed when the run succeeds (`release`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
from pathlib import Path

from src.report.files import ERROR_FILE, write_failure

# The errors of a write the user fixes by freeing, fixing or choosing storage.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO})
RESERVE_FILE = ".error.reserve"
RESERVE_BYTES = 16 * 1024  # error.txt, the door's error line in run.log, a rank's error line


def is_write_failure(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in WRITE_ERRNOS


def failed_file(err: OSError) -> str | None:
    """The file a failed write was writing: the error's own filename, else the innermost
    file object opened for writing among the locals of the frames it passed through."""
    if err.filename is not None:
        return str(err.filename)
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            name, mode = getattr(value, "name", None), getattr(value, "mode", "")
            # Closed by now, most likely (a `with` block's exit): its name and mode remain.
            if isinstance(value, io.IOBase) and isinstance(name, str) and isinstance(mode, str) and set(mode) & set("wax+"):
                return name
    return None


def describe(err: OSError, where: Path | str | None = None) -> str:
    """'cannot write PATH: No space left on device (errno 28, ENOSPC)'; `where` (a run
    directory) stands in for a file nothing names."""
    path = failed_file(err)
    if path is None:
        path = f"a file in {where}" if where is not None else "a file it did not name"
    return write_failure(err, path)


def reserve(run_dir: Path) -> None:
    """Room for error.txt, taken at the run's start (OSError if the disk is full already)."""
    path = Path(run_dir) / RESERVE_FILE
    with open(path, "wb") as file:
        file.write(bytes(RESERVE_BYTES))
        file.flush()
        os.fsync(file.fileno())  # blocks allocated now, not at a write-back that may fail


def release(run_dir: Path) -> None:
    """The run succeeded: no error.txt to make room for."""
    with contextlib.suppress(OSError):
        (Path(run_dir) / RESERVE_FILE).unlink(missing_ok=True)


def write_error_file(run_dir: Path, line: str) -> bool:
    """The run's error.txt holds `line`, written in the room reserved for it; False (and no
    empty error.txt) where even that fails."""
    path = Path(run_dir) / ERROR_FILE
    release(run_dir)
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n")
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)  # an empty one would say nothing
        return False
    return True
