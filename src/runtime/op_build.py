"""DeepSpeed's CPU communication op, built once per environment, never waited on forever.

DeepSpeed compiles the op just in time at its first start on CPU, through torch's
extension builder. Left to their defaults, three things go wrong:
- torch keys its extensions cache by Python version and accelerator only, so two installs
  of the project on one host (two virtualenvs, another torch) share one build folder and
  rebuild each other's op at every start: the cache here is one folder per environment
  (interpreter prefix, Python, torch and DeepSpeed versions), unless TORCH_EXTENSIONS_DIR
  says otherwise;
- torch's builder marks a build in progress with a baton file (`lock` in the op's folder)
  that a killed builder leaves behind, and every later start waits on it forever. Every
  build here runs under the project's own flock, which the kernel releases when its holder
  dies: a baton found while holding the flock is a dead builder's, and is removed. One that
  appears after that check (a process loading outside the flock) is waited on only while a
  live process holds it open, as torch's builder holds its baton from taking it to
  releasing it; then it is removed and the load tried once more;
- nothing bounds the wait: the flock's wait ends after `wait_s` in one line naming the
  lock file and the process that holds it.
Every process that loads the op (the front door's build, the forkserver, a worker under a
launcher, a test) does so through prebuild_ops, under the flock: a baton is a dead
builder's only if no builder runs without it. A first build runs in the front door
(`build_in_door`), whose progress lines say how long it has run and what the compiler is
doing, and whose signals stop it; the forkserver then only loads the op.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import importlib.metadata
import io
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

from src.progress import heartbeat, say
from src.runtime.processes import descendants

OP = "deepspeed_shm_comm"  # the folder torch's builder gives DeepSpeed's ShareMemCommBuilder
LOCK_FILE = "build.lock"  # the project's flock, one per cache folder
BATON = "lock"  # torch's FileBaton in the op's folder
BUILD_WAIT_S = 900.0  # a first build takes minutes on a few busy cores (388 s seen)
DEAD_BATON_S = 5.0  # how long a baton no process holds open is waited on before it is removed
WAIT_LINE_EVERY_S = 30.0
POLL_S = 0.2
LOAD_NOTICE = "deepspeed_shm_comm_op built successfully"


class OpBuildError(RuntimeError):
    """The op could not be built or loaded; the message says where and why, in one line."""


class _DeadBaton(Exception):
    """torch's builder was waiting on a baton no live process holds: removed, load again."""


_loaded = False
_failure: OpBuildError | None = None  # remembered in the forkserver, re-raised in each worker


def op_cache_dir() -> Path:
    """This environment's extensions cache: TORCH_EXTENSIONS_DIR if set, else a folder under
    the user's cache named by what an op build depends on."""
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen:
        return Path(chosen)
    torch, deepspeed = (importlib.metadata.version(package) for package in ("torch", "deepspeed"))  # without importing them
    interpreter = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    key = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch}-deepspeed{deepspeed}-{interpreter}"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "mmdist" / "torch_extensions" / key


def prebuild_ops(wait_s: float = BUILD_WAIT_S) -> None:
    """Compile (or load from this environment's cache) the op DeepSpeed builds at its first
    start on CPU. Call it before joining a process group, whose timeouts a build would
    outlast. A failure is remembered: a process forked after it (a worker from the
    forkserver that preloaded it) raises the same error at once."""
    global _loaded, _failure
    if _loaded:
        return
    if _failure is not None:
        raise _failure
    cache = op_cache_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(cache)  # where torch's builder looks, here and in children
    try:
        build_once(cache, OP, _build_shm_op, wait_s)
    except OpBuildError as err:
        _failure = err
        raise
    _loaded = True


def build_in_door(wait_s: float = BUILD_WAIT_S) -> None:
    """In the front door, before it starts CPU workers: build the op if this environment has
    none yet (or a killed build left it unfinished), saying what the build does while it
    runs; with the op built, nothing (the forkserver loads it)."""
    cache = op_cache_dir()
    if _built(cache, OP) and not (cache / OP / BATON).exists():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # gloo workers: no accelerator probe
    with heartbeat("building DeepSpeed's CPU op, first start only", at_once=True, detail=build_activity):
        prebuild_ops(wait_s)


def build_activity() -> str:
    """What the op build does now, told by the processes below this one: a compiler's
    source file, the link, ninja itself, or none (DeepSpeed's probes, the load)."""
    running = descendants().values()
    for argv in running:
        if "-c" in argv:
            sources = [arg for arg in argv if arg.endswith((".cpp", ".cc", ".c"))]
            if sources:
                return f"compiling {Path(sources[0]).name} ({Path(argv[0]).name})"
    for argv in running:
        if "-shared" in argv and "-o" in argv[:-1]:
            return f"linking {Path(argv[argv.index('-o') + 1]).name}"
    if any(argv and Path(argv[0]).name == "ninja" for argv in running):
        return "ninja is running"
    return "probing the compiler, or loading the built op"


def lock_wait(pids: Iterable[int]) -> str | None:
    """'waits for DeepSpeed's op build lock (held by pid 42)' if one of `pids` has the lock
    file open while another process's pid is in it (the holder writes its pid once it has
    the lock): what a forkserver or worker that makes no progress is doing."""
    path = op_cache_dir() / LOCK_FILE
    holder = _holder(path) if path.exists() else ""
    if not holder.startswith("pid ") or int(holder[4:]) in pids:
        return None
    if any(_opens(pid, path) for pid in pids):
        return f"waits for DeepSpeed's op build lock {path} (held by {holder})"
    return None


def _opens(pid: int | str, path: Path) -> bool:
    """Whether process `pid` has `path` open (Linux's /proc; False where it cannot be read)."""
    with contextlib.suppress(OSError):
        return any(os.readlink(fd.path) == str(path) for fd in os.scandir(f"/proc/{pid}/fd"))
    return False


def _built(cache: Path, op: str) -> bool:
    return any((cache / op).glob("*.so"))


def build_once(cache: Path, op: str, build: Callable[[], object], wait_s: float) -> None:
    """Run `build` (which builds `op` in `cache`, or loads it) under the cache's flock:
    after a bounded wait for it, with a dead builder's baton cleared, and saying so when the
    op is not built yet (a first start: minutes)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / LOCK_FILE, "a+")
    except OSError as err:
        raise OpBuildError(f"cannot create DeepSpeed's op cache {cache}: {os.strerror(err.errno or 0)} (errno {err.errno})") from None
    with lock:
        _acquire(lock, cache / LOCK_FILE, wait_s)
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        baton = cache / op / BATON
        if baton.exists():
            say(f"removing {baton}: a DeepSpeed op build that was killed left it (its builder is gone)")
            baton.unlink()
        if not _built(cache, op):
            say(f"building DeepSpeed's CPU op, first start only (a few minutes): {cache / op}")
        for last in (False, True):
            try:
                with _dead_batons_removed(baton):
                    build()
                return
            except _DeadBaton:
                if last:
                    raise OpBuildError(f"DeepSpeed's CPU op in {cache / op}: a dead builder's baton {baton} came back twice") from None
            except Exception as err:  # a compiler's or loader's failure, whatever DeepSpeed raises for it
                reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
                raise OpBuildError(f"DeepSpeed's CPU op in {cache / op} failed to build or load: {reason}") from err


@contextlib.contextmanager
def _dead_batons_removed(baton: Path) -> Iterator[None]:
    """While torch's builder runs here: its wait on `baton` ends, the baton removed, once no
    live process has held it open for DEAD_BATON_S (torch's own wait has no end)."""
    from torch.utils.file_baton import FileBaton

    waits = FileBaton.wait

    def wait(self: FileBaton) -> None:
        if Path(self.lock_file_path) != baton or not Path("/proc").is_dir():
            return waits(self)
        unheld_since = None
        while baton.exists():
            now = time.monotonic()
            if _held_open(baton):
                unheld_since = None
            elif unheld_since is None:
                unheld_since = now
            elif now - unheld_since >= DEAD_BATON_S:
                say(f"removing {baton}: no process holds it (a builder that is gone, or one outside the project's lock)")
                with contextlib.suppress(FileNotFoundError):
                    baton.unlink()
                raise _DeadBaton
            time.sleep(self.wait_seconds)

    FileBaton.wait = wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileBaton.wait = waits  # type: ignore[method-assign]


def _held_open(path: Path) -> bool:
    """Whether a live process has `path` open."""
    return any(_opens(proc.name, path) for proc in Path("/proc").iterdir() if proc.name.isdigit())


def _acquire(lock: IO[str], path: Path, wait_s: float) -> None:
    """The flock, waited for at most `wait_s`, with a line now and then while waiting."""
    start = time.monotonic()
    said = start
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        now = time.monotonic()
        if now - start >= wait_s:
            raise OpBuildError(
                f"waited {wait_s:g} s for DeepSpeed's op build lock {path} (held by {_holder(path)}); "
                f"if no build is running, remove the file"
            )
        if now - said >= WAIT_LINE_EVERY_S:
            said = now
            say(f"waiting for DeepSpeed's op build lock {path} ({_holder(path)}), {now - start:.0f} s so far")
        time.sleep(POLL_S)


def _holder(path: Path) -> str:
    text = path.read_text().strip()
    return f"pid {text}" if text.isdigit() else "another process"


def _build_shm_op() -> None:
    # DeepSpeed probes compilers through logging; Hydra's root logger would print every call.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        # `import deepspeed.comm.torch as m` would bind torch itself (deepspeed.comm re-exports it).
        with without_load_notice():
            importlib.import_module("deepspeed.comm.torch").build_shm_op()
    finally:
        root.setLevel(level)


@contextlib.contextmanager
def without_load_notice() -> Iterator[None]:
    """DeepSpeed prints LOAD_NOTICE every time a process loads its shm op, even from the
    cache: once per worker and run. Drop that line, pass on whatever else was printed
    (a failed build raises, and the compiler writes to the file descriptors directly)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        sys.stdout.write("".join(line for line in captured.getvalue().splitlines(keepends=True) if LOAD_NOTICE not in line))
