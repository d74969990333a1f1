"""All sinks of one run behind one object: console, run files, Chrome trace, W&B.

Usage in run.py:
    with open_sinks(run_dir, config, JobInfo(...)) as sinks:
        ... sinks.log_step(record) per step ...
        sinks.finish(summary, timeline)
An exception inside the block closes the W&B run as failed and writes no summary.json.
What the console shows (step lines, the summary table) goes to stdout and, through the
`results` logger, to the run's run.log: Hydra's logging config gives that logger its
file; a process without one (a real-backend worker) gets one for the run's lifetime.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping

from src.report.console import format_step, format_summary
from src.report.files import RunFiles, RunLogHandler, writing
from src.report.trace import write_chrome_trace
from src.report.wandb_sink import JobInfo, WandbSink
from src.timeline import Timeline

TRACE_FILE = "trace.json"
LOG_FILE = "run.log"
RESULTS = logging.getLogger("results")


class Sinks:
    def __init__(self, run_dir: Path, files: RunFiles, wandb: WandbSink | None) -> None:
        self.run_dir = Path(run_dir)
        self._files = files
        self._wandb = wandb
        self._own_log: logging.Handler | None = None
        if not RESULTS.handlers:
            with writing(self.run_dir / LOG_FILE):
                self._own_log = RunLogHandler(self.run_dir / LOG_FILE)
            self._own_log.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
            RESULTS.addHandler(self._own_log)
            RESULTS.setLevel(logging.INFO)
            RESULTS.propagate = False

    def _show(self, text: str) -> None:
        print(text, flush=True)
        RESULTS.info(text)

    def log_step(self, record: Mapping[str, Any]) -> None:
        self._files.log_step(record)  # first: a step whose record cannot be written is not shown as done
        self._show(format_step(record))
        if self._wandb is not None:
            self._wandb.log_step(record)

    def finish(self, summary: Mapping[str, Any], timeline: Timeline) -> None:
        trace_path = self.run_dir / TRACE_FILE
        write_chrome_trace(timeline, trace_path)
        self._files.finish(summary)  # summary.json is the last of our files
        self._show(format_summary(summary))
        if self._wandb is not None:
            self._wandb.finish(summary, trace_path)

    def abort(self) -> None:
        if self._wandb is not None:
            self._wandb.abort()

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        self.close()

    def close(self) -> None:
        if self._own_log is not None:
            RESULTS.removeHandler(self._own_log)
            self._own_log.close()
            self._own_log = None


def open_sinks(run_dir: Path, config: Mapping[str, Any], job_info: JobInfo) -> Sinks:
    logger = (config.get("logger") or {}).get("name")
    wandb = WandbSink(run_dir, config, job_info) if logger == "wandb" else None
    return Sinks(run_dir, RunFiles(run_dir), wandb)
