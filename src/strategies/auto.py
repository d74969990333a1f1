"""Every strategy on one model and cluster, priced by the simulator; `strategy=auto` runs
the fastest.

The contenders are the systems this harness reproduces, each with its own config group's
defaults (every option left to its planner's search) and the variants the papers compare
against: Megatron-LM and its balanced pipeline (Optimus App. B), ZeRO-3/FSDP, DeepSpeed's
3D parallelism, DistMM (contrastive models), DistTrain and Optimus (MLLMs), Par4D. A
contender whose planner refuses the model (it does not apply) or finds no plan that fits
is listed with its one-line reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from src.config import options_from
from src.errors import ConfigError, PlanError
from src.program import Plan
from src.progress import Progress
from src.sim.engine import SimulationError, simulate
from src.strategies.base import Planner, PlanRequest
from src.strategies.built_in import built_in
from src.strategies.spec import StrategySpec
from src.timeline import Timeline


@dataclass(frozen=True)
class Contender:
    """A built-in strategy's variant (spec.AutoVariant) with the strategy's planner."""

    label: str
    planner: Planner
    options: Mapping[str, Any] = field(default_factory=dict)


@functools.cache
def contenders() -> tuple[Contender, ...]:
    """Each built-in strategy's variants, as its descriptor lists them (auto is not among them)."""
    return tuple(Contender(variant.label, spec.planner, variant.options) for spec in built_in() for variant in spec.auto_variants)


@dataclass(frozen=True)
class AutoOptions:
    """contenders: the labels to compare (null: all of contenders())."""

    contenders: list[str] | None = None

    def __post_init__(self) -> None:
        labels = [c.label for c in contenders()]
        if self.contenders is not None:
            unknown = [c for c in self.contenders if c not in labels]
            if unknown or not self.contenders:
                raise ConfigError(f"strategy.contenders={self.contenders}: choose among {labels} (null: all)")

    def chosen(self) -> list[Contender]:
        return [c for c in contenders() if self.contenders is None or c.label in self.contenders]


@dataclass
class Priced:
    label: str
    plan: Plan | None = None
    timeline: Timeline | None = None
    reason: str = ""

    @property
    def iteration_time_s(self) -> float:
        assert self.timeline is not None
        return self.timeline.iteration_time


def price(contender: Contender, request: PlanRequest) -> Priced:
    """Plan and simulate one contender (its refusal is an outcome, not an error)."""
    try:
        if contender.label == "megatron-balanced" and len(request.model.units) == 1:
            raise PlanError("one unit: balancing the pipeline is Megatron-LM's own stage cut")
        plan = contender.planner(replace(request, options=contender.options))
        if plan.devices > request.cluster.devices:
            raise PlanError(f"plan uses {plan.devices} devices but the cluster has {request.cluster.devices}")
        timeline = simulate(plan.program, request.model, request.cluster, request.train.precision)
    except (ConfigError, SimulationError) as err:
        return Priced(contender.label, reason=str(err))
    return Priced(contender.label, plan, timeline)


def plan_auto(request: PlanRequest) -> Plan:
    opts = options_from(AutoOptions, request.options)
    progress = Progress("auto")
    priced = []
    for index, contender in enumerate(opts.chosen()):
        priced.append(price(contender, request))
        if progress.due():
            progress.show(f"{index + 1}/{len(opts.chosen())} strategies priced (last: {contender.label})")
    ranked = sorted((p for p in priced if p.plan is not None), key=lambda p: p.iteration_time_s)
    if not ranked:
        raise PlanError(
            "no strategy has a plan for this model on this cluster: " + "; ".join(f"{p.label}: {p.reason}" for p in priced)
        )
    winner = ranked[0]
    assert winner.plan is not None
    choice: dict[str, Any] = {"winner": winner.label, "winner_iteration_time_s": winner.iteration_time_s}
    if len(ranked) > 1:
        runner_up = ranked[1]
        choice.update(
            runner_up=runner_up.label,
            runner_up_iteration_time_s=runner_up.iteration_time_s,
            margin_pct=100.0 * (runner_up.iteration_time_s / winner.iteration_time_s - 1.0),
        )
    choice["ranking"] = [{"strategy": p.label, "iteration_time_s": p.iteration_time_s} for p in ranked]
    choice["refused"] = {p.label: p.reason for p in priced if p.plan is None}
    winner.plan.details["auto"] = choice
    return winner.plan


STRATEGY = StrategySpec("auto", plan_auto, AutoOptions)
