"""Typed, validated reading of one model config (the Hydra `model` group as a plain dict).

Every complaint is a ConfigError of one line that names the key, the bad value and what
would be valid. A key nobody read is an error too: a typo must not silently fall back to
a default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from src.bounds import MAX_SIZE, check_count
from src.errors import ConfigError


class Options:
    """Reads `model.*` keys; `None` in the config means "use the default"."""

    def __init__(self, cfg: Mapping[str, Any] | None, prefix: str = "model") -> None:
        self._cfg = dict(cfg or {})
        self._prefix = prefix
        self._read: set[str] = set()
        self._children: list[Options] = []

    def key(self, name: str) -> str:
        return f"{self._prefix}.{name}"

    def raw(self, name: str, default: Any = None) -> Any:
        self._read.add(name)
        value = self._cfg.get(name)
        return default if value is None else value

    def choice(self, name: str, choices: Iterable[str], default: str | None = None) -> str:
        options = list(choices)
        value = self.raw(name, default)
        if value not in options:
            raise ConfigError(f"{self.key(name)}={value!r} is not one of: {', '.join(options)}")
        return value

    def preset(self, name: str, choices: Iterable[str], default: str) -> str | None:
        """A preset name: absent means `default`, an explicit null means none (custom)."""
        if name in self._cfg and self._cfg[name] is None:
            self._read.add(name)
            return None
        return self.choice(name, choices, default)

    def positive_int(self, name: str, default: int | None = None, maximum: int = MAX_SIZE) -> int:
        """A positive integer of at most `maximum` (src.bounds: a count that fits memory)."""
        value = self.raw(name, default)
        if value is None:
            raise ConfigError(f"{self.key(name)} is required: give a positive integer")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{self.key(name)}={value!r} must be a positive integer")
        check_count(self.key(name), value, maximum)
        return value

    def number(self, name: str, default: float, low: float, high: float, why: str = "") -> float:
        """A finite number in [low, high] (`why`: what the bounds are, for the message)."""
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
            raise ConfigError(f"{self.key(name)}={value!r} must be a number from {low:g} to {high:g}{why}")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}={value!r} must be true or false")
        return value

    def optional_flag(self, name: str) -> bool | None:
        """A flag that may be left null (None: the builder's default)."""
        value = self.raw(name)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}={value!r} must be true, false or null")
        return value

    def names(self, name: str, default: list[str] | None = None) -> list[str] | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, str) or not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{self.key(name)}={value!r} must be a list of names")
        return list(value)

    def sub(self, name: str) -> Options:
        """A nested group (e.g. model.vision); None or absent is an empty group."""
        value = self.raw(name, {})
        if not isinstance(value, Mapping):
            raise ConfigError(f"{self.key(name)}={value!r} must be a group of keys")
        child = Options(value, self.key(name))
        self._children.append(child)
        return child

    def finish(self, model: str) -> None:
        """Reject keys no builder read (typos, knobs of another family)."""
        unknown = sorted(set(self._cfg) - self._read)
        if unknown:
            known = ", ".join(sorted(self._read)) or "none"
            raise ConfigError(f"{self.key(unknown[0])} is not a knob of model {model}; knobs of {self._prefix}: {known}")
        for child in self._children:
            child.finish(model)


def divisible(opts: Options, name: str, value: int, by_name: str, by: int) -> None:
    """`value` (from key `name`) must be divisible by `by` (from key `by_name`)."""
    if value % by:
        raise ConfigError(f"{opts.key(name)}={value} is not divisible by {by_name}={by}")


def no_seq_len(model: str, seq_len: int | None, knob: str) -> None:
    """Families without an LLM unit refuse train.seq_len rather than ignore it."""
    if seq_len is not None:
        raise ConfigError(f"train.seq_len={seq_len} does not apply to model {model} (it has no LLM unit); set {knob} instead")
