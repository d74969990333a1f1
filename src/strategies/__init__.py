"""The registry from strategy names (conf/strategy/<name>.yaml's `name`) to their
descriptors (src/strategies/spec.py): the built-in strategies and `auto`.

A strategy written outside this package joins in one of two ways (docs/adding_a_strategy.md):
`register(name, strategy)` in the process that plans, or its import path as the name
(`strategy.name=my_package.my_module:STRATEGY`), which every process that plans finds. Either
names its descriptor, or its planner alone (`my_package.my_module:plan_mine`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from src.errors import ConfigError
from src.strategies.base import Planner, PlanRequest
from src.strategies.built_in import BUILT_IN, descriptor
from src.strategies.spec import StrategySpec


class Registry(MutableMapping[str, StrategySpec]):
    """Strategy names to descriptors; a built-in one's module is imported the first time its
    name is looked up (src/strategies/built_in.py says why), in order of registration."""

    def __init__(self, modules: dict[str, str]) -> None:
        self._entries: dict[str, StrategySpec | str] = dict(modules)  # a str: the module still to import

    def __getitem__(self, name: str) -> StrategySpec:
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = self._entries[name] = descriptor(entry, name)
        return entry

    def __setitem__(self, name: str, spec: StrategySpec) -> None:
        self._entries[name] = spec

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries  # without importing it

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


STRATEGIES = Registry({**BUILT_IN, "auto": "src.strategies.auto"})
RUN_FIELDS = {"precision": "train.precision", "load": "train.data"}  # plan fields every strategy takes from the run, not its options


def register(name: str, strategy: StrategySpec | Planner) -> None:
    """Plan strategy `name` as `strategy` describes it, or with a planner alone (a function
    of a PlanRequest returning a Plan)."""
    if not name or ":" in name:
        raise ValueError(f"strategy name {name!r}: a registered name is not empty and has no ':' (import paths do)")
    spec = strategy if isinstance(strategy, StrategySpec) else StrategySpec(name, strategy)
    if STRATEGIES.get(name, spec) != spec:
        raise ValueError(f"strategy {name!r} is already registered (to {STRATEGIES[name].planner.__module__})")
    STRATEGIES[name] = spec


def strategy_for(name: str) -> StrategySpec:
    """The strategy registered as `name`, or the descriptor or planner its import path names
    ("package.module:attribute")."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    module, colon, attribute = name.partition(":")
    if not colon:
        raise ConfigError(
            f"strategy {name!r} is not registered; available: {sorted(STRATEGIES)}, or the import path of a strategy's "
            f"descriptor or planner (package.module:STRATEGY or package.module:plan_function)"
        )
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"strategy {name!r}: cannot import its descriptor or planner ({err})") from None
    if isinstance(found, StrategySpec):
        return found
    if not callable(found):
        raise ConfigError(f"strategy {name!r}: {attribute} in {module} is a {type(found).__name__}, not a StrategySpec or a planner")
    return StrategySpec(name, found)


def planner_for(name: str) -> Planner:
    """The planner of the strategy `name` names (strategy_for)."""
    return strategy_for(name).planner


def software_settings(strategy: dict, precision: str, amp: bool) -> Mapping[str, Any]:
    """The model settings the software of `strategy` (its config group) fixes for a run in
    `precision` (`amp`: under PyTorch AMP), where its strategy models one codebase (model
    option -> value); none: the run's (the cluster preset's)."""
    rule = strategy_for(strategy["name"]).software
    return {} if rule is None else rule(strategy, precision, amp)


def option_keys(strategy: str, fields: tuple[str, ...], units: tuple[str, ...] = ()) -> list[str]:
    """The config keys that set `fields` of a `strategy` plan (of `units`, if given)."""
    table = {**RUN_FIELDS, **strategy_for(strategy).plan_fields}
    keys = []
    for name in fields:
        for unit in units or (None,):
            key = table.get(f"{unit}.{name}") or table.get(name)
            if key is not None and (unit is not None or "{unit}" not in key):
                keys.append(key.format(unit=unit))
    return list(dict.fromkeys(keys))


__all__ = [
    "STRATEGIES",
    "Planner",
    "PlanRequest",
    "StrategySpec",
    "option_keys",
    "planner_for",
    "register",
    "software_settings",
    "strategy_for",
]
