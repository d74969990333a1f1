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
    """The front door was sent SIGTERM while its workers ran; it stopped them."""

    @property
    def exit_code(self) -> int:
        return 128 + signal.SIGTERM
