"""Where a tool may write: a directory it can create or write in, checked when its --out is
parsed, before any work. Standard library only, so that scripts meant for a bare GPU
machine (only torch installed) can check their --out too."""

from __future__ import annotations

import argparse
import errno
import os
import tempfile
from pathlib import Path


def unwritable_dir(path: Path) -> str | None:
    """Why a directory cannot be created or written in, or None: a probe directory is made
    and removed in its nearest existing ancestor (permissions alone would pass root)."""
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mmdist-probe-", dir=existing))
    except OSError as err:
        why = f"{err.strerror} (errno {err.errno}, {errno.errorcode.get(err.errno or 0, '?')})"
        return f"cannot write in {path}: {why}" if existing == path else f"cannot create {path}: {why} (at {existing})"
    return None


def output_dir(value: str) -> Path:
    """argparse's type of a tool's --out directory: refused when it is parsed, before any
    work, where it cannot be created or written in (the tool would otherwise end its work in
    a traceback)."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; give a directory")
    problem = unwritable_dir(path)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def output_file(value: str) -> Path:
    """argparse's type of a tool's --out file: refused when it is parsed where it names a
    directory or its directory cannot be created or written in (the tool creates it)."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; give a file")
    problem = unwritable_dir(path.parent)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def write_file(path: Path | str, text: str) -> None:
    """Write a tool's --out file, creating its directory (output_file let it be missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
