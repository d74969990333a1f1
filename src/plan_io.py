"""The plan file: what a run executes, written once by the door and read by every worker.

RUN_DIR/plan.json holds the typed plan (every unit's plan and the Program: each rank
class's instructions, the process groups and routes) with what it was priced on: the
model (units, layers, kernels, each unit's architecture), the cluster preset and the
training settings, and, as a record, the config groups it was planned from. A worker, a
launcher and `python -m src.run plan=RUN_DIR` read it; none of them plans again.
RUN_DIR/run.json holds how a real run executes it: the backend's settings, the job's
names and the composed config the sinks record.

Both are JSON of the types' own fields (src/codec.py; written and parsed by orjson, which
takes a fraction of the standard library's time on a plan of 10^5 instructions) under a
format name and version. A
reader refuses another version, a truncated file or a plan for another world size in one
line (ConfigError), before any process group forms:

    python -m src.plan_io RUN_DIR [--world-size N]   # check a written plan, describe it in one line
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from src.cluster import ClusterSpec
from src.codec import CodecError, decode, encode, fields_codec, register
from src.collector import collector_paused
from src.config import CheckpointSpec, TorchBackendSpec, TrainSpec
from src.errors import ConfigError
from src.models.spec import LayerSpec, ModelSpec, UnitSpec
from src.program import Plan
from src.report.wandb_sink import JobInfo

PLAN_FILE = "plan.json"
RUN_FILE = "run.json"
PLAN_FORMAT = "mmdist-plan"
RUN_FORMAT = "mmdist-run"
# 2: ZeRO-3 fetches and persistence threshold, MLLM image-side spread, priced sample images;
# 3: run.json's backend.deepspeed and backend.contrastive (lr, weight_decay, adam_eps and
# initial_loss_scale moved there); 4: a unit's tensor grid layout in one field (UnitPlan.grid);
# 5: Plan.balancing names its kind (a pipeline's balancing policy or DistTrain's reordering)
# 6: DistTrain's reordering carries its chain of units (the orders its search prices);
# 7: a tensor grid's weight gathered where it is needed is listed (Collective.listed)
VERSION = 7
HEADER = ("format", "version", "world_size")
PLANNED_FROM = ("model", "strategy", "cluster", "train")  # the config groups a plan is made from


@dataclass(frozen=True)
class PlannedRun:
    """A plan and what it was priced on: what either backend runs. `sources`: the config
    groups it was planned from (a record for readers and for a re-run's resolved.yaml;
    nothing decides anything from it)."""

    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    plan: Plan
    sources: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSettings:
    """How one run executes its plan: its backend (sim or torch) and the real backend's
    settings (None for the simulator), the job's names, the composed config, which
    the sinks record (W&B's run config) and nothing reads to decide, and its checkpoints
    (train.checkpoint_every, train.resume)."""

    backend: str
    torch: TorchBackendSpec | None
    job: JobInfo
    record: dict[str, Any]
    checkpoint: CheckpointSpec = CheckpointSpec()


def _encode_model(model: ModelSpec) -> dict[str, Any]:
    """Each distinct layer once, units listing theirs by index: a tower repeats one block
    object, which the cost model caches by identity, and so does the model read back."""
    layers: list[Any] = []
    index: dict[int, int] = {}
    units = []
    for unit in model.units:
        refs = []
        for layer in unit.layers:
            if id(layer) not in index:
                index[id(layer)] = len(layers)
                layers.append(encode(layer, LayerSpec))
            refs.append(index[id(layer)])
        units.append({**_UNIT[0](replace(unit, layers=())), "layers": refs})
    return {**_MODEL[0](replace(model, units=())), "units": units, "layers": layers}


def _decode_model(data: dict[str, Any]) -> ModelSpec:
    layers = [decode(layer, LayerSpec) for layer in data["layers"]]
    units = tuple(replace(_UNIT[1]({**unit, "layers": []}), layers=tuple(layers[i] for i in unit["layers"])) for unit in data["units"])
    body = {k: v for k, v in data.items() if k != "layers"}
    return replace(_MODEL[1]({**body, "units": []}), units=units)


_UNIT, _MODEL = fields_codec(UnitSpec), fields_codec(ModelSpec)
register(ModelSpec, _encode_model, _decode_model)


def write_plan(run_dir: Path, planned: PlannedRun) -> Path:
    header = {"format": PLAN_FORMAT, "version": VERSION, "world_size": planned.plan.devices}
    # A large plan encodes to millions of short-lived dicts and lists, none in a cycle: the
    # collector's passes over them would cost more than the encoding.
    with collector_paused():
        return _write(Path(run_dir) / PLAN_FILE, {**header, **encode(planned, PlannedRun)})


def settings_record(settings: RunSettings) -> dict[str, Any]:
    """run.json's content for `settings`, as a reader of the file gets it back."""
    return orjson.loads(orjson.dumps({"format": RUN_FORMAT, "version": VERSION, **encode(settings, RunSettings)}))


def write_settings(run_dir: Path, settings: RunSettings) -> Path:
    return _write(Path(run_dir) / RUN_FILE, settings_record(settings))


def read_plan(source: Path, world_size: int | None = None) -> PlannedRun:
    """The plan written at `source` (a run directory or its plan.json); `world_size`: the
    number of workers a launcher started, which must be the plan's."""
    path = _file(Path(source), PLAN_FILE)
    with collector_paused():
        return _read_plan(path, world_size)


def _read_plan(path: Path, world_size: int | None) -> PlannedRun:
    data = _read(path, PLAN_FORMAT, "plan")
    if world_size is not None and data.get("world_size") != world_size:
        raise ConfigError(f"{path} plans {data.get('world_size')} ranks, not the launcher's {world_size} (WORLD_SIZE)")
    planned = _decode(path, {k: v for k, v in data.items() if k not in HEADER}, PlannedRun, "plan")
    if planned.plan.devices != data.get("world_size"):
        raise ConfigError(f"{path} is not a valid plan: world_size {data.get('world_size')} but {planned.plan.devices} devices")
    return planned


def read_settings(run_dir: Path) -> RunSettings:
    path = _file(Path(run_dir), RUN_FILE)
    data = _read(path, RUN_FORMAT, "run settings")
    return _decode(path, {k: v for k, v in data.items() if k not in HEADER}, RunSettings, "run settings")


def _file(source: Path, name: str) -> Path:
    return source / name if source.is_dir() else source


def _write(path: Path, data: dict[str, Any]) -> Path:
    """Whole or not at all: a reader never sees a half-written file under this name."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(orjson.dumps(data))
    os.replace(tmp, path)
    return path


def _read(path: Path, fmt: str, what: str) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {what} file {path}: {err.strerror or err}") from None
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise ConfigError(
            f"{path} is not a whole {what} file (truncated or not JSON: {err.msg} at byte {err.pos} of {len(text)})"
        ) from None
    found = data.get("format") if isinstance(data, dict) else None
    if found != fmt:
        raise ConfigError(f"{path} is not an mmdist {what} file (format {found!r}, expected {fmt!r})")
    if data.get("version") != VERSION:
        raise ConfigError(
            f"{path} is {what} format version {data.get('version')!r}; this mmdist reads version {VERSION} only "
            f"(plan the run again with this version)"
        )
    return data


def _decode(path: Path, body: dict[str, Any], cls: type, what: str) -> Any:
    try:
        return decode(body, cls)
    except (CodecError, TypeError, ValueError, KeyError, AttributeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path} is not a valid {what} file: {reason}") from None


def describe(planned: PlannedRun) -> str:
    plan = planned.plan
    program = plan.program
    return (
        f"{plan.strategy} plan of {planned.model.name} on {plan.devices} ranks of {planned.cluster.name} "
        f"({plan.precision}): {len(plan.units)} unit(s), {len(program.classes)} rank classes, "
        f"{program.num_instructions} instructions"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.plan_io", description="Check a written plan; describe it in one line.")
    parser.add_argument("source", type=Path, help="a run directory or its plan.json")
    parser.add_argument("--world-size", type=int, default=None, help="the number of workers a launcher will start")
    args = parser.parse_args(argv)
    try:
        planned = read_plan(args.source, args.world_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(describe(planned))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
