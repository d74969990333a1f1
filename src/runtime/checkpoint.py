"""Checkpoints of a real run (train.checkpoint_every=N) and runs that start from one
(train.resume=RUN_DIR).

After every N-th step, RUN_DIR/checkpoint/step<k>/ (k: steps done) holds:
  engines/<units>.rank<r>/   each engine's save_checkpoint, named by its units and the first
                             rank of its data-parallel group: a DeepSpeed engine's model
                             states from that rank and ZeRO's optimizer partitions from each;
                             an engine of our own (runtime.own_engine: a tensor grid's, the
                             plan's distributed optimizer) one file per rank
  ranks/rank<r>.pt           each rank's own: the fp16 loss scale, the RNG states
  meta.json                  written last, once every rank saved: the step, the world size,
                             the samples read, its bytes and the seconds it took, and its
                             manifest: every file the ranks wrote (torch.save, theirs and
                             DeepSpeed's), its size and SHA-256, hashed as it was written
and RUN_DIR/checkpoint/latest names it; the one before is removed. The data position is the
step: step s trains on samples [s*B, (s+1)*B) of the dataset, whatever the plan
(runtime.inputs), so a run resumed after step k reads from sample k*B on. Every file is
written through a file object of ours and synced before the checkpoint is sealed, so a
write the disk refuses is a WriteError naming the file (torch's own writer would say only
"file write failed"), and a sealed checkpoint is on the disk; one the disk refused stays
unsealed, and latest still names the one before.

A resume is checked at the door, before any worker starts (and by each worker under a
launcher: sizes, and rank 0 the checksums): a directory without a complete checkpoint, a file of its manifest
missing, of another size or another checksum (a deleted rank file, a truncated model
state), a checkpoint of another world size, saved by another plan (its plan.json against
this run's, train.steps aside) or trained under other backend.deepspeed or
backend.contrastive settings (run.json's) is one line.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator, cast

import numpy as np
import torch
import torch.distributed as dist

from src.config import CheckpointSpec
from src.errors import ConfigError
from src.plan_io import PLAN_FILE, RUN_FILE
from src.program import Plan
from src.progress import Progress
from src.report.files import writing
from src.runtime.engines import point_reduction_at
from src.runtime.loss_scale import LossScale

CHECKPOINT_DIR = "checkpoint"
LATEST = "latest"
META = "meta.json"
FORMAT = "mmdist-checkpoint"
VERSION = 3  # 2: meta.json holds the manifest; 3: a tensor grid's states under engines/
TAG = "state"  # DeepSpeed's tag, under each engine's directory
TRAINING = ("deepspeed", "contrastive")  # backend settings a resumed run must share with its checkpoint's
HASH_CHUNK = 2**20


@dataclass(frozen=True)
class Resume:
    """Where a resumed run starts: the checkpoint directory and the steps done."""

    source: Path  # the run directory named by train.resume
    path: Path  # its checkpoint/step<k>
    step: int


@dataclass(frozen=True)
class Saved:
    step: int
    bytes: int
    seconds: float


def check_resume(spec: CheckpointSpec, run_dir: Path, training: dict[str, Any], checksums: bool = True) -> Resume | None:
    """The checkpoint `spec.resume` names, checked against this run's plan (RUN_DIR/plan.json,
    written), its training settings (`training`: run.json's "torch" part, which is written only
    once the checkpoint passes) and its manifest (each file's size, and with `checksums` its
    SHA-256): ConfigError if there is none, it is damaged, or it cannot serve this plan."""
    if spec.resume is None:
        return None
    source = Path(spec.resume)
    name = f"train.resume={source}"
    if not source.is_dir():
        raise ConfigError(f"{name}: no such run directory")
    latest = source / CHECKPOINT_DIR / LATEST
    if not latest.is_file():
        raise ConfigError(f"{name}: no checkpoint there (no {latest}; a run saves one with train.checkpoint_every=N)")
    path = source / CHECKPOINT_DIR / latest.read_text().strip()
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError):
        raise ConfigError(f"{name}: its latest checkpoint {path} is incomplete (no readable {META})") from None
    header = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else None
    if header != (FORMAT, VERSION) or not all(isinstance(meta.get(key), int) for key in ("step", "world_size")):
        raise ConfigError(f"{name}: {path / META} is not an mmdist checkpoint of version {VERSION}")
    if not isinstance(meta.get("files"), dict) or not meta["files"]:
        raise ConfigError(f"{name}: {path / META} lists no files (its manifest is missing)")
    damage = _damage(path, meta["files"], checksums)
    if damage:
        raise ConfigError(f"{name}: its checkpoint {path} is damaged: {damage}; resume from an earlier run or train anew")
    ours, theirs = _plan_file(run_dir / PLAN_FILE), _plan_file(source / PLAN_FILE)
    if meta["world_size"] != ours["world_size"]:
        raise ConfigError(f"{name}: its checkpoint is of {meta['world_size']} ranks, this plan runs {ours['world_size']}")
    differ = [key for key in {**ours, **theirs} if ours.get(key) != theirs.get(key)]
    if differ:
        raise ConfigError(
            f"{name}: its checkpoint was saved by another plan (its plan.json differs in {', '.join(differ)}; "
            f"python -m src.plan_diff {source} {run_dir} shows how)"
        )
    saved = _training(source / RUN_FILE)
    trained = [key for key in TRAINING if training.get(key) != saved.get(key)]
    if trained:
        raise ConfigError(f"{name}: its checkpoint was trained under other {', '.join(f'backend.{key}' for key in trained)} settings")
    steps = _steps(run_dir / PLAN_FILE)
    if meta["step"] >= steps:
        raise ConfigError(f"{name}: its checkpoint holds {meta['step']} steps, and train.steps={steps} leaves none to run")
    return Resume(source, path, meta["step"])


def _damage(path: Path, files: dict[str, Any], checksums: bool) -> str | None:
    """What is wrong with the files of the checkpoint at `path` against its manifest (None:
    nothing): the first missing file, else of another size, else of another checksum."""
    entries = sorted(files.items())
    for relative, entry in entries:
        if not (path / relative).is_file():
            return f"{relative} is missing (the manifest lists {entry['bytes']} bytes)"
    for relative, entry in entries:
        size = (path / relative).stat().st_size
        if size != entry["bytes"]:
            return f"{relative} has {size} bytes, the manifest {entry['bytes']}"
    if not checksums:
        return None
    progress = Progress(f"checking the checkpoint {path}")
    total, done = sum(entry["bytes"] for _, entry in entries), 0
    for relative, entry in entries:
        digest = hashlib.sha256()
        with open(path / relative, "rb") as file:
            while chunk := file.read(HASH_CHUNK):
                digest.update(chunk)
                done += len(chunk)
                if progress.due():
                    progress.show(f"{done / 2**30:.2f} of {total / 2**30:.2f} GiB checksummed")
        if digest.hexdigest() != entry["sha256"]:
            return f"{relative} does not match its checksum (SHA-256 {digest.hexdigest()[:12]}..., manifest {entry['sha256'][:12]}...)"
    return None


def _plan_file(path: Path) -> dict[str, Any]:
    """A plan file's sections as a resume compares them: what was planned, not the record
    of the config groups (`sources`), the planner's report (`plan.details`: a search's
    wall time differs between two plannings of one plan) or how many steps to run."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read the plan file {path}: {getattr(err, 'strerror', None) or err}") from None
    data.pop("sources", None)
    data.get("plan", {}).pop("details", None)
    data.get("train", {}).pop("steps", None)
    return data


def _training(path: Path) -> dict[str, Any]:
    """The settings a run trains under (TRAINING), as its run.json records them (at their
    defaults they are left out; so is a run.json not written)."""
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text()).get("torch", {})
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read the run settings file {path}: {getattr(err, 'strerror', None) or err}") from None


def _steps(path: Path) -> int:
    return int(json.loads(path.read_text())["train"].get("steps", 1))


class Checkpoints:
    """One rank's part of saving and loading: its engines (each once, however many units
    share it) and its own state."""

    def __init__(self, run_dir: Path, rank: int, engines: dict[str, Any], plan: Plan) -> None:
        self.run_dir, self.rank, self.plan = run_dir, rank, plan
        self._shared: dict[int, tuple[list[str], Any]] = {}
        for name, engine in engines.items():
            self._shared.setdefault(id(engine), ([], engine))[0].append(name)

    @functools.cached_property
    def engines(self) -> dict[str, Any]:
        """Each engine by its directory: its units and the first rank holding their layers
        here. DeepSpeed reads the model states of all tensor-parallel peers from one
        directory, and its data-parallel replicas share their model states and keep their
        own optimizer partitions there. Sorted: every rank saves and loads its engines in
        one global order, so the collectives of engines sharing ranks (ZeRO's gathers on
        load) pair up."""
        named = []
        for names, engine in self._shared.values():
            unit = self.plan.unit(names[0])
            mine = unit.layers_on(self.rank)
            first = min(r for r in unit.ranks if unit.layers_on(r) == mine)
            named.append((f"{'+'.join(sorted(names))}.rank{first}", engine))
        return dict(sorted(named, key=lambda entry: entry[0]))

    def save(self, step: int, loss_scale: LossScale | None, samples_read: int) -> Saved | None:
        """Every rank saves its part, then rank 0 seals the checkpoint (meta.json with the
        manifest of every rank's files, latest) and removes the one before; returns what
        was saved (rank 0), else None."""
        start = time.perf_counter()
        path = self.run_dir / CHECKPOINT_DIR / f"step{step}"
        written: dict[str, dict[str, Any]] = {}
        with _through_our_files(path, written):
            for name, engine in self.engines.items():
                with writing(path / "engines" / name):
                    (path / "engines" / name).mkdir(parents=True, exist_ok=True)
                point_reduction_at(engine)
                with _without_world_barriers():
                    engine.save_checkpoint(str(path / "engines" / name), tag=TAG, save_latest=False)
            with writing(path / "ranks"):
                (path / "ranks").mkdir(parents=True, exist_ok=True)
            torch.save(self._own_state(loss_scale), path / "ranks" / f"rank{self.rank}.pt")
        manifests: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(written, manifests, dst=0)  # every rank's files are on the disk
        seconds = time.perf_counter() - start
        if self.rank != 0:
            return None
        assert manifests is not None, "rank 0 gathers"
        files = {relative: entry for manifest in manifests for relative, entry in manifest.items()}
        saved = Saved(step, sum(f.stat().st_size for f in path.rglob("*") if f.is_file()), seconds)
        meta = {"format": FORMAT, "version": VERSION, "step": step, "world_size": dist.get_world_size(), "samples_read": samples_read}
        _write_whole(path / META, json.dumps({**meta, "bytes": saved.bytes, "save_s": saved.seconds, "files": files}))
        _write_whole(path.parent / LATEST, path.name)
        for old in path.parent.glob("step*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return saved

    def load(self, resume: Resume, loss_scale: LossScale | None) -> None:
        """Each engine and this rank's state as saved: call right after building the
        engines (ZeRO-3 loads into freshly partitioned parameters only)."""
        for name, engine in self.engines.items():
            point_reduction_at(engine)
            loaded, _ = engine.load_checkpoint(
                str(resume.path / "engines" / name), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
            if loaded is None:
                raise ConfigError(f"train.resume={resume.source}: {resume.path} holds no state for engine {name}")
        state = torch.load(resume.path / "ranks" / f"rank{self.rank}.pt", weights_only=False)
        if loss_scale is not None:
            loss_scale.scale, loss_scale.good_steps = state["loss_scale"]
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])

    def _own_state(self, loss_scale: LossScale | None) -> dict[str, Any]:
        return {
            "loss_scale": (loss_scale.scale, loss_scale.good_steps) if loss_scale is not None else None,
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
        }


@contextlib.contextmanager
def _without_world_barriers() -> Iterator[None]:
    """DeepSpeed's save_checkpoint waits at barriers of the whole world, as if every rank held
    one engine; here a rank holds any number of engines on groups of their own, and a barrier
    that some ranks reach once and others twice never opens. Its directories are made
    beforehand and the checkpoint waits for every rank once, after all its engines."""
    import deepspeed.comm as ds_comm

    barrier = ds_comm.barrier
    ds_comm.barrier = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ds_comm.barrier = barrier


class _Hashing(io.RawIOBase):
    """What torch.save writes a checkpoint file through: the file, its size and its SHA-256
    as it is written. No fileno(): torch would write tensors to the descriptor directly."""

    def __init__(self, file: io.BufferedWriter) -> None:
        self.file, self.bytes, self.digest = file, 0, hashlib.sha256()
        self.refused: OSError | None = None  # the disk's error: torch's writer raises one of its own over it

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            count = self.file.write(data) or 0
        except OSError as err:
            self.refused = err
            raise
        self.digest.update(memoryview(data).cast("B")[:count])
        self.bytes += count
        return count


@contextlib.contextmanager
def _through_our_files(root: Path, written: dict[str, dict[str, Any]]) -> Iterator[None]:
    """Every torch.save to a path (this rank's own, DeepSpeed's checkpoint engine's) writes
    through a file of ours: synced, entered in `written` (its path under `root`: its bytes
    and SHA-256), and a write the disk refuses is a WriteError naming the file."""
    original = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, (str, os.PathLike)):
            return original(obj, f, *args, **kwargs)
        path = Path(f)
        with writing(path), open(path, "wb") as file:
            sink = _Hashing(file)
            try:
                original(obj, cast(IO[bytes], sink), *args, **kwargs)
            except Exception:
                if sink.refused is not None:
                    raise sink.refused from None
                raise
            file.flush()
            os.fsync(file.fileno())
        written[path.relative_to(root).as_posix()] = {"bytes": sink.bytes, "sha256": sink.digest.hexdigest()}

    torch.save = save
    try:
        yield
    finally:
        torch.save = original


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(tmp), open(tmp, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    with writing(path):
        os.replace(tmp, path)
