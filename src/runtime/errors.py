"""Errors of a real run that the front door reports in one line."""


class WorkerFailure(RuntimeError):
    """A worker process failed; the message is its error line."""
