"""Collectives the runtime's layers issue, timed by kind.

Communication that happens inside a compute instruction (a TP layer's all-reduce, the
batch-sync all-gather's backward, DeepSpeed's ZeRO collectives) is timed here, so the
executor can split the instruction's wall time into compute and exposed communication of
the right kind.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from src.runtime.device import synchronize

# The single-tensor all-gather and reduce-scatter under their current names: torch 2.13
# deprecates all_gather_into_tensor and reduce_scatter_tensor (a FutureWarning from each
# call site on each rank) for these, which earlier releases lack.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommClock:
    """Seconds spent in collectives per kind since the last `take()`. On a GPU the device
    is synchronised around each, so the seconds are the collective's own."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)
        self.device = torch.device("cpu")

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self._seconds[kind] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        # Taken after every instruction, most of which time nothing: that case does little.
        if not self._seconds:
            return {}
        out = {kind: seconds for kind, seconds in self._seconds.items() if seconds > 0}
        self._seconds.clear()
        return out


CLOCK = CommClock()


class TPBins:
    """What a plan runs while a pass's TP collectives travel (Optimus's encoder kernels in
    the TP bins of an LLM operation: runtime.tp_bins), run once the pass's last TP
    collective is issued and before it is waited for. Running them at the last adds no
    dependency the plan lacks: every TP peer has issued all of the pass's collectives before
    it runs its own. The executor arms one pass at a time (`armed`) with the index of its
    last TP collective, learned from its first run (`count`), whose work it runs after it."""

    def __init__(self) -> None:
        self.active = False
        self.count = 0
        self._at = -1
        self._work: Callable[[], None] | None = None

    @contextmanager
    def armed(self, at: int, work: Callable[[], None]) -> Iterator[TPBins]:
        """Count the TP collectives of the pass run inside; run `work` at the one of index
        `at` (-1: none, the count being learned)."""
        self.active, self.count, self._at, self._work = True, 0, at, work
        try:
            yield self
        finally:
            self.active, self._work = False, None

    def issued(self) -> None:
        """A TP collective of the armed pass is on its way: its bins run here if it is theirs
        (their own collectives are theirs, not the pass's)."""
        index, self.count = self.count, self.count + 1
        if index == self._at and self._work is not None:
            work, self._work, self.active = self._work, None, False
            try:
                work()
            finally:
                self.active = True


BINS = TPBins()


def collective(kind: str, issue: Callable[[bool], dist.Work | None]) -> None:
    """Run a collective (`issue(async_op)`), timed by kind; a TP collective of a pass armed
    with bins (BINS) travels while they run."""
    if kind == "tp" and BINS.active:
        work = issue(True)
        BINS.issued()
        with CLOCK.timed(kind):
            assert work is not None, "an asynchronous collective returns its work"
            work.wait()
        return
    with CLOCK.timed(kind):
        issue(False)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, kind: str) -> torch.Tensor:
    collective(kind, lambda async_op: dist.all_reduce(tensor, group=group, async_op=async_op))
    return tensor


def chunked_all_reduce(
    chunks: Iterable[torch.Tensor], group: dist.ProcessGroup | None, kind: str, then: Callable[[], None] | None = None
) -> list[torch.Tensor]:
    """StepCCL's overlap: each chunk's all-reduce starts as soon as the chunk is computed,
    so it travels while the next chunk's GEMM runs (`chunks` computes them lazily), and
    `then` (more compute) runs before all are waited for. Only the waits are charged to
    `kind`: the communication the compute did not hide."""
    reduced, handles = [], []
    for chunk in chunks:
        handles.append(dist.all_reduce(chunk, group=group, async_op=True))
        reduced.append(chunk)
    if then is not None:
        then()
    if kind == "tp" and BINS.active:
        BINS.issued()
    with CLOCK.timed(kind):
        for handle in handles:
            handle.wait()
    return reduced
