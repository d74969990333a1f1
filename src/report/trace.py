"""Chrome trace-event JSON of a Timeline; opens in Perfetto (ui.perfetto.dev) and
chrome://tracing. One process per RankTimeline (a class of identical ranks), one thread
per stream, one complete ("X") event per Span."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from src.collector import collector_paused
from src.program import COMPUTE_STREAM, compress_ranks
from src.report.files import writing
from src.timeline import RankTimeline, Timeline


def write_chrome_trace(timeline: Timeline, path: Path) -> None:
    # A large Program's trace is 10^5-10^6 short-lived dicts, none in a cycle: the
    # collector's passes over them would cost more than building them.
    with collector_paused():
        events: list[dict[str, Any]] = []
        # pids and tids start at 1: some viewers treat 0 as "no process/thread".
        for pid, rank_timeline in enumerate(timeline.ranks, start=1):
            events += _process_events(rank_timeline, pid)
        trace = {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"backend": timeline.backend, "iteration_time_s": timeline.iteration_time},
        }
        # orjson: a fraction of json.dumps's time on ~10^5 events.
        with writing(Path(path)):
            Path(path).write_bytes(orjson.dumps(trace))


_NO_ARGS: dict[str, Any] = {}


def _process_events(rank_timeline: RankTimeline, pid: int) -> list[dict[str, Any]]:
    ranks = f"ranks {compress_ranks(rank_timeline.ranks)}"
    name = f"{rank_timeline.label} ({ranks})" if rank_timeline.label else ranks
    events: list[dict[str, Any]] = [
        _meta("process_name", pid, {"name": name}),
        _meta("process_sort_index", pid, {"sort_index": pid}),
    ]
    if rank_timeline.units:
        events.append(_meta("process_labels", pid, {"labels": ",".join(rank_timeline.units)}))
    # Compute first, then the communication streams by name, so every process lays out
    # its threads the same way.
    streams = sorted({span.stream for span in rank_timeline.spans}, key=lambda stream: (stream != COMPUTE_STREAM, stream))
    tids = {stream: tid for tid, stream in enumerate(streams, start=1)}
    for stream, tid in tids.items():
        events.append(_meta("thread_name", pid, {"name": stream}, tid))
        events.append(_meta("thread_sort_index", pid, {"sort_index": tid}, tid))
    append = events.append  # a large Program's trace is 10^5-10^6 of these
    for span in rank_timeline.spans:
        # Unset fields (no unit, micro-batch -1) are left out rather than shown as noise;
        # an event with neither shares one empty dict (orjson only reads it).
        unit, microbatch = span.unit, span.microbatch
        args: dict[str, Any]
        if unit:
            args = {"unit": unit, "microbatch": microbatch} if microbatch >= 0 else {"unit": unit}
        else:
            args = {"microbatch": microbatch} if microbatch >= 0 else _NO_ARGS
        # Microseconds to the nanosecond. Start and end are rounded, then subtracted:
        # rounding start and duration apart makes back-to-back spans overlap by 1 ns,
        # and viewers drop an event that overlaps its track's previous one.
        start_ns, end_ns = round(span.start * 1e9), round(span.end * 1e9)
        append(
            {
                "ph": "X",
                "name": span.name,
                "cat": span.category,
                "pid": pid,
                "tid": tids[span.stream],
                "ts": start_ns / 1e3,
                "dur": (end_ns - start_ns) / 1e3,
                "args": args,
            }
        )
    return events


def _meta(name: str, pid: int, args: dict[str, Any], tid: int = 0) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}
