"""Independent jobs on all cores (joblib's worker processes), saying how far they are.

The jobs run past every check of their command (a job that cannot run returns the line
saying why), so their progress speaks by wall time (progress.heartbeat's `at_once`): a
worker's own lines would each start their clock anew, and the parent only waits.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from src.progress import heartbeat

Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]  # what joblib.delayed(f)(*args) makes


def _numbered(index: int, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, Any]:
    return index, function(*args, **kwargs)


def run_all(task: str, calls: Sequence[Call], jobs: int) -> list[Any]:
    """Each call's result, in the calls' order, computed on `jobs` processes as they come
    free; '<task> [N s]: k of n done' on stderr while they run."""
    from joblib import Parallel, delayed

    done: dict[int, Any] = {}
    with heartbeat(task, at_once=True, detail=lambda: f"{len(done)} of {len(calls)} done"):
        parallel = Parallel(n_jobs=min(jobs, len(calls)), return_as="generator_unordered")
        for index, result in parallel(delayed(_numbered)(i, *call) for i, call in enumerate(calls)):
            done[index] = result
    return [done[i] for i in range(len(calls))]
