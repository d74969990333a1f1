"""Optimus's encoder plans scheduled in parallel: each plan's bubble schedule depends on
the LLM's timeline and its own layout only (Optimus §4.1: the planner enumerates them
independently), so they run in worker processes forked from the planner, which inherit
the LLM's pipeline instead of receiving it, and send back what ranks them (the latency,
efficiencies and split; a schedule's placed kernels would cost more to send than to
place again): the planner schedules the split of a plan it emits again (`complete`).
The planner is one of the processes: it schedules the plans no worker has taken yet,
last first, and keeps their whole schedules (nothing to schedule again, one fork fewer).
Serial with one plan, one core, inside a daemon process (a pool's worker cannot start
processes of its own), or where the environment sets MMDIST_PLAN_WORKERS=1 (a shared
login node, the quick test tier); MMDIST_PLAN_WORKERS=n caps the processes at n."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from typing import Callable, Iterator

from src.errors import ConfigError
from src.strategies.optimus.encoder import Layout
from src.strategies.optimus.scheduler import Candidate, Schedule


# The job the forked workers run: set before the pool forks, read in the workers.
_JOB: Callable[[Layout], Candidate] | None = None
CAP_ENV = "MMDIST_PLAN_WORKERS"


def _run(layout: Layout) -> Candidate:
    assert _JOB is not None, "the pool forked after the job was set"
    found = _JOB(layout)
    s = found.schedule
    return replace(found, scheduler=None, schedule=Schedule(s.counts, s.pre, delta=s.delta, latency=s.latency))


def complete(again: Callable[[Candidate], Candidate], candidate: Candidate) -> Candidate:
    """A candidate with its whole schedule: its split scheduled again here (`again`) if it
    came from a worker."""
    return candidate if candidate.scheduler is not None else again(candidate)


def workers(jobs: int) -> int:
    """How many processes to schedule `jobs` plans on."""
    cap = _cap()
    if jobs < 2 or cap == 1 or multiprocessing.current_process().daemon or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(jobs, cores, cap or cores))


def _cap() -> int | None:
    """MMDIST_PLAN_WORKERS as a positive integer; None where it is unset."""
    value = os.environ.get(CAP_ENV)
    if value is None or value == "":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{CAP_ENV}={value!r}: the planner's worker processes must be a positive integer")
    return int(value)


def _untaken(futures: list[Future[Candidate]]) -> Iterator[int]:
    """The futures no worker has started, last first, each cancelled as it is reached (the
    workers take them first first): this process takes them."""
    return (i for i in reversed(range(len(futures))) if futures[i].cancel())


def schedule_all(job: Callable[[Layout], Candidate], layouts: list[Layout]) -> list[Candidate]:
    """job(layout) for every layout, in order."""
    global _JOB
    count = workers(len(layouts))
    if count == 1:
        return [job(layout) for layout in layouts]
    _JOB = job
    try:
        with ProcessPoolExecutor(count - 1, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_run, layout) for layout in layouts]
            here = {i: job(layouts[i]) for i in _untaken(futures)}
            return [here[i] if i in here else futures[i].result() for i in range(len(layouts))]
    finally:
        _JOB = None
