"""A write the disk refuses (src.write_failures): one line naming the file, whether open()
or a later write failed; a metrics line the disk refused leaves the lines before it
readable; error.txt is written in room reserved at the run's start."""

from __future__ import annotations

import contextlib
import errno
import json
import resource
from pathlib import Path
from typing import Iterator

import pytest

from src.report.files import ERROR_FILE, RunFiles, WriteError
from src.write_failures import RESERVE_BYTES, RESERVE_FILE, describe, release, reserve, write_error_file

FULL = Path("/dev/full")  # every write to it fails with ENOSPC (Linux)


@pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")
def test_a_write_that_fails_after_open_names_its_file() -> None:
    with pytest.raises(OSError) as raised:
        FULL.write_text("x" * 10)
    assert describe(raised.value) == "cannot write /dev/full: No space left on device (errno 28, ENOSPC)"
    with pytest.raises(OSError) as raised:
        with open(FULL, "w") as file:
            json.dump(["y" * 100_000], file)
    assert describe(raised.value, "RUN_DIR").startswith("cannot write /dev/full: ")


def test_an_error_naming_its_file_or_none_is_one_line() -> None:
    erofs = OSError(errno.EROFS, "Read-only file system", "/runs/a/metrics.jsonl")
    assert describe(erofs) == "cannot write /runs/a/metrics.jsonl: Read-only file system (errno 30, EROFS)"
    assert describe(OSError(errno.EIO, "Input/output error"), "/runs/a") == (
        "cannot write a file in /runs/a: Input/output error (errno 5, EIO)"
    )


@contextlib.contextmanager
def _files_of_at_most(size: int) -> Iterator[None]:
    """`ulimit -f` for this process: a write past `size` bytes fails (EFBIG), as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_metrics_line_the_disk_refused_leaves_the_lines_before_readable(tmp_path: Path) -> None:
    files = RunFiles(tmp_path)
    with _files_of_at_most(10_000), pytest.raises(WriteError) as raised:
        for step in range(1000):
            files.log_step({"step": step, "note": "x" * 300})
    assert str(raised.value) == f"cannot write {tmp_path}/metrics.jsonl: File too large (errno 27, EFBIG)"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert lines and all(line.endswith("\n") and json.loads(line)["type"] == "step" for line in lines)
    assert [json.loads(line)["step"] for line in lines] == list(range(len(lines)))


def test_error_txt_is_written_in_the_room_reserved_for_it(tmp_path: Path) -> None:
    reserve(tmp_path)
    assert (tmp_path / RESERVE_FILE).stat().st_size == RESERVE_BYTES
    assert write_error_file(tmp_path, "rank 0: WriteError: cannot write x: No space left on device (errno 28, ENOSPC)")
    assert (tmp_path / ERROR_FILE).read_text().endswith("(errno 28, ENOSPC)\n")
    assert not (tmp_path / RESERVE_FILE).exists()  # given back for it
    reserve(tmp_path)
    release(tmp_path)  # a run that succeeded keeps none
    assert sorted(p.name for p in tmp_path.iterdir()) == [ERROR_FILE]


def test_an_error_file_that_cannot_be_written_leaves_none(tmp_path: Path) -> None:
    (tmp_path / ERROR_FILE).mkdir()  # in the way: the write fails, as on a disk with no room at all
    assert not write_error_file(tmp_path, "a line")
    assert (tmp_path / ERROR_FILE).is_dir()
