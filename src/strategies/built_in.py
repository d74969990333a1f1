"""The strategies this harness reproduces, each its package's one descriptor (`STRATEGY`),
in the order `strategy=auto` prices them (Megatron-LM, the baseline, first). `auto` is not
among them: it compares these, so the registry (src/strategies/__init__.py) adds it.

Named by the module that holds each descriptor, imported when the strategy is first asked
for: a command plans with one strategy, and importing every planner (and numpy with
DistTrain's) would cost each command's start a tenth of a second."""

from __future__ import annotations

import importlib

from src.strategies.spec import StrategySpec

BUILT_IN: dict[str, str] = {
    "megatron": "src.strategies.megatron.planner",
    "ddp": "src.strategies.ddp",
    "deepspeed3d": "src.strategies.deepspeed3d",
    "distmm": "src.strategies.distmm.planner",
    "disttrain": "src.strategies.disttrain.planner",
    "optimus": "src.strategies.optimus.planner",
    "par4d": "src.strategies.par4d.planner",
}


def descriptor(module: str, name: str) -> StrategySpec:
    """The descriptor `module` holds as STRATEGY, which must be named `name`."""
    spec = importlib.import_module(module).STRATEGY
    assert spec.name == name, f"{module}.STRATEGY is named {spec.name!r}, registered as {name!r}"
    return spec


def built_in() -> tuple[StrategySpec, ...]:
    """Every built-in strategy's descriptor, in BUILT_IN's order."""
    return tuple(descriptor(module, name) for name, module in BUILT_IN.items())
