"""The registry from strategy names (conf/strategy/<name>.yaml's `name`) to planners."""

from __future__ import annotations

from src.errors import ConfigError
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


def planner_for(name: str) -> Planner:
    if name not in STRATEGIES:
        raise ConfigError(f"strategy {name!r} has no planner; available: {sorted(STRATEGIES)}")
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "PlanRequest", "planner_for"]
