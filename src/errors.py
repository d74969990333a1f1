"""Errors a user can fix: the entry point prints their one-line message and exits 2."""

from __future__ import annotations

from typing import Any, Iterable, Mapping


class ConfigError(ValueError):
    """A configuration that is invalid or that no plan can serve."""


class DataError(ConfigError):
    """Training data that cannot be read (a shard or a member of one): the user's to fix."""


class PlanError(ConfigError):
    """A strategy cannot produce a plan for this model on this cluster (e.g. memory)."""


class PlanRefused(ConfigError):
    """A backend cannot run a plan as written. Its message names the plan's fields;
    `fields` lists them (a UnitPlan's: tp, pp, zero_stage, sequence_parallel, ...; a
    Work's: load, fraction, kernels; a route's: scatter; a collective's: blocking; the
    plan's: precision) and `units` the units they belong to: the door names the strategy
    options that set them."""

    def __init__(self, message: str, fields: tuple[str, ...], units: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields
        self.units = units


def reject_unknown(cfg: Mapping[str, Any], allowed: Iterable[str], what: str) -> None:
    """A key nobody reads is a typo: it must not silently fall back to a default."""
    allowed = set(allowed)
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ConfigError(f"unknown {what} {unknown}; valid: {sorted(allowed)}")


def expect_mapping(value: Any, key: str, example: str) -> None:
    """A scalar or a list where a group of settings goes (`cluster.peak_flops=1e15`) is
    named, with how to set one entry instead (`example`)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} is a group of settings, got {value!r}; set one entry of it, e.g. {example}")
