"""Write failures: a full disk (a record linked to /dev/full) or a run directory that
cannot be created ends in one line naming the path and the errno, exit 2, with error.txt
where the directory allows it and no summary.json."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import src.out_paths
from src.out_paths import output_dir, output_file, unwritable_dir, write_file
from src.report.files import RunFiles, WriteError
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
# Scripts for a bare GPU machine: torch and the standard library only, src.out_paths their one import of the repository's.
GPU_SCRIPTS = (
    "calibrate_gpu",
    "calibrate_gpu_layers",
    "measure_amp_host",
    "measure_memory_kernels",
    "measure_list_collective_host",
    "memory_kernel_rates",
)


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


def test_a_tools_out_path_is_refused_when_it_is_parsed(tmp_path, capsys):
    """The tools' --out (heldout, reproduce, sweep, figure_diff, the benchmarks): a path they
    could not write is refused before any work, in argparse's one line (exit 2)."""
    (tmp_path / "file").write_text("")
    not_a_dir = "Not a directory (errno 20, ENOTDIR)"
    for kind, value, problem in [
        (output_dir, f"{tmp_path}/file", f"{tmp_path}/file is a file; give a directory"),
        (output_dir, f"{tmp_path}/file/run", f"cannot create {tmp_path}/file/run: {not_a_dir} (at {tmp_path}/file)"),
        (output_file, str(tmp_path), f"{tmp_path} is a directory; give a file"),
        (output_file, f"{tmp_path}/file/x.md", f"cannot write in {tmp_path}/file: {not_a_dir}"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as raised:
            kind(value)
        assert str(raised.value) == problem
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=output_dir)
    parser.add_argument("--file", type=output_file)
    parsed = parser.parse_args(["--dir", f"{tmp_path}/new/run", "--file", f"{tmp_path}/new2/x.md"])
    assert (parsed.dir, parsed.file) == (tmp_path / "new" / "run", tmp_path / "new2" / "x.md")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing made, no probe left
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--file", str(tmp_path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"argument --file: {tmp_path} is a directory; give a file")


def test_write_file_creates_the_directory_output_file_let_be_missing(tmp_path):
    write_file(tmp_path / "new" / "deeper" / "x.json", "{}")
    assert (tmp_path / "new" / "deeper" / "x.json").read_text() == "{}"


def test_out_paths_needs_the_standard_library_only():
    """The GPU machine's scripts import it where only torch is installed."""
    tree = ast.parse(Path(src.out_paths.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


@pytest.mark.slow  # each script in a subprocess (torch imported)
@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_a_gpu_scripts_out_path_is_refused_before_its_work(script, tmp_path):
    (tmp_path / "file").write_text("")
    args = ["--hbm", "1"] if script == "memory_kernel_rates" else []  # its required option, then no profile at all
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{script}.py"), *args, "--out", f"{tmp_path}/file/x.json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(f"argument --out: cannot write in {tmp_path}/file: Not a directory (errno 20, ENOTDIR)")
    ), proc.stderr


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
