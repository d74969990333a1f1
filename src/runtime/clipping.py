"""Which plans the real backend clips (backend.deepspeed.gradient_clipping), and by which
norm: the model's, as one process clips it. Where one engine holds every trained parameter
on every rank, its own norm is the model's; on a pipeline whose every rank holds its trained
parameters in one engine whose norm the harness takes before the update, each stage's norm
reduced over the stages is (runtime.optimizer.over_stages); anything else is refused in one
line, since DeepSpeed's ZeRO-1/2/3 engines clip by their own norm inside their step.
"""

from __future__ import annotations

from src.config import DeepSpeedSpec
from src.errors import ConfigError
from src.mesh import Mesh
from src.models.spec import ModelSpec
from src.program import Plan
from src.runtime.dist_optimizer import sharded_units
from src.runtime.layouts import layout_runtime
from src.runtime.placement import UnitPlacement, placements


def _engines(plan: Plan, model: ModelSpec, rank: int) -> tuple[dict[str, UnitPlacement], list[str], set[tuple]]:
    """What `rank` holds, the trained units it holds layers of, and the engines they fall
    into (units on one data-parallel group and ZeRO setting share one: runtime.session)."""
    places = placements(plan, rank)
    held = [n for n, place in places.items() if model.unit(n).trainable_params() and place.layers]
    keys = {(places[n].dp_ranks, places[n].tp_ranks, plan.unit(n).zero_stage, plan.unit(n).overlap_comm) for n in held}
    return places, held, keys


def clipping_pipeline(plan: Plan, model: ModelSpec) -> Mesh | None:
    """The pipeline over whose stages every rank reduces its engine's gradient norm to clip
    by the model's (ParallelGroups.pp: its PP group), or None where the plan has none such:
    a trained unit's mesh spans every rank on pipeline stages, and every rank holds its
    trained parameters in one engine whose norm the harness takes before the update (ZeRO-0's
    hook, runtime.optimizer; the plan's distributed optimizer, runtime.dist_optimizer), so
    each rank joins one reduction of the norm a step. DeepSpeed's ZeRO-1/2/3 engines clip by
    their own norm inside their step."""
    trained = [u for u in plan.units if model.unit(u.unit).trainable_params()]
    whole = [u.mesh for u in trained if u.mesh.size == plan.devices and u.mesh.degree("pp") > 1]
    if not whole or any(layout_runtime(u) is not None for u in trained):
        return None
    for rank in range(plan.devices):
        _, held, keys = _engines(plan, model, rank)
        own = sharded_units(plan, rank)
        if not held or len(keys) > 1 or any(n in own for n in held) and len(held) > 1:
            return None
        if any(n not in own and plan.unit(n).zero_stage != 0 for n in held):
            return None
    return whole[0]


def check_clipping(plan: Plan, model: ModelSpec, settings: DeepSpeedSpec) -> None:
    """gradient_clipping clips the model's global norm: where one engine holds every trained
    parameter on every rank, by that engine's norm; on a pipeline whose every rank has one
    engine whose norm the harness takes (clipping_pipeline), by that norm reduced over the
    stages. Elsewhere DeepSpeed clips each engine by its own norm (a pipeline's stages under
    ZeRO-1/2/3, towers on separate groups, units under different ZeRO settings each have
    one), and a layout's optimizer may have none (runtime.layouts): refused."""
    if settings.gradient_clipping <= 0 or clipping_pipeline(plan, model) is not None:
        return
    clip = f"backend.deepspeed.gradient_clipping={settings.gradient_clipping:g}"
    trained = {u.name for u in model.units if u.trainable_params()}
    for unit in plan.units:
        layout = layout_runtime(unit)
        if unit.unit in trained and layout is not None and not layout.clips:
            raise ConfigError(f"{clip}: unit {unit.unit} lies on a {layout.name}, whose optimizer the real backend does not clip")
    for rank in range(plan.devices):
        places, held, keys = _engines(plan, model, rank)
        partial = [n for n in held if len(places[n].layers) < model.unit(n).num_layers]
        if set(held) != trained or len(keys) > 1 or partial:
            why = (
                f"rank {rank} holds {sorted(held)} of the trained units {sorted(trained)}"
                if set(held) != trained
                else f"rank {rank} holds part of unit {partial[0]}'s layers (a pipeline stage)"
                if partial
                else f"rank {rank}'s units {sorted(held)} sit on different data-parallel groups or ZeRO settings"
            )
            raise ConfigError(
                f"{clip}: DeepSpeed clips each engine by its own gradient norm, and {why}, so no engine sees the "
                f"model's; clipping needs one engine holding every trained parameter (pp=1, one data-parallel group "
                f"and ZeRO setting for all units), or a pipeline whose every rank holds its trained parameters in one "
                f"engine at zero_stage=0 or in the executor's distributed optimizer"
            )
