"""The work a plan places in a pass's TP bins (runtime.tp_bins) runs once the pass's last TP
collective is issued and before it is waited for (runtime.comm.BINS); a pass whose count is
being learned runs none of it. Collectives stood in for, no processes (the runs:
test_runtime_optimus, fine_grained_tp2)."""

from __future__ import annotations

import pytest

from src.errors import PlanRefused
from src.mesh import tensor_parallel
from src.program import Collective, Compute, Wait, Work
from src.runtime.checks import _check_work_under_tp
from src.runtime.comm import BINS, collective
from src.runtime.tp_bins import find_bins


class _Travelling:
    """A collective's work: says when it is waited for."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def _pass(log: list[str], collectives: int) -> None:
    """A pass of `collectives` TP collectives, each issued asynchronously while armed."""
    for n in range(collectives):

        def issue(async_op: bool, n: int = n) -> _Travelling | None:
            log.append(f"issue {n}")
            work = _Travelling(log, str(n))
            if async_op:
                return work
            work.wait()
            return None

        collective("tp", issue)


def test_the_bins_run_between_the_last_collective_s_issue_and_its_wait():
    log: list[str] = []
    with BINS.armed(2, lambda: log.append("bins")) as armed:
        _pass(log, 3)
    assert armed.count == 3
    assert log == ["issue 0", "wait 0", "issue 1", "wait 1", "issue 2", "bins", "wait 2"]
    assert not BINS.active


def test_a_pass_being_counted_runs_no_bins_and_the_bins_own_collectives_are_not_the_pass_s():
    log: list[str] = []
    with BINS.armed(-1, lambda: log.append("bins")) as armed:
        _pass(log, 2)
    assert armed.count == 2 and "bins" not in log
    inner: list[str] = []
    with BINS.armed(0, lambda: _pass(inner, 2)) as armed:
        _pass(log, 1)
    assert armed.count == 1  # the bins' two collectives were theirs
    assert inner == ["issue 0", "wait 0", "issue 1", "wait 1"]  # run blocking, as outside a pass


def test_outside_a_pass_a_collective_runs_blocking():
    log: list[str] = []
    _pass(log, 2)
    assert log == ["issue 0", "wait 0", "issue 1", "wait 1"]


def _pass_with_bins(chunks: int) -> list:
    """An LLM pass (in `chunks` row chunks: StepCCL's), its asynchronous TP all-reduce, an
    encoder pass placed while it travels, and its wait."""
    tp = tensor_parallel(2, False)
    return [
        Compute(Work("llm", "fwd", 1, (0, 2), sharding=tp, chunks=chunks, fraction=1 / chunks)),
        Collective("all_reduce", "tp.s0", 1024.0, "tp", stream="tp", blocking=False, handle="llm.tp.0"),
        Compute(Work("encoder", "fwd", 1, (0, 1))),
        Wait("llm.tp.0"),
    ]


def test_work_in_a_whole_pass_s_tp_bins_runs_and_under_any_other_is_refused():
    whole = _pass_with_bins(1)
    assert list(find_bins(whole)) == [0]
    _check_work_under_tp("stage 0", whole)
    chunked = _pass_with_bins(2)  # the LLM pass runs at its last chunk: no whole pass to run the bins in
    assert find_bins(chunked) == {}
    with pytest.raises(PlanRefused, match=r"encoder layers \(0, 1\) fwd run under the asynchronous TP all_reduce"):
        _check_work_under_tp("stage 0", chunked)


def test_bins_need_every_marker_waited_for():
    unwaited = _pass_with_bins(1)[:-1]  # the all-reduce never waited for: no bins to run
    assert find_bins(unwaited) == {}
    with pytest.raises(PlanRefused, match="run under the asynchronous TP all_reduce"):
        _check_work_under_tp("stage 0", unwaited)
