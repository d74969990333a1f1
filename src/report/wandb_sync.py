"""Log offline runs to Weights & Biases from their run directories (logger.mode=offline,
the default, keeps each run's W&B record in RUN_DIR/wandb.json and imports no wandb):

    python -m src.report.wandb_sync RUN_DIR [RUN_DIR ...]    # a run, or a multirun's directory: every run in it
    python -m src.report.wandb_sync --offline RUN_DIR        # W&B's own offline files instead, for `wandb sync`

Each run becomes the W&B run it would have been online: its config (with the chosen
plan), its step records from metrics.jsonl, its summary, the breakdown tables and
summary.json and trace.json as an Artifact; a figure's directory its figure run. All the
runs are logged from one process (wandb's import and service start once). A record once
logged in a mode is not logged again in it (wandb.json says so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from src.report.files import METRICS_FILE
from src.report.sinks import TRACE_FILE
from src.report.wandb_sink import RECORD_FILE, JobInfo, WandbRun, log_figure_now


def records_under(paths: list[Path]) -> list[Path]:
    """The W&B records of the runs at or under `paths`, in order."""
    found: list[Path] = []
    for path in paths:
        found += [path / RECORD_FILE] if (path / RECORD_FILE).is_file() else sorted(path.rglob(RECORD_FILE))
    return found


def sync(record_path: Path, mode: str) -> str:
    """Log one run (or figure) whose record is at `record_path`; a line saying what was done."""
    record = json.loads(record_path.read_text())
    run_dir = record_path.parent
    if mode in record.get("logged", []):
        return f"{run_dir}: already logged {mode}"
    if record["kind"] == "figure":
        log_figure_now(record["config"], run_dir, record["figure"], mode)
    else:
        run = WandbRun(run_dir, record["config"], JobInfo(**record["job"]), mode)
        if not run.active:
            return f"{run_dir}: not logged (see the wandb line above)"
        summary: dict[str, Any] | None = None
        for line in (run_dir / METRICS_FILE).read_text().splitlines():
            entry = json.loads(line)
            kind = entry.pop("type", None)
            if kind == "step":
                run.log_step(entry)
            elif kind == "summary":
                summary = entry
        if summary is None or record.get("failed"):
            run.abort()
        else:
            run.finish(summary, run_dir / TRACE_FILE)
    record["logged"] = [*record.get("logged", []), mode]
    record_path.write_text(json.dumps(record, sort_keys=True))
    return f"{run_dir}: logged {mode}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.report.wandb_sync", description="Log offline runs to W&B.")
    parser.add_argument("paths", nargs="+", type=Path, help="run directories, or directories holding runs (a multirun's)")
    parser.add_argument("--offline", action="store_true", help="write W&B's offline files (for `wandb sync`) instead of uploading")
    args = parser.parse_args(argv)
    records = records_under(args.paths)
    if not records:
        print(
            f"error: no {RECORD_FILE} under {', '.join(map(str, args.paths))} (runs with logger.mode=offline keep one)",
            file=sys.stderr,
        )
        return 2
    for path in records:
        print(sync(path, "offline" if args.offline else "online"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
