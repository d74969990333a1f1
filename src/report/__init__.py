"""Every sink of a run's results: console table, metrics.jsonl + summary.json, Chrome
trace, W&B. wandb itself is imported only when a W&B sink is opened."""

from src.report.console import format_step, format_summary
from src.report.files import RunFiles
from src.report.sinks import Sinks, open_sinks
from src.report.trace import write_chrome_trace
from src.report.wandb_sink import JobInfo, WandbSink

__all__ = ["JobInfo", "RunFiles", "Sinks", "WandbSink", "format_step", "format_summary", "open_sinks", "write_chrome_trace"]
