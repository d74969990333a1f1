"""Errors of a real run that the front door reports in one line."""

import re
import signal

from src.errors import ConfigError, DataError, PlanError
from src.report.files import WriteError

# A worker's error line names its error's type: these are the user's to fix (exit 2).
_USERS = re.compile(rf": ({'|'.join(cls.__name__ for cls in (ConfigError, DataError, PlanError, WriteError))}): ")


class WorkerFailure(RuntimeError):
    """A worker process failed; the message is its error line."""

    @property
    def exit_code(self) -> int:
        """The front door's: 2 for an error the user can fix (bad data found at a step, a
        full disk), 1 for a failure of the run."""
        return 2 if _USERS.search(str(self)) else 1


class Terminated(WorkerFailure):
    """A signal ended the run (SIGTERM, or Ctrl-C's SIGINT); the front door stopped what it
    started. Exit code 128 + the signal's number, as a shell reports a process it killed."""

    def __init__(self, message: str, signum: int = signal.SIGTERM, results_written: bool = False) -> None:
        super().__init__(message)
        self.signum = signum
        self.results_written = results_written  # it came in the workers' teardown: the run's results stand

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class TerminateSignal(BaseException):
    """SIGTERM reached the front door: raised in its main thread wherever it is (as Ctrl-C
    raises KeyboardInterrupt), so that it stops what it started and says where it was
    (`doing`: what the process was doing when the signal came, src.progress.doing)."""

    def __init__(self, doing: str | None = None) -> None:
        super().__init__(doing)
        self.doing = doing


class InterruptSignal(KeyboardInterrupt):
    """Ctrl-C (SIGINT) reached the front door: as TerminateSignal."""

    def __init__(self, doing: str | None = None) -> None:
        super().__init__(doing)
        self.doing = doing


def signal_line(signalled: BaseException, default: str, known: str | None = None) -> tuple[str, int]:
    """How a run ended by `signalled` (a signal's exception, or a bare KeyboardInterrupt)
    begins its line, 'terminated by SIGTERM while planning ...' (`default`: what it was
    doing when the exception does not say; `known`: what the caller knows it was doing,
    ahead of what the exception says), and the signal."""
    doing = known or getattr(signalled, "doing", None) or default
    if isinstance(signalled, TerminateSignal):
        return f"terminated by SIGTERM while {doing}", signal.SIGTERM
    return f"interrupted by Ctrl-C (SIGINT) while {doing}", signal.SIGINT
