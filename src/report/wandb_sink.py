"""Weights & Biases: one more copy of a run's records, never the only one and never a
reason for a run to fail. Any exception from wandb (missing package, unwritable
directory, login) prints one warning line and turns this sink into a no-op; the run's own
files are written regardless. A server that cannot be reached costs at most INIT_TIMEOUT_S:
the run then logs offline and one line says how to sync it later.

wandb is imported only where it logs: logger.mode=online logs each step as the run makes
it; offline (the default) keeps the run's W&B record in the run directory (wandb.json: the
config with the chosen plan, the job's names), and `python -m src.report.wandb_sync
RUN_DIR...` logs it from the run's files later, many runs in one process (importing wandb
and starting its service costs about as much CPU as a small simulation); disabled logs nothing.

A run is named by its job, tagged by model, strategy, cluster and backend, grouped by
its sweep, with job_type the backend (sim or torch); its config is the composed one with
the chosen plan under `plan`; every step metric is plotted against `step`; summary.json
and trace.json are attached as an Artifact. A paper figure's multirun adds one run of
job_type 'figure', tagged by its jobs' models, strategies and clusters, with its table,
plot and files (log_figure)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from src.config import wandb_mode

INIT_TIMEOUT_S = 12  # wandb's own default waits 90 s for an unreachable server
RECORD_FILE = "wandb.json"  # an offline run's W&B record, for src.report.wandb_sync


@dataclass(frozen=True)
class JobInfo:
    """Where this run sits in Hydra (run.py fills it from HydraConfig).

    sweep_name: the multirun's sweep directory name, None for a single run.
    override_dirname: the job's overrides, e.g. "strategy=distmm,train.global_batch=1024".
    """

    run_name: str
    sweep_name: str | None = None
    override_dirname: str | None = None


class WandbSink:
    """The run's W&B copy: live where logger.mode is online, else (offline) its record kept
    for wandb_sync; nothing where it is disabled."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any], job: JobInfo) -> None:
        self._run_dir, self._config, self._job = Path(run_dir), config, job
        self._mode = wandb_mode(config.get("logger") or {})
        self._live = WandbRun(run_dir, config, job, self._mode) if self._mode == "online" else None

    def log_step(self, record: Mapping[str, Any]) -> None:
        if self._live is not None:
            self._live.log_step(record)

    def finish(self, summary: Mapping[str, Any], trace_path: Path | None = None) -> None:
        if self._live is not None:
            self._live.finish(summary, trace_path)
        elif self._mode == "offline":
            self._keep(summary.get("plan"), failed=False)

    def abort(self) -> None:
        if self._live is not None:
            self._live.abort()
        elif self._mode == "offline":
            self._keep(None, failed=True)

    def _keep(self, plan: Any, failed: bool) -> None:
        """The offline run's W&B record: what wandb_sync needs beside metrics.jsonl,
        summary.json and trace.json."""
        record = {"kind": "run", "config": with_plan(self._config, plan), "job": dataclasses.asdict(self._job), "failed": failed}
        try:
            (self._run_dir / RECORD_FILE).write_text(json.dumps(record, sort_keys=True))
        except OSError as exc:
            print(f"wandb: not kept for this run: {f'{type(exc).__name__}: {exc}'.splitlines()[0]}", file=sys.stderr, flush=True)


def with_plan(config: Mapping[str, Any], plan: Any) -> dict[str, Any]:
    """The config W&B holds: the composed one, with the plan the strategy chose (its
    degrees, not the null ones requested; a search's report left out) under `plan`."""
    if not isinstance(plan, Mapping):
        return dict(config)
    return {**config, "plan": _without_search(plan)}


def _without_search(plan: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _without_search(v) if isinstance(v, Mapping) else v for k, v in plan.items() if k != "search"}


class WandbRun:
    """A live W&B run of one of ours (`mode`: online, or offline for W&B's own offline files)."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any], job: JobInfo, mode: str) -> None:
        self._run: Any = None
        self._last_step: int | None = None
        try:
            self._run = _start(Path(run_dir), config, job, mode)
        except Exception as exc:  # noqa: BLE001 - whatever wandb raises only costs us W&B
            self._disable(exc)

    @property
    def active(self) -> bool:
        return self._run is not None

    def log_step(self, record: Mapping[str, Any]) -> None:
        if self._run is None:
            return
        try:
            if "step" in record:
                self._last_step = int(record["step"])
            self._run.log(dict(_scalars(record)), step=self._last_step)
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def finish(self, summary: Mapping[str, Any], trace_path: Path | None = None) -> None:
        """Final figures into run.summary, the breakdown as a table and a bar chart, the
        trace attached; then close the W&B run (a multirun's next job starts a new one)."""
        if self._run is None:
            return
        try:
            import wandb

            if isinstance(summary.get("plan"), Mapping):
                self._run.config.update({"plan": _without_search(summary["plan"])}, allow_val_change=True)
            self._run.summary.update(_scalars(summary))
            tables = _breakdown_tables(wandb, summary)
            if tables:
                # At the last step, so the tables do not add a step to the history.
                self._run.log(tables, step=self._last_step)
            if trace_path is not None:
                # An Artifact works offline too: it is uploaded when the run is synced.
                artifact = wandb.Artifact(f"results-{self._run.id}", type="run-results")
                for path in (Path(trace_path), Path(trace_path).with_name("summary.json")):
                    if path.exists():
                        artifact.add_file(str(path))
                self._run.log_artifact(artifact)
            self._run.finish()
            self._run = None
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def abort(self) -> None:
        """Close the W&B run as failed: the run raised before finish()."""
        if self._run is None:
            return
        try:
            self._run.finish(exit_code=1)
            self._run = None
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def _disable(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(f"wandb: disabled for this run: {reason}", file=sys.stderr, flush=True)
        run, self._run = self._run, None
        if run is not None:
            # Close a half-broken run so that the next job of a multirun can start one.
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001 - already reported; the run goes on
                pass


def log_figure(config: Mapping[str, Any], out: Path, figure: str) -> None:
    """A paper figure's results as one W&B run (job_type 'figure', grouped with its jobs):
    the table with the paper's values beside ours, the plot, and results.json/md/png as an
    Artifact. Nothing happens unless the multirun logs to W&B (offline: its record is kept
    for wandb_sync); a failure costs only W&B."""
    logger = config.get("logger") or {}
    if logger.get("name") != "wandb":
        return
    mode = wandb_mode(logger)
    if mode == "offline":
        (out / RECORD_FILE).write_text(json.dumps({"kind": "figure", "figure": figure, "config": dict(config)}, sort_keys=True))
    elif mode == "online":
        log_figure_now(config, out, figure, mode)


def log_figure_now(config: Mapping[str, Any], out: Path, figure: str, mode: str) -> None:
    """log_figure's W&B run, made now (`mode`: online, or offline for W&B's own files)."""
    try:
        import wandb

        run = _start(out, _figure_config(config, out, figure), JobInfo(run_name=figure, sweep_name=out.name), mode)
        results = json.loads((out / "results.json").read_text())
        columns: list[str | int] = ["group", "series", "value", "paper"]
        rows = [[r["group"], r["series"], r.get("value"), json.dumps(r.get("paper"))] for r in results["rows"]]
        logged: dict[str, Any] = {"results": wandb.Table(columns=columns, data=rows)}
        plot = out / f"{figure}.png"
        if plot.exists():
            logged["figure"] = wandb.Image(str(plot))
        run.log(logged)
        artifact = wandb.Artifact(f"figure-{figure}-{run.id}", type="figure-results")
        for path in (out / "results.json", out / "results.md", plot):
            if path.exists():
                artifact.add_file(str(path))
        run.log_artifact(artifact)
        run.finish()
    except Exception as exc:  # noqa: BLE001 - whatever wandb raises only costs us W&B
        print(f"wandb: figure {figure} not logged: {f'{type(exc).__name__}: {exc}'.splitlines()[0]}", file=sys.stderr, flush=True)


def _figure_config(config: Mapping[str, Any], out: Path, figure: str) -> dict[str, Any]:
    """A figure run's config, from its own jobs (their resolved.yaml): the models,
    strategies and clusters they ran (its tags), not the multirun's defaults."""
    jobs = [yaml.safe_load(path.read_text()) or {} for path in sorted(out.glob("*/resolved.yaml"))]
    own: dict[str, Any] = {"logger": config.get("logger") or {}, "backend": {"name": "figure"}, "figure": figure}
    for group in ("model", "strategy", "cluster"):
        names = sorted({str(name) for job in jobs if (name := _name_of(job.get(group))) is not None})
        own[group] = {"name": names[0] if len(names) == 1 else None, "names": names}
    return own


def _start(run_dir: Path, config: Mapping[str, Any], job: JobInfo, mode: str) -> Any:
    logger = config.get("logger") or {}
    # wandb's banners and sync hints are noise in our output; a user's own WANDB_SILENT wins.
    os.environ.setdefault("WANDB_SILENT", "true")
    # The run dir keeps W&B's files beside ours unless the user chose a WANDB_DIR. Passed
    # as dir=, not set in os.environ, so the next job of a multirun gets its own run dir.
    wandb_dir = Path(os.environ.get("WANDB_DIR") or run_dir)
    # wandb itself silently falls back to /tmp when it cannot write its directory; we
    # would rather say so and go on without it.
    wandb_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(wandb_dir, os.W_OK):
        raise PermissionError(f"cannot write to WANDB_DIR {wandb_dir}")

    import wandb

    name = job.run_name
    if job.sweep_name is not None and job.override_dirname:
        name = f"{name} {job.override_dirname}"  # jobs of one sweep differ by their overrides
    backend = (config.get("backend") or {}).get("name")
    names = [name for group in ("model", "strategy", "cluster") for name in _names_of(config.get(group))]
    settings: dict[str, Any] = dict(
        silent=True,
        # Our stdout already goes to the terminal and the job log; the step records
        # reach W&B as metrics, so capturing the console would only duplicate them.
        console="off",
        # System metrics of the machine that runs the simulator say nothing about the
        # simulated cluster.
        x_disable_stats=backend == "sim",
        init_timeout=INIT_TIMEOUT_S,
    )
    init: dict[str, Any] = dict(
        project=logger.get("project"),
        entity=logger.get("entity"),
        group=logger.get("group") or job.sweep_name,
        name=name,
        job_type=backend,
        tags=[*dict.fromkeys([*filter(None, [*names, backend]), *(logger.get("tags") or [])])],
        config=dict(config),
        dir=str(wandb_dir),
        mode=mode,
    )
    try:
        run = wandb.init(**init, settings=wandb.Settings(**settings))
    except wandb.errors.CommError as exc:
        if init["mode"] != "online":
            raise
        run = wandb.init(**{**init, "mode": "offline"}, settings=wandb.Settings(**settings))
        reason = str(exc).splitlines()[0]
        print(
            f"wandb: server unreachable ({reason}); logging offline: sync later with `wandb sync {run.dir.removesuffix('/files')}`",
            file=sys.stderr,
            flush=True,
        )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


def _name_of(group: Any) -> str | None:
    return group.get("name") if isinstance(group, Mapping) else None


def _names_of(group: Any) -> list[str]:
    """A config group's name, or (a figure's) the names of its jobs'."""
    if not isinstance(group, Mapping):
        return []
    return [str(n) for n in group.get("names") or [group.get("name")] if n is not None]


def _scalars(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every scalar leaf of the summary, nested keys joined by '/' (W&B's grouping), so
    runs can be compared by any figure in the W&B runs table. Lists are left out."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float, str, bool)):
            out[f"{prefix}{key}"] = value
    return out


def _breakdown_tables(wandb: Any, summary: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mean = summary.get("breakdown_s")
    if isinstance(mean, Mapping) and mean:
        iteration = summary.get("iteration_time_s") or 0.0
        table = wandb.Table(
            columns=["category", "seconds", "percent"],
            data=[[cat, seconds, 100 * seconds / iteration if iteration else None] for cat, seconds in mean.items()],
        )
        out["breakdown"] = table
        out["breakdown_chart"] = wandb.plot.bar(table, "category", "seconds", title="time breakdown (s, mean over ranks)")
    by_unit = summary.get("breakdown_by_unit_s")
    if isinstance(by_unit, Mapping) and by_unit:
        rows = [[unit, cat, seconds] for unit, cats in by_unit.items() for cat, seconds in cats.items()]
        out["breakdown_by_unit"] = wandb.Table(columns=["unit", "category", "seconds"], data=rows)
    return out
