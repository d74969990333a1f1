"""The run directory's records: metrics.jsonl (one line per step, then the summary) and
summary.json (the final figures; its presence means the run succeeded)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


class RunFiles:
    def __init__(self, run_dir: Path) -> None:
        self.metrics_path = Path(run_dir) / METRICS_FILE
        self.summary_path = Path(run_dir) / SUMMARY_FILE
        # A reused run dir (hydra.run.dir=...) must not keep an earlier run's results: an
        # old summary.json would claim this run succeeded even if it fails, and old step
        # lines would mix with new ones.
        self.summary_path.unlink(missing_ok=True)
        self.metrics_path.write_text("")

    def log_step(self, record: Mapping[str, Any]) -> None:
        self._append({"type": "step", **record})

    def finish(self, summary: Mapping[str, Any]) -> None:
        """The summary line of metrics.jsonl, then summary.json, atomically and last, so
        that a run that fails before this point never leaves a summary.json behind."""
        self._append({"type": "summary", **summary})
        # Sorted keys and no timestamps: the same run gives a byte-identical file.
        text = json.dumps(summary, indent=2, sort_keys=True) + "\n"
        tmp = self.summary_path.with_name(f".{SUMMARY_FILE}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the rename must not publish a file still in cache only
        os.replace(tmp, self.summary_path)

    def _append(self, line: Mapping[str, Any]) -> None:
        # Opened per line: each record is on disk as soon as it is logged (a crashed run
        # keeps its steps) and no handle outlives the run.
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
