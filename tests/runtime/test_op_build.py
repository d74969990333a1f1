"""DeepSpeed's CPU op build (runtime.op_build): a killed build's baton is cleared, a lock
held too long ends the wait in one line naming it, a first build says so, a process
waiting on another's build is told, and each environment has its own cache."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from src.runtime import op_build
from src.runtime.op_build import BATON, LOCK_FILE, OP, OpBuildError, build_once, lock_wait, op_cache_dir
from tests.conftest import REPO_ROOT, cli_env


def _built(cache):
    (cache / OP).mkdir(parents=True, exist_ok=True)
    (cache / OP / f"{OP}.so").write_bytes(b"")


def test_a_killed_builds_baton_is_removed_under_the_projects_lock(tmp_path, capsys):
    _built(tmp_path)
    baton = tmp_path / OP / BATON
    baton.write_text("")  # torch's FileBaton, left by a builder killed mid-build
    seen = []
    build_once(tmp_path, OP, lambda: seen.append(baton.exists()), wait_s=1.0)
    assert seen == [False] and not baton.exists()
    line = f"removing {baton}: a DeepSpeed op build that was killed left it (its builder is gone)"
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_lock_held_too_long_ends_the_wait_in_one_line_naming_it(tmp_path, capsys):
    lock = tmp_path / LOCK_FILE
    lock.write_text("4242\n")
    with open(lock) as holder:  # another open file: flock treats it as another process
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(OpBuildError) as raised:
            build_once(tmp_path, OP, lambda: pytest.fail("built without the lock"), wait_s=0.3)
    assert str(raised.value) == (
        f"waited 0.3 s for DeepSpeed's op build lock {lock} (held by pid 4242); if no build is running, remove the file"
    )


def test_a_first_build_says_so_and_a_failed_one_is_one_line(tmp_path, capsys):
    def failing() -> None:
        raise RuntimeError("Error building extension 'deepspeed_shm_comm'\nninja: build stopped")

    with pytest.raises(OpBuildError, match=r"failed to build or load: RuntimeError: Error building extension 'deepspeed_shm_comm'$"):
        build_once(tmp_path, OP, failing, wait_s=1.0)
    assert capsys.readouterr().err.startswith("building DeepSpeed's CPU op, first start only")
    _built(tmp_path)
    build_once(tmp_path, OP, lambda: None, wait_s=1.0)
    assert capsys.readouterr().err == ""  # built: loaded from the cache, silently
    assert (tmp_path / LOCK_FILE).read_text().strip().isdigit()  # the last holder's pid


def test_each_environment_has_its_own_op_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    mine = op_cache_dir()
    monkeypatch.setattr(sys, "prefix", "/opt/another-venv")
    assert op_cache_dir() != mine and op_cache_dir().parent == mine.parent
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    assert op_cache_dir() == tmp_path / "chosen"  # a user's choice stands


def test_a_failure_is_remembered_for_the_processes_forked_after_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(op_build, "_loaded", False)
    monkeypatch.setattr(op_build, "_failure", None)
    calls = []

    def failing() -> None:
        calls.append(1)
        raise OSError("cannot load")

    monkeypatch.setattr(op_build, "_build_shm_op", failing)
    for _ in range(2):
        with pytest.raises(OpBuildError):
            op_build.prebuild_ops(wait_s=1.0)
    assert calls == [1]


@pytest.mark.slow  # a process that imports DeepSpeed and loads (or builds) the real op
def test_a_stale_baton_no_longer_hangs_a_real_start():
    from tests.runtime.support import build_deepspeed_ops

    build_deepspeed_ops()
    baton = op_cache_dir() / OP / BATON
    # Left as a killed builder leaves it: under the project's flock, so that no start of
    # another test (pytest-xdist) is loading the op now. A baton written while one holds the
    # flock is one that start never checked for: it waited on it forever.
    with open(op_cache_dir() / LOCK_FILE, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        baton.write_text("")
    code = "from src.runtime.op_build import prebuild_ops; prebuild_ops(wait_s=60)"
    env = {**cli_env(), "DS_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not baton.exists()
    # Under pytest-xdist another test's start (under the same flock) may clear the baton
    # first; then this start finds none and says nothing.
    assert result.stderr == "" or f"removing {baton}" in result.stderr, result.stderr[-2000:]


@pytest.mark.torch
def test_a_baton_no_process_holds_is_removed_and_the_load_tried_again(monkeypatch, tmp_path, capsys):
    """A baton written after the flock's holder checked for one (a process loading outside
    the flock, then gone) ends torch's wait, which has no end of its own."""
    from torch.utils.file_baton import FileBaton

    monkeypatch.setattr(op_build, "DEAD_BATON_S", 0.0)
    baton = tmp_path / OP / BATON
    calls = []

    def load() -> None:  # as torch's builder: take the baton, or wait for whoever holds it
        calls.append(1)
        if len(calls) == 1:
            baton.parent.mkdir(parents=True, exist_ok=True)
            baton.write_text("")  # closed at once: no process holds it
        taken = FileBaton(str(baton))
        if taken.try_acquire():
            taken.release()
        else:
            taken.wait()

    build_once(tmp_path, OP, load, wait_s=1.0)
    assert len(calls) == 2 and not baton.exists()
    assert f"removing {baton}: no process holds it" in capsys.readouterr().err


@pytest.mark.torch
def test_a_baton_a_live_process_holds_is_waited_on(monkeypatch, tmp_path, capsys):
    from torch.utils.file_baton import FileBaton

    monkeypatch.setattr(op_build, "DEAD_BATON_S", 0.0)
    baton = tmp_path / OP / BATON
    baton.parent.mkdir(parents=True)

    def load() -> None:
        held = os.open(baton, os.O_CREAT | os.O_EXCL)  # another builder's, open while it builds

        def release() -> None:
            time.sleep(0.3)
            os.close(held)
            os.remove(baton)

        threading.Thread(target=release).start()
        assert not FileBaton(str(baton)).try_acquire()
        FileBaton(str(baton)).wait()  # returns once the holder releases it

    build_once(tmp_path, OP, load, wait_s=1.0)
    assert not baton.exists() and "removing" not in capsys.readouterr().err


def test_a_process_waiting_on_anothers_build_lock_is_told(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / LOCK_FILE
    lock.write_text("4242\n")  # the holder's pid, as it writes it once it has the lock
    assert lock_wait([os.getpid()]) is None  # this process has not opened it
    with open(lock):
        assert lock_wait([os.getpid()]) == f"waits for DeepSpeed's op build lock {lock} (held by pid 4242)"
        assert lock_wait([4242, os.getpid()]) is None  # the holder is among them: it builds
