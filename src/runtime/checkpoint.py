"""Checkpoints of a real run (train.checkpoint_every=N) and runs that start from one
(train.resume=RUN_DIR).

After every N-th step, RUN_DIR/checkpoint/step<k>/ (k: steps done) holds:
  engines/<units>.rank<r>/   each DeepSpeed engine's save_checkpoint (its model states from its
                             first data-parallel rank, ZeRO's optimizer partitions from each),
                             named by its units and the first rank of its data-parallel group
  ranks/rank<r>.pt           each rank's own: the layers and optimizers of its Par4D grid
                             units (per-rank shards, runtime.grid_engine), the fp16 loss
                             scale, the RNG states
  meta.json                  written last, once every rank saved: the step, the world size,
                             the samples read, its bytes and the seconds it took
and RUN_DIR/checkpoint/latest names it; the one before is removed. The data position is the
step: step s trains on samples [s*B, (s+1)*B) of the dataset, whatever the plan
(runtime.inputs), so a run resumed after step k reads from sample k*B on.

A resume is checked at the door, before any worker starts (and by each worker under a
launcher): a directory without a complete checkpoint, a checkpoint of another world size,
saved by another plan (its plan.json against this run's, train.steps aside) or trained
under other backend.deepspeed or backend.contrastive settings (run.json's) is one line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from src.config import CheckpointSpec
from src.errors import ConfigError
from src.plan_io import PLAN_FILE, RUN_FILE
from src.program import Plan
from src.runtime.engines import point_reduction_at
from src.runtime.grid_engine import GridEngine
from src.runtime.loss_scale import LossScale

CHECKPOINT_DIR = "checkpoint"
LATEST = "latest"
META = "meta.json"
FORMAT = "mmdist-checkpoint"
VERSION = 1
TAG = "state"  # DeepSpeed's tag, under each engine's directory
TRAINING = ("deepspeed", "contrastive")  # backend settings a resumed run must share with its checkpoint's


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


def check_resume(spec: CheckpointSpec, run_dir: Path) -> Resume | None:
    """The checkpoint `spec.resume` names, checked against this run's plan (RUN_DIR/plan.json,
    written): ConfigError if there is none, or it cannot serve this plan."""
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
    ours, theirs = _plan_file(run_dir / PLAN_FILE), _plan_file(source / PLAN_FILE)
    if meta["world_size"] != ours["world_size"]:
        raise ConfigError(f"{name}: its checkpoint is of {meta['world_size']} ranks, this plan runs {ours['world_size']}")
    differ = [key for key in {**ours, **theirs} if ours.get(key) != theirs.get(key)]
    if differ:
        raise ConfigError(
            f"{name}: its checkpoint was saved by another plan (its plan.json differs in {', '.join(differ)}; "
            f"python -m src.plan_diff {source} {run_dir} shows how)"
        )
    trained = [key for key in TRAINING if _training(run_dir / RUN_FILE).get(key) != _training(source / RUN_FILE).get(key)]
    if trained:
        raise ConfigError(f"{name}: its checkpoint was trained under other {', '.join(f'backend.{key}' for key in trained)} settings")
    steps = _steps(run_dir / PLAN_FILE)
    if meta["step"] >= steps:
        raise ConfigError(f"{name}: its checkpoint holds {meta['step']} steps, and train.steps={steps} leaves none to run")
    return Resume(source, path, meta["step"])


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
    """One rank's part of saving and loading: its DeepSpeed engines (each once, however many
    units share it), its grid engines and its own state."""

    def __init__(self, run_dir: Path, rank: int, engines: dict[str, Any], plan: Plan) -> None:
        self.run_dir, self.rank, self.plan = run_dir, rank, plan
        self.grids = {name: engine for name, engine in engines.items() if isinstance(engine, GridEngine)}
        self._shared: dict[int, tuple[list[str], Any]] = {}
        for name, engine in engines.items():
            if not isinstance(engine, GridEngine):
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
        """Every rank saves its part, then rank 0 seals the checkpoint (meta.json, latest)
        and removes the one before; returns what was saved (rank 0), else None."""
        start = time.perf_counter()
        path = self.run_dir / CHECKPOINT_DIR / f"step{step}"
        for name, engine in self.engines.items():
            (path / "engines" / name).mkdir(parents=True, exist_ok=True)
            point_reduction_at(engine)
            with _without_world_barriers():
                engine.save_checkpoint(str(path / "engines" / name), tag=TAG, save_latest=False)
        (path / "ranks").mkdir(parents=True, exist_ok=True)
        torch.save(self._own_state(loss_scale), path / "ranks" / f"rank{self.rank}.pt")
        dist.barrier()
        seconds = time.perf_counter() - start
        if self.rank != 0:
            return None
        saved = Saved(step, sum(f.stat().st_size for f in path.rglob("*") if f.is_file()), seconds)
        meta = {"format": FORMAT, "version": VERSION, "step": step, "world_size": dist.get_world_size(), "samples_read": samples_read}
        _write_whole(path / META, json.dumps({**meta, "bytes": saved.bytes, "save_s": saved.seconds}))
        _write_whole(path.parent / LATEST, path.name)
        for old in path.parent.glob("step*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return saved

    def load(self, resume: Resume, loss_scale: LossScale | None) -> None:
        """Each engine, grid and this rank's state as saved: call right after building the
        engines (ZeRO-3 loads into freshly partitioned parameters only)."""
        for name, engine in self.engines.items():
            point_reduction_at(engine)
            loaded, _ = engine.load_checkpoint(
                str(resume.path / "engines" / name), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
            if loaded is None:
                raise ConfigError(f"train.resume={resume.source}: {resume.path} holds no state for engine {name}")
        state = torch.load(resume.path / "ranks" / f"rank{self.rank}.pt", weights_only=False)
        for name, grid in self.grids.items():
            grid.module.load_state_dict(state["grids"][name]["module"])
            grid.optimizer.load_state_dict(state["grids"][name]["optimizer"])
            if grid.lr_scheduler is not None:
                grid.lr_scheduler.load_state_dict(state["grids"][name]["lr_scheduler"])
        if loss_scale is not None:
            loss_scale.scale, loss_scale.good_steps = state["loss_scale"]
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])

    def _own_state(self, loss_scale: LossScale | None) -> dict[str, Any]:
        return {
            "grids": {
                n: {
                    "module": g.module.state_dict(),
                    "optimizer": g.optimizer.state_dict(),
                    "lr_scheduler": g.lr_scheduler.state_dict() if g.lr_scheduler is not None else None,
                }
                for n, g in self.grids.items()
            },
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


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
