"""The strategies this harness reproduces, each its package's one descriptor, in the order
`strategy=auto` prices them (Megatron-LM, the baseline, first). `auto` is not among them:
it compares these, so the registry (src/strategies/__init__.py) adds it."""

from __future__ import annotations

from src.strategies.ddp import STRATEGY as DDP
from src.strategies.deepspeed3d import STRATEGY as DEEPSPEED3D
from src.strategies.distmm.planner import STRATEGY as DISTMM
from src.strategies.disttrain.planner import STRATEGY as DISTTRAIN
from src.strategies.megatron.planner import STRATEGY as MEGATRON
from src.strategies.optimus.planner import STRATEGY as OPTIMUS
from src.strategies.par4d.planner import STRATEGY as PAR4D
from src.strategies.spec import StrategySpec

BUILT_IN: tuple[StrategySpec, ...] = (
    MEGATRON,
    DDP,
    DEEPSPEED3D,
    DISTMM,
    DISTTRAIN,
    OPTIMUS,
    PAR4D,
)
