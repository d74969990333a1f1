"""Errors a user can fix: the entry point prints their one-line message and exits 2."""


class ConfigError(ValueError):
    """A configuration that is invalid or that no plan can serve."""


class PlanError(ConfigError):
    """A strategy cannot produce a plan for this model on this cluster (e.g. memory)."""
