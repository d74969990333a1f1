"""All sinks of one run behind one object: console, run files, Chrome trace, W&B.

Usage in run.py:
    with open_sinks(run_dir, config, JobInfo(...)) as sinks:
        ... sinks.log_step(record) per step ...
        sinks.finish(summary, timeline)
An exception inside the block closes the W&B run as failed and writes no summary.json.
"""
from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, Mapping

from src.report.console import format_step, format_summary
from src.report.files import RunFiles
from src.report.trace import write_chrome_trace
from src.report.wandb_sink import JobInfo, WandbSink
from src.timeline import Timeline

TRACE_FILE = "trace.json"


class Sinks:
    def __init__(self, run_dir: Path, files: RunFiles, wandb: WandbSink | None) -> None:
        self.run_dir = Path(run_dir)
        self._files = files
        self._wandb = wandb

    def log_step(self, record: Mapping[str, Any]) -> None:
        print(format_step(record), flush=True)
        self._files.log_step(record)
        if self._wandb is not None:
            self._wandb.log_step(record)

    def finish(self, summary: Mapping[str, Any], timeline: Timeline) -> None:
        trace_path = self.run_dir / TRACE_FILE
        write_chrome_trace(timeline, trace_path)
        self._files.finish(summary)  # summary.json is the last of our files
        print(format_summary(summary), flush=True)
        if self._wandb is not None:
            self._wandb.finish(summary, trace_path)

    def abort(self) -> None:
        if self._wandb is not None:
            self._wandb.abort()

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()


def open_sinks(run_dir: Path, config: Mapping[str, Any], job_info: JobInfo) -> Sinks:
    logger = (config.get("logger") or {}).get("name")
    wandb = WandbSink(run_dir, config, job_info) if logger == "wandb" else None
    return Sinks(run_dir, RunFiles(run_dir), wandb)
