"""A worker's error line (runtime.worker, runtime.lifeline, runtime.driver): a write the disk
refused is a WriteError naming its file (exit 2), the first one where closing files on the
way out failed again; the line reaches the driver through the heartbeat board, which needs
no disk space; the driver names the earliest line, a rank killed by a signal first."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from src.report.files import WriteError
from src.runtime.driver import _first_failure
from src.runtime.errors import WorkerFailure
from src.runtime.lifeline import Board, Lifeline
from src.runtime.worker import error_line


def _raised(make) -> BaseException:
    try:
        make()
    except BaseException as err:  # noqa: BLE001 - the error under test, whatever it is
        return err
    raise AssertionError("nothing raised")


def test_a_refused_write_anywhere_is_a_write_error_naming_its_file() -> None:
    def torch_like() -> None:  # a library's writer turning the OSError into its own error
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/a/checkpoint/step2/ranks/rank1.pt")
        except OSError:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from None

    line = error_line(1, _raised(torch_like))
    path = "/runs/a/checkpoint/step2/ranks/rank1.pt"
    assert line == f"rank 1: WriteError: cannot write {path}: No space left on device (errno 28, ENOSPC)"
    assert WorkerFailure(line).exit_code == 2
    assert error_line(0, OSError(errno.EROFS, "Read-only file system", "/runs/a/x")).endswith("(errno 30, EROFS)")
    assert WorkerFailure(error_line(0, RuntimeError("Connection closed by peer"))).exit_code == 1


def test_the_first_refused_write_is_named_not_the_close_that_failed_after_it() -> None:
    def closing_after() -> None:
        try:
            raise WriteError("cannot write /runs/a/metrics.jsonl: No space left on device (errno 28, ENOSPC)")
        finally:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/a/run.log")

    assert error_line(0, _raised(closing_after)) == (
        "rank 0: WriteError: cannot write /runs/a/metrics.jsonl: No space left on device (errno 28, ENOSPC)"
    )


def test_error_lines_reach_the_driver_through_the_board(tmp_path: Path) -> None:
    board = Board(tmp_path / ".lifeline", 3)
    try:
        lines = {}
        for rank in (2, 0):  # rank 2 fails first, rank 0 on its closed connection after it
            lifeline = Lifeline()
            lifeline.attach(board.path, rank, os.getpid())
            lines[rank] = f"rank {rank}: {'DataError: bad shard' if rank == 2 else 'RuntimeError: Connection closed by peer'}"
            lifeline.failed(lines[rank])
            time.sleep(0.01)
        assert board.error_line(1) is None
        assert board.error_line(2)[1] == lines[2]
        assert _first_failure([tmp_path], board, [1, None, 1]) == lines[2]
        # A rank killed by a signal wrote nothing: it comes first, its peers failed on it.
        assert _first_failure([tmp_path], board, [1, -9, 1]) == "rank 1: worker killed by signal SIGKILL (exit code -9)"
    finally:
        board.close()
