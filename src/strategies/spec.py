"""A strategy's one descriptor: everything the harness knows about it besides its config
group's YAML file (conf/strategy/<name>.yaml, whose keys are its options' fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from src.program import Plan
from src.strategies.base import Planner, PlanRequest


@dataclass(frozen=True)
class AutoVariant:
    """One contender `strategy=auto` prices: the strategy's planner with these options, every
    other option at its options dataclass's default (its config group's)."""

    label: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StrategySpec:
    """name: the config group's `name` (a plan's `strategy`).
    options: the options dataclass its planner reads the config group with (None: a
    strategy registered from outside with its planner alone).
    plan_fields: the options that set the plan fields a backend's refusal names
    (src.errors.PlanRefused), so the refusal can say which `strategy.X` to change;
    '{unit}' in an option stands for the unit the field belongs to, and a unit-specific
    field is written 'unit.field'.
    software: where the strategy models one codebase, the model settings that codebase's
    software fixes, from its config group: model option -> value (its attention kernel,
    how it reduces parameter gradients, how it computes the loss, the operations it runs
    unfused); the door builds the model with them where the model's own option is unset.
    auto_variants: the contenders `strategy=auto` compares it as (none: auto leaves it out).
    batches: plans once, on the first of the given global batches of the workload's data
    (PlanRequest.batch_index; None: uniform data, base.on_batch), and prices that plan on each
    of them, as a run keeps its choices from step to step: how src.balance_study sees an
    iteration's spread, and what a plan chosen for skewed data costs on uniform data (None:
    the strategy's plan is priced at the mean load whatever the data)."""

    name: str
    planner: Planner
    options: type | None = None
    plan_fields: Mapping[str, str] = field(default_factory=dict)
    software: Callable[[dict, str, bool], Mapping[str, Any]] | None = None
    auto_variants: tuple[AutoVariant, ...] = ()
    batches: Callable[[PlanRequest, Sequence[int | None]], list[Plan]] | None = None
