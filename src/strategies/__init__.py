"""The registry from strategy names (conf/strategy/<name>.yaml's `name`) to planners.

A strategy written outside this package joins in one of two ways (docs/adding_a_strategy.md):
`register(name, planner)` in the process that plans, or its import path as the name
(`strategy.name=my_package.my_module:plan_mine`), which every process that plans finds.
"""

from __future__ import annotations

import importlib
from typing import Callable

from src.errors import ConfigError
from src.strategies import ddp, deepspeed3d, distmm, disttrain, megatron, optimus, par4d
from src.strategies.auto import plan_auto
from src.strategies.base import Planner, PlanRequest
from src.strategies.ddp import plan_ddp
from src.strategies.deepspeed3d import plan_deepspeed3d
from src.strategies.distmm.planner import plan_distmm
from src.strategies.disttrain.planner import plan_disttrain
from src.strategies.megatron.planner import plan_megatron
from src.strategies.optimus.planner import plan_optimus
from src.strategies.par4d.planner import plan_par4d

STRATEGIES: dict[str, Planner] = {
    "megatron": plan_megatron,
    "distmm": plan_distmm,
    "ddp": plan_ddp,
    "par4d": plan_par4d,
    "deepspeed3d": plan_deepspeed3d,
    "optimus": plan_optimus,
    "disttrain": plan_disttrain,
    "auto": plan_auto,
}


# Per strategy, the options that set the plan fields a backend's refusal names (each
# strategy's own table; strategy=auto's plan is its winner's, under the winner's name).
PLAN_FIELDS: dict[str, dict[str, str]] = {
    "megatron": megatron.PLAN_FIELDS,
    "distmm": distmm.PLAN_FIELDS,
    "ddp": ddp.PLAN_FIELDS,
    "par4d": par4d.PLAN_FIELDS,
    "deepspeed3d": deepspeed3d.PLAN_FIELDS,
    "optimus": optimus.PLAN_FIELDS,
    "disttrain": disttrain.PLAN_FIELDS,
}
RUN_FIELDS = {"precision": "train.precision", "load": "train.data"}  # plan fields every strategy takes from the run, not its options
# Per strategy that models one codebase, the attention kernel that codebase runs (from its
# options): the door builds the model with it unless model.attention is set.
SOFTWARE_ATTENTION: dict[str, Callable[[dict], str | None]] = {"deepspeed3d": deepspeed3d.software_attention}


def register(name: str, planner: Planner) -> None:
    """Plan strategy `name` with `planner`, a function of a PlanRequest returning a Plan."""
    if not name or ":" in name:
        raise ValueError(f"strategy name {name!r}: a registered name is not empty and has no ':' (import paths do)")
    if STRATEGIES.get(name, planner) is not planner:
        raise ValueError(f"strategy {name!r} is already registered (to {STRATEGIES[name].__module__})")
    STRATEGIES[name] = planner


def planner_for(name: str) -> Planner:
    """The planner registered as `name`, or the one its import path names
    ("package.module:function")."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    module, colon, attribute = name.partition(":")
    if not colon:
        raise ConfigError(
            f"strategy {name!r} has no planner; available: {sorted(STRATEGIES)}, or a planner's import path (package.module:function)"
        )
    try:
        planner = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"strategy {name!r}: cannot import its planner ({err})") from None
    if not callable(planner):
        raise ConfigError(f"strategy {name!r}: {attribute} in {module} is a {type(planner).__name__}, not a planner")
    return planner


def software_attention(strategy: dict) -> str | None:
    """The attention kernel the software of `strategy` (its config group) runs, where its
    strategy models one codebase; None: the run's (the cluster preset's)."""
    rule = SOFTWARE_ATTENTION.get(strategy["name"])
    return None if rule is None else rule(strategy)


def option_keys(strategy: str, fields: tuple[str, ...], units: tuple[str, ...] = ()) -> list[str]:
    """The config keys that set `fields` of a `strategy` plan (of `units`, if given)."""
    table = {**RUN_FIELDS, **PLAN_FIELDS.get(strategy, {})}
    keys = []
    for name in fields:
        for unit in units or (None,):
            key = table.get(f"{unit}.{name}") or table.get(name)
            if key is not None and (unit is not None or "{unit}" not in key):
                keys.append(key.format(unit=unit))
    return list(dict.fromkeys(keys))


__all__ = ["PLAN_FIELDS", "STRATEGIES", "Planner", "PlanRequest", "option_keys", "planner_for", "register", "software_attention"]
