"""The registry from strategy names (conf/strategy/<name>.yaml's `name`) to planners."""
from __future__ import annotations

from src.errors import ConfigError
from src.strategies.base import Planner, PlanRequest
from src.strategies.ddp import plan_ddp
from src.strategies.distmm import plan_distmm
from src.strategies.disttrain import plan_disttrain
from src.strategies.megatron import plan_megatron

STRATEGIES: dict[str, Planner] = {
    "megatron": plan_megatron,
    "distmm": plan_distmm,
    "ddp": plan_ddp,
    "disttrain": plan_disttrain,
}


def planner_for(name: str) -> Planner:
    if name not in STRATEGIES:
        raise ConfigError(f"strategy {name!r} has no planner; available: {sorted(STRATEGIES)}")
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "PlanRequest", "planner_for"]
