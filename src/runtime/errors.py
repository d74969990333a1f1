"""Errors of a real run that the front door reports in one line."""

import re

from src.errors import ConfigError, DataError, PlanError

# A worker's error line names its error's type: these are the user's to fix (exit 2).
_USERS = re.compile(rf": ({'|'.join(cls.__name__ for cls in (ConfigError, DataError, PlanError))}): ")


class WorkerFailure(RuntimeError):
    """A worker process failed; the message is its error line."""

    @property
    def exit_code(self) -> int:
        """The front door's: 2 for an error in what the user gave (bad data found at a
        step, say), 1 for a failure of the run."""
        return 2 if _USERS.search(str(self)) else 1
