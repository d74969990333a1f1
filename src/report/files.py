"""The run directory's records: metrics.jsonl (one line per step, then the summary) and
summary.json (the final figures; its presence means the run succeeded).

A record that cannot be written (a full disk, an unwritable directory) is a WriteError:
one line naming the path and the errno, which the front door prints (exit 2)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
ERROR_FILE = "error.txt"  # a failed or killed run's one-line reason


class WriteError(OSError):
    """A file of the run could not be written; the message names it and the errno."""


def write_failure(err: OSError, path: Path | str | None = None) -> str:
    """'cannot write PATH: No space left on device (errno 28, ENOSPC)'."""
    name = errno.errorcode.get(err.errno, "?") if err.errno is not None else "?"
    return f"cannot write {err.filename or path}: {err.strerror or err} (errno {err.errno}, {name})"


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Writes to `path` inside fail as one WriteError."""
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        raise WriteError(write_failure(err, path)) from None


class RunLogHandler(logging.FileHandler):
    """run.log's handler. A line that cannot be written is dropped without the traceback
    logging prints by default: the run's own records, written at every step, report a full
    disk in one line."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


class RunFiles:
    def __init__(self, run_dir: Path) -> None:
        self.metrics_path = Path(run_dir) / METRICS_FILE
        self.summary_path = Path(run_dir) / SUMMARY_FILE
        # A reused run dir (hydra.run.dir=...) must not keep an earlier run's results: an
        # old summary.json would claim this run succeeded even if it fails, and old step
        # lines would mix with new ones.
        with writing(self.metrics_path):
            self.summary_path.unlink(missing_ok=True)
            self.metrics_path.write_text("")

    def log_step(self, record: Mapping[str, Any]) -> None:
        self._append({"type": "step", **record})

    def finish(self, summary: Mapping[str, Any]) -> None:
        """The summary line of metrics.jsonl, then summary.json, atomically and last, so
        that a run that fails before this point never leaves a summary.json behind."""
        self._append({"type": "summary", **summary})
        # Sorted keys and no timestamps: the same run gives a byte-identical file.
        text = json.dumps(summary, indent=2, sort_keys=True) + "\n"
        tmp = self.summary_path.with_name(f".{SUMMARY_FILE}.tmp")
        try:
            with writing(tmp), open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())  # the rename must not publish a file still in cache only
            with writing(self.summary_path):
                os.replace(tmp, self.summary_path)
        finally:
            tmp.unlink(missing_ok=True)

    def _append(self, line: Mapping[str, Any]) -> None:
        # Opened per line: each record is on disk as soon as it is logged (a crashed run
        # keeps its steps) and no handle outlives the run. Unbuffered: a line the disk
        # refused is cut off again (a truncation needs no space) and nothing of it is left
        # to a buffer's flush on close, so that the lines before it stay readable.
        data = memoryview((json.dumps(line) + "\n").encode())
        with writing(self.metrics_path), open(self.metrics_path, "ab", buffering=0) as f:
            whole = f.tell()
            try:
                while data:
                    data = data[f.write(data) :]
            except OSError:
                with contextlib.suppress(OSError):  # not a file that truncates (a device): the error stands
                    os.truncate(self.metrics_path, whole)
                raise
