"""Optimus's encoder plans scheduled ahead in parallel: each plan's bubble schedule
depends on the LLM's timeline and its own layout only (Optimus §4.1: the planner enumerates
them independently), so they run in worker processes forked from the planner, which inherit
the LLM's pipeline and the plans' schedulers instead of receiving them, and send back what
ranks them (the latency, efficiencies and split; a schedule's placed kernels would cost more
to send than to place again): the planner schedules the split of a plan it emits again
(`complete`). The planner asks for the plans one at a time, in the order it may need them
(it stops once no plan left can beat the best found); while it schedules the one it asks
for, the workers schedule the next ones, which it takes from them when it asks for them (or
schedules itself, if no worker has started one yet). What the planner gets is the same
whatever the number of processes: a plan scheduled ahead and never asked for is dropped.
Serial with one plan, one core, inside a daemon process (a pool's worker cannot start
processes of its own), or where the environment sets MMDIST_PLAN_WORKERS=1 (a shared
login node, the quick test tier); MMDIST_PLAN_WORKERS=n caps the processes at n."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from typing import Callable

from src.errors import ConfigError
from src.strategies.optimus.scheduler import Candidate, Schedule


# The job the forked workers run: set before the pool forks, read in the workers.
_JOB: Callable[[int], Candidate] | None = None
CAP_ENV = "MMDIST_PLAN_WORKERS"


def _run(index: int) -> Candidate:
    assert _JOB is not None, "the pool forked after the job was set"
    found = _JOB(index)
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


def _take(future: Future[Candidate]) -> bool:
    """Whether this process takes a plan asked for from the worker meant for it: it does where
    no worker has started it yet (cancelled here)."""
    return future.cancel()


class Ahead:
    """job(i) for the plans 0 .. jobs-1 the planner asks for (`ahead[i]`), each once, the
    next ones scheduled in worker processes meanwhile. Use it as a context manager: the
    workers end with it (a plan still being scheduled ahead is waited for, then dropped)."""

    def __init__(self, job: Callable[[int], Candidate], jobs: int) -> None:
        self.job, self.jobs = job, jobs
        self.count = workers(jobs)
        self.done: dict[int, Candidate] = {}
        self.futures: dict[int, Future[Candidate]] = {}
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Ahead:
        global _JOB
        if self.count > 1:
            _JOB = self.job
            self.pool = ProcessPoolExecutor(self.count - 1, mp_context=multiprocessing.get_context("fork"))
        return self

    def __exit__(self, *exc: object) -> None:
        global _JOB
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            _JOB = None

    def __getitem__(self, index: int) -> Candidate:
        if index in self.done:
            return self.done[index]
        if self.pool is not None:  # the workers take the plans after this one
            for ahead in range(index + 1, min(index + self.count, self.jobs)):
                if ahead not in self.done and ahead not in self.futures:
                    self.futures[ahead] = self.pool.submit(_run, ahead)
        future = self.futures.pop(index, None)
        found = self.job(index) if future is None or _take(future) else future.result()
        self.done[index] = found
        return found
