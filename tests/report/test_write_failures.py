"""Write failures: a full disk (a record linked to /dev/full) or a run directory that
cannot be created ends in one line naming the path and the errno, exit 2, with error.txt
where the directory allows it and no summary.json."""

from __future__ import annotations

import pytest

from src.report.files import RunFiles, WriteError, unwritable_dir
from tests.conftest import run_cli


def test_a_full_disk_is_one_line_naming_the_record(tmp_path):
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    files = RunFiles(tmp_path)
    with pytest.raises(WriteError) as raised:
        files.log_step({"step": 0, "loss": 1.0})
    assert str(raised.value) == f"cannot write {tmp_path}/metrics.jsonl: No space left on device (errno 28, ENOSPC)"


def test_a_directory_under_a_file_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("")
    assert unwritable_dir(tmp_path / "file" / "run") == (
        f"cannot create {tmp_path}/file/run: Not a directory (errno 20, ENOTDIR) (at {tmp_path}/file)"
    )
    assert unwritable_dir(tmp_path / "new" / "run") is None and not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # the probe is gone


@pytest.mark.slow  # the front door in a subprocess
def test_the_front_door_reports_a_full_disk_and_an_unwritable_run_directory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to("/dev/full")
    result = run_cli("model=clip", "logger=none", f"hydra.run.dir={run}")
    line = f"error: cannot write {run}/metrics.jsonl: No space left on device (errno 28, ENOSPC)"
    assert result.returncode == 2 and result.stderr.strip() == line and result.stdout == ""
    assert (run / "error.txt").read_text() == line.removeprefix("error: ") + "\n"
    assert not (run / "summary.json").exists()

    (tmp_path / "file").write_text("")
    result = run_cli("model=clip", "logger=none", f"hydra.run.dir={tmp_path}/file/run")
    assert result.returncode == 2
    line = f"error: cannot create {tmp_path}/file/run: Not a directory (errno 20, ENOTDIR) (at {tmp_path}/file)"
    assert result.stderr.strip() == line
