"""The Megatron-LM baseline planner: TP x PP x DP, searched or fixed by hand.

Every option left null is searched over what Megatron-LM users set (megatron.space: tp,
pp, vpp, micro-batch, sequence parallelism), with recomputation and the distributed
optimizer turned on only as far as memory requires; the fastest plan that fits is kept
(megatron.search) and every choice it made is reported, with the search's size and time
under plan.search. `balance` cuts the layers with Optimus's "Megatron-LM balanced" DP
instead of evenly. The plan is chosen as Megatron-LM's users choose it, at the mean load,
and priced on the workload's data (builders.replicas.on_the_data).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from src.cluster import GIB
from src.config import options_from
from src.costmodel.memory import rank_memory
from src.errors import ConfigError, PlanError
from src.program import Plan
from src.sim.engine import simulate
from src.strategies.base import PlanRequest, on_batch
from src.strategies.builders.replicas import copy_to_place, on_batches, on_the_data, skewed
from src.strategies.builders.stages import Segment
from src.strategies.megatron.options import MegatronOptions
from src.strategies.megatron.programs import MegatronSettings
from src.strategies.base import Degrees
from src.strategies.megatron.search import RANKING_SIZE, Candidate, MegatronSearch
from src.strategies.megatron.space import enumerate_space
from src.strategies.spec import AutoVariant, StrategySpec


@dataclass(frozen=True)
class MegatronChoice:
    """The Megatron-LM search's pick for a pipeline, typed: for a planner that builds its
    own Program around it (Optimus's LLM), without building Megatron-LM's."""

    degrees: Degrees
    settings: MegatronSettings
    virtual: list[list[Segment]]  # the pp x vpp virtual stages
    search: dict  # plan.search's record


def choose_megatron(request: PlanRequest, opts: MegatronOptions, simulate: bool = True) -> MegatronChoice:
    """The fastest pipeline plan of the search, its Program not built; `simulate=False`
    ranks the candidates by their path bound alone (MegatronSearch.fastest)."""
    if request.model.interaction is not None:
        raise ConfigError(f"choose_megatron plans a pipeline; {request.model.name} is a contrastive model")
    search, fitting = _fitting(request, opts)
    best = search.fastest(fitting, build=False, simulate=simulate)
    assert best.virtual is not None, "a pipeline candidate has its virtual stages"
    return MegatronChoice(best.shape.degrees, best.settings, best.virtual, search.record(fitting, best))


def plan_megatron(request: PlanRequest) -> Plan:
    return plan_megatron_batches(request, (request.batch_index,))[0]


def plan_megatron_batches(request: PlanRequest, batches: Sequence[int | None]) -> list[Plan]:
    """The search's plan, chosen once (at the mean load, or on the first of `batches` with
    strategy.choose_on=data), priced on each of `batches`."""
    opts = options_from(MegatronOptions, request.options)
    search, fitting = _fitting(request, opts)
    best = search.fastest(fitting)
    trials: list[dict] | None = None
    first = on_batch(request, batches[0])
    if opts.choose_on == "data" and best.virtual is not None and skewed(first):
        best, trials = _fastest_on_the_data(search, fitting, best, first)
    assert best.plan is not None, "the fastest candidate was built"
    plans = [best.plan] * len(batches) if best.virtual is None else on_batches(best.plan, request, batches)
    for plan in plans:
        plan.details["search"] = search.record(fitting, best)
        if trials is not None:
            plan.details["search"]["on_the_data"] = trials
        units = {u.unit: u for u in plan.units}
        plan.details["memory_gib"] = {
            rp.label: round(rank_memory(rp, units, request.model, request.train.precision, request.cluster.amp)["total"] / GIB, 3)
            for rp in plan.program.classes
        }
    return plans


def _fastest_on_the_data(
    search: MegatronSearch, fitting: list[Candidate], fastest: Candidate, request: PlanRequest
) -> tuple[Candidate, list[dict]]:
    """Of the fastest shapes at the mean load (RANKING_SIZE of them, each with its best
    memory settings), the candidate fastest on the request's batch: each one's plan placed
    on it by the workload's balancing policy (on_the_data, on a copy: the pick is placed
    again on every batch) and simulated; and each one's times. Shapes, not the ranking's
    candidates, are tried, since a skewed batch weighs on a shape (its stages' slack, its
    micro-batches' sequences) and hardly on its memory settings; only so many (each is a
    whole simulation): a shape slower at the mean load could still be faster on the data."""
    timed: list[tuple[float, Candidate]] = []
    leaders = search.shape_leaders(fitting, RANKING_SIZE)
    if all(c is not fastest for c in leaders):  # a search of one candidate ranks none
        leaders = [fastest, *leaders][:RANKING_SIZE]
    for candidate in leaders:
        if candidate.virtual is None:
            continue
        placed = on_the_data(copy_to_place(search.plan_of(candidate)), request)
        seconds = simulate(placed.program, request.model, request.cluster, request.train.precision, search.compute).iteration_time
        timed.append((seconds, candidate))
    _, best = min(timed, key=lambda pair: (pair[0], pair[1].order()))
    trials = [
        {
            "tp": candidate.shape.degrees.tp,
            "pp": candidate.shape.degrees.pp,
            "dp": candidate.shape.degrees.dp,
            "vpp": candidate.shape.degrees.vpp,
            "micro_batch": candidate.shape.degrees.micro_batch,
            "recompute": candidate.settings.recompute,
            "zero_stage": candidate.settings.zero_stage,
            "mean_load_s": candidate.time if candidate.time is not None else candidate.path_bound,
            "on_the_data_s": data_s,
            "chosen": candidate is best,
        }
        for data_s, candidate in timed
    ]
    return best, trials


def _fitting(request: PlanRequest, opts: MegatronOptions) -> tuple[MegatronSearch, list[Candidate]]:
    """The search and every candidate that fits memory (inside a node first)."""
    contrastive = request.model.interaction is not None
    if contrastive and opts.pp not in (None, 1):
        raise ConfigError(
            f"strategy.pp={opts.pp}: the Megatron-LM baseline of contrastive models uses only TP "
            f"and DP (pipelining would shrink the contrastive batch; DistMM §5.4, §7.1)"
        )
    if contrastive and opts.overlap_param_gather:
        raise ConfigError(
            f"strategy.overlap_param_gather=true chains the parameter gathers into a pipeline's forward; the Megatron-LM "
            f"baseline of contrastive models ({request.model.name}) runs its towers colocated, without a pipeline"
        )
    if contrastive and opts.balance:
        raise ConfigError(
            f"strategy.balance=true cuts pipeline stages, but the Megatron-LM baseline of "
            f"contrastive models ({request.model.name}) does not pipeline"
        )
    opts.check_replicate(request.model)
    searched = opts.searched(contrastive)
    search, fitting = _search(request, opts, contrastive, searched)
    if not fitting and opts.modality_stages == "extra" and _cuts_unets(request):
        # A backend that runs U-Nets whole keeps an MLLM's generator on one stage: where no
        # pipeline of extra modality stages is left so, the units share stages (merged).
        merged, fitting = _search(request, replace(opts, modality_stages="merged"), contrastive, searched)
        if fitting:
            merged.merged = True
            return merged, fitting
    if not fitting:
        raise PlanError(_nothing_fits(request, search, searched))
    return search, fitting


def _search(request: PlanRequest, opts: MegatronOptions, contrastive: bool, searched: bool) -> tuple[MegatronSearch, list[Candidate]]:
    search = MegatronSearch(request, opts, contrastive, searched)
    fitting: list[Candidate] = []
    for across_nodes in (False, True):
        if fitting or (across_nodes and opts.tp is not None):
            break
        fitting = search.candidates(enumerate_space(request, opts, contrastive, across_nodes, searched))
    return search, fitting


def _cuts_unets(request: PlanRequest) -> bool:
    """Whether the plan's backend keeps a U-Net of a model of several units whole."""
    units = request.model.units
    return not request.limits.split_unets and len(units) > 1 and any(u.kind == "unet" for u in units)


def _nothing_fits(request: PlanRequest, search: MegatronSearch, searched: bool) -> str:
    closest = search.closest_memory_problem()
    if closest is None:
        if search.invalid:
            return search.invalid[0]
        return f"no Megatron-LM plan exists for {request.model.name} on {request.cluster.devices} devices"
    if not searched:
        return closest
    return f"no Megatron-LM plan fits memory ({search.stats.rejected_by_memory} candidates rejected); closest: {closest}"


STRATEGY = StrategySpec(
    "megatron",
    plan_megatron,
    MegatronOptions,
    batches=plan_megatron_batches,
    plan_fields={
        "tp": "strategy.tp",
        "pp": "strategy.pp",
        "micro_batch": "strategy.micro_batch_size",
        "recompute": "strategy.recompute",
        "zero_stage": "strategy.zero_stage",
        "sequence_parallel": "strategy.sequence_parallel",
        "blocking": "strategy.overlap_grad_reduce",
        "param_gather": "strategy.overlap_param_gather",
        "scatter": "strategy.scatter_gather",
        "rows": "strategy.replicate",
    },
    auto_variants=(AutoVariant("megatron"), AutoVariant("megatron-balanced", {"balance": True})),
)
