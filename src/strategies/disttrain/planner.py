"""The DistTrain planner (Zhang et al., arXiv 2408.04275 v2): disaggregated training of
multimodal LLMs. Every component can be switched off for the paper's ablations:

- orchestration: `disaggregated` (Algorithm 1, strategies.disttrain.orchestration) or
  `ratio` (GPUs in proportion to each unit's FLOPs, §8.2.1's baseline);
- the data is the workload's (train.data, the same for every strategy of a comparison):
  `interleaved` (LAION-like sequences whose image count and sizes vary,
  src/data/interleaved.py) or `uniform` (every sequence alike); a real run on an MLLM's
  tar shards prices the images their samples hold (PlanRequest.sample_images);
- reorder: none | intra (Algorithm 2) | inter (Algorithm 3) | both | cost (the cost model's
  balance, src/data/balance.py); the workload's train.balance, where given, says which
  (none, reorder = both, cost);
- plan_reorder: the reordering the plan is chosen under (null: reorder's), then run with
  reorder's order: an ablation of the order alone keeps DistTrain's plan (§8.2.2);
- tp_overlap_chunks: StepCCL's TP overlap, 1 = off;
- ranked: how many of the orchestration's best choices (at the mean load) are timed
  against the batch's data (ours: the breadth of the choice on the data);
- ranked_shapes: beside them, the best choice of each of this many best distinct LLM
  shapes (null: none), since the best few can be near-copies of one LLM shape.

The encoder, LLM and generator take their degrees from the orchestration (or by hand:
strategy.llm.tp=8 ...); the Program is strategies.disttrain.programs'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from src.batch_layout import BatchLayout
from src.cluster import GIB
from src.config import check_positive, options_from
from src.costmodel.memory import check_memory_options
from src.data.loads import BatchLoads, batch_loads
from src.errors import ConfigError, PlanError
from src.models.spec import ModelSpec
from src.program import Plan, compress_ranks
from src.strategies.base import PlanRequest, check_microbatch_count, on_batch
from src.data.disaggregated import BALANCE_REORDERS, REORDERS
from src.strategies.disttrain.orchestration import UNITS, Choice, Fixed, Orchestrator
from src.strategies.disttrain.profile import Profiler
from src.strategies.disttrain.search import RANKED, RANKED_SHAPES, SIMULATED, Candidate, Decision, memory_problem
from src.strategies.spec import AutoVariant, StrategySpec

ORCHESTRATIONS = ("disaggregated", "ratio")


@dataclass(frozen=True)
class DistTrainOptions:
    orchestration: str = "disaggregated"
    reorder: str | None = None  # None: train.balance's, else both (DistTrain's own)
    plan_reorder: str | None = None  # None: reorder's
    tp_overlap_chunks: int = 4
    ranked: int = RANKED
    ranked_shapes: int | None = RANKED_SHAPES
    recompute: str | None = None
    zero_stage: int | None = None
    encoder: Fixed = field(default_factory=Fixed)
    llm: Fixed = field(default_factory=Fixed)
    generator: Fixed = field(default_factory=Fixed)
    # Units whose TP group replicates them, each GPU its share of every micro-batch's images
    # (§8.1, line 122: "whereas TP itself is not used"); () = TP splits them.
    replicate: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key, allowed, optional in (
            ("orchestration", ORCHESTRATIONS, False),
            ("reorder", REORDERS, True),
            ("plan_reorder", REORDERS, True),
        ):
            value = getattr(self, key)
            if value not in allowed and not (optional and value is None):
                raise ConfigError(f"strategy.{key}={value!r}; choose one of {list(allowed)}")
        check_positive("strategy.tp_overlap_chunks", self.tp_overlap_chunks, meaning=" (1 = no overlap)")
        check_positive("strategy.ranked", self.ranked, meaning=" (the orchestration's choices timed on the data)")
        check_positive("strategy.ranked_shapes", self.ranked_shapes, optional=True, meaning=" (distinct LLM shapes also timed)")
        check_memory_options(self.recompute, self.zero_stage, "DistTrain's units run Megatron-LM's distributed optimizer (ZeRO-1)")
        for unit in UNITS:
            getattr(self, unit).check(f"strategy.{unit}")
        self._check_replicate()

    def _check_replicate(self) -> None:
        """Only the modules around the LLM, each once; each runs whole on every GPU of its TP
        group, so on one stage (at tp 1 nothing is replicated: a stage of one GPU, which the
        orchestration may pipeline, and a plan it chose can be given by hand)."""
        what = f"strategy.replicate={list(self.replicate)}"
        allowed = [u for u in UNITS if u != "llm"]
        if any(name not in allowed for name in self.replicate) or len(set(self.replicate)) != len(self.replicate):
            raise ConfigError(f"{what}: the units replicated over their TP group are among {allowed}, each once")
        object.__setattr__(self, "replicate", tuple(self.replicate))
        for unit in self.replicate:
            given: Fixed = getattr(self, unit)
            if (given.tp or 1) > 1 and ((given.pp or 1) > 1 or (given.vpp or 1) > 1):
                raise ConfigError(
                    f"{what}: a replicated {unit} runs whole on each GPU of its group, on one pipeline stage, "
                    f"but strategy.{unit}.tp={given.tp}, .pp={given.pp} and .vpp={given.vpp} (pipelined, it takes tp=1)"
                )

    def fixed(self, unit: str) -> Fixed:
        """A unit's options given by hand; the strategy-wide recompute and zero_stage
        stand for every unit that does not set its own."""
        given: Fixed = getattr(self, unit)
        recompute = given.recompute or self.recompute
        zero = self.zero_stage if given.zero_stage is None else given.zero_stage
        return replace(given, recompute=recompute, zero_stage=zero)


def _check_model(model: ModelSpec) -> None:
    names = tuple(u.name for u in model.units)
    if names != UNITS or model.flows != (("encoder", "llm"), ("llm", "generator")):
        raise ConfigError(
            f"strategy=disttrain trains an encoder -> llm -> generator MLLM (model=mllm_9b, mllm_15b, "
            f"mllm_72b); model {model.name} has units {list(names)}"
        )


def _whole_unet(request: PlanRequest, unit: str, fixed: Fixed, replicated: bool) -> Fixed:
    """A U-Net unit (the generator) on tp=1 and one stage where the plan's backend runs
    U-Nets whole (PlanRequest.limits); given degrees beyond that are refused. Replicated
    over its TP group, it runs whole on each of the group's GPUs."""
    spec = request.model.unit(unit)
    if request.limits.split_unets or spec.kind != "unet":
        return fixed
    request.limits.whole_unet(spec, 1 if replicated else fixed.tp or 1, fixed.pp or 1)
    return replace(fixed, tp=fixed.tp if replicated else 1, pp=1)


def reordering(given: str | None, balance: str | None) -> str:
    """strategy.reorder, or the workload's balancing policy as DistTrain's reordering."""
    if balance is None:
        return given or "both"
    wanted = BALANCE_REORDERS[balance]
    if given is not None and given != wanted:
        raise ConfigError(
            f"strategy.reorder={given!r} and train.balance={balance!r} disagree "
            f"(train.balance={balance} is DistTrain's reorder={wanted!r}); set one"
        )
    return wanted


def plan_disttrain(request: PlanRequest) -> Plan:
    return plan_disttrain_batches(request, (request.batch_index,))[0]


def plan_disttrain_batches(request: PlanRequest, batches: Sequence[int | None]) -> list[Plan]:
    """The plan for the first of `batches` (orchestrated and decided on its data), then the
    same degrees and micro-batches on each other batch, its sequences placed anew by the
    reordering (as DistTrain reorders every global batch; §6)."""
    asked, request = request, on_batch(request, batches[0])
    if "data" in request.options:
        raise ConfigError("strategy.data is train.data now: the data is the workload's, the same for every strategy")
    opts = options_from(DistTrainOptions, request.options)
    model, cluster, train = request.model, request.cluster, request.train
    reorder = reordering(opts.reorder, train.balance)
    opts = replace(opts, reorder=reorder)
    _check_model(model)
    # Before drawing a layout per sequence: the LLM takes one sequence per micro-batch.
    busiest = BatchLayout.busiest_share(train.global_batch, cluster.devices)
    check_microbatch_count(busiest, 1, f"global batch {train.global_batch} over at most {cluster.devices} LLM replicas")
    loads = batch_loads(model, train.seed, train.global_batch, train.data, request.sample_images, request.batch_index)
    profiler = Profiler(model, cluster, train.precision, opts.tp_overlap_chunks)
    fixed = {u: _whole_unet(request, u, opts.fixed(u), u in opts.replicate) for u in UNITS}

    orchestrator = Orchestrator(
        profiler,
        train.global_batch,
        cluster.devices,
        fixed,
        opts.orchestration,
        loads.peak,
        opts.ranked,
        opts.ranked_shapes,
        replicate=opts.replicate,
    )
    found = orchestrator.solve()
    decision = Decision(request, orchestrator, loads, opts.plan_reorder or reorder, opts.tp_overlap_chunks)
    candidates = [Candidate(c, found.microbatches[c], t, opts.orchestration) for t, c in found.choices]
    # The best choice interleaved, and so the best the search without shapes keeps: what that
    # search alone would time (asking for shapes drops none of it).
    alone = set(found.alone)
    for first in dict.fromkeys([found.best, *found.alone[:1]]):
        interleaved = _interleavings(orchestrator, opts.orchestration, first, found.microbatches[first], candidates)
        candidates += interleaved
        if found.alone[:1] == (first,):
            alone |= {c.choice for c in interleaved}
    # The ratio-based plan is simulated beside ours: DistTrain's is never slower.
    ratio = _ratio_plan(orchestrator, opts.orchestration, candidates)
    apart = [ratio] if ratio is not None and not any(ratio is c for c in candidates) else []
    for candidate in candidates + apart:
        decision.estimate(candidate)
    # The data can rank first a choice the mean load does not: every choice timed that can be
    # interleaved (a one-stage LLM cannot) and holds in memory, interleaved too. Not only the
    # best few by the estimate plain: those are near-copies of a few LLM shapes (the encoder's or
    # the generator's plan differing), and an interleaving ranks apart from its plain choice
    # (Fig. 17's MLLM-15B on 96 A800s: the plan, LLM TP 2, PP 2 interleaved five ways, 4.22 s,
    # interleaves a choice that the best eight plain ones that can interleave leave out at 64
    # timed, 4.28 s without it). It more than doubles the estimates and the plan's CPU (MLLM-9B on
    # 1152 A800s under train.balance=cost: 233 candidates against 100, 30 s against 14).
    leaders = [c for c in _ranked(candidates) if orchestrator.interleaved_vpps(c.choice, c.microbatches)]
    for leader in leaders:
        interleaved = _interleavings(orchestrator, opts.orchestration, leader.choice, leader.microbatches, candidates)
        for candidate in interleaved:
            decision.estimate(candidate)
        candidates += interleaved
    ranked = _ranked(candidates)
    # The best by the estimate, those the search without shapes would simulate, and the ratio plan's.
    picked = ranked[:SIMULATED] + [c for c in ranked if c.choice in alone][:SIMULATED]
    picked += [ratio] if ratio is not None and math.isfinite(ratio.estimate_s) else []
    chosen = list({id(c): c for c in picked}.values())
    candidates += apart
    if not chosen:
        raise PlanError(
            f"disttrain: none of the orchestration's {len(candidates)} best choices holds in memory the forwards its "
            f"schedule keeps in flight (the best: {candidates[0].describe()})"
        )
    for candidate in chosen:
        decision.build(candidate)
        if decision.fits(candidate):
            decision.simulate(candidate)
    simulated = [c for c in chosen if c.simulated_s is not None]
    if not simulated:
        raise PlanError(memory_problem(request, min(chosen, key=lambda c: c.estimate_s)))
    best = min(simulated, key=lambda c: c.simulated_s or math.inf)
    if decision.reorder != reorder:
        best = _decided(Decision(request, orchestrator, loads, reorder, opts.tp_overlap_chunks), best)
    search = found.search | {
        "ranked": len(candidates),
        "simulated": len(simulated),
        "candidates": [c.record() for c in sorted(candidates, key=lambda c: (c.simulated_s is None, c.simulated_s or c.estimate_s))],
    }
    plans = [_plan(request, opts, loads, best, search, found.relaxed_s)]
    for batch in batches[1:]:
        again = on_batch(asked, batch)
        batch_data = batch_loads(model, train.seed, train.global_batch, again.train.data, again.sample_images, again.batch_index)
        candidate = _decided(Decision(again, orchestrator, batch_data, reorder, opts.tp_overlap_chunks), best)
        plans.append(_plan(again, opts, batch_data, candidate, search, found.relaxed_s))
    return plans


def _interleavings(orchestrator: Orchestrator, orchestration: str, choice: Choice, m: int, timed: list[Candidate]) -> list[Candidate]:
    """The choice with its LLM interleaved (Orchestrator.interleavings), but for those timed."""
    known = {c.choice for c in timed}
    return [Candidate(c, m, t, f"{orchestration}, interleaved") for t, c in orchestrator.interleavings(choice, m) if c not in known]


def _ranked(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates that hold in memory, fastest first by the estimate on the data."""
    return sorted((c for c in candidates if math.isfinite(c.estimate_s)), key=lambda c: c.estimate_s)


def _ratio_plan(orchestrator: Orchestrator, orchestration: str, candidates: list[Candidate]) -> Candidate | None:
    """The ratio-based orchestration's best choice (§8.2.1's baseline): the candidate of that
    choice where it is one, else one of its own; None where ours is that orchestration or it
    finds no plan."""
    if orchestration == "ratio":
        return None
    try:
        found = orchestrator.with_mode("ratio", 1).solve()
    except (ConfigError, PlanError):
        return None
    model_s, best = found.choices[0]
    ours = [c for c in candidates if c.choice == best]
    return ours[0] if ours else Candidate(best, found.microbatches[best], model_s, "ratio")


def _decided(decision: Decision, chosen: Candidate) -> Candidate:
    """The chosen degrees and micro-batches, placed and simulated by `decision` (another
    batch's data, or another order than the one the choice was made under)."""
    candidate = Candidate(chosen.choice, chosen.microbatches, chosen.model_s, chosen.origin)
    decision.estimate(candidate)
    decision.build(candidate)
    decision.simulate(candidate)
    return candidate


def _plan(request: PlanRequest, opts: DistTrainOptions, loads: BatchLoads, best: Candidate, search: dict, relaxed_s: float) -> Plan:
    cluster, train = request.cluster, request.train
    assert best.program is not None and best.assignment is not None and best.reordering is not None
    details = {
        "orchestration": opts.orchestration,
        "data": train.data,
        "reorder": opts.reorder,
        "plan_reorder": opts.plan_reorder or opts.reorder,
        "tp_overlap_chunks": opts.tp_overlap_chunks,
        "microbatches": best.microbatches,
        "brokers": [b.as_dict() | {"ranks": compress_ranks(b.ranks)} for b in best.brokers],
        "estimate_s": round(best.estimate_s, 6),
        "model_s": round(best.model_s, 6),
        "relaxed_s": round(relaxed_s, 6),
        "simulated_s": best.simulated_s,
        "picked_from": best.origin,
        "search": search,
        "images_per_sequence": {"mean": sum(loads.images) / len(loads.images), "max": max(loads.images)},
        "sample_order": list(best.assignment.positions),
        "memory_gib": {unit: round(need / GIB, 3) for unit, (need, _) in best.memory.items()},
        "idle_devices": cluster.devices - best.program.world_size,
    }
    return Plan(
        strategy="disttrain",
        devices=best.program.world_size,
        units=best.units,
        program=best.program,
        precision=request.train.precision,
        details=details,
        sample_order=best.assignment.positions,
        sample_content=train.data,
        sample_images=loads.images if train.data == "interleaved" or request.sample_images is not None else None,
        images_per_sequence=None if request.sample_images is None else sum(loads.images) / len(loads.images),
        balancing=None if opts.reorder == "none" else best.reordering,
    )


STRATEGY = StrategySpec(
    "disttrain",
    plan_disttrain,
    DistTrainOptions,
    batches=plan_disttrain_batches,
    plan_fields={
        "tp": "strategy.{unit}.tp",
        "pp": "strategy.{unit}.pp",
        "recompute": "strategy.{unit}.recompute",
        "zero_stage": "strategy.{unit}.zero_stage",
        "sequence_parallel": "strategy.{unit}.sequence_parallel",
        "scatter": "strategy.{unit}.scatter_gather",
        "fraction": "strategy.tp_overlap_chunks",
        "rows": "strategy.replicate",
    },
    auto_variants=(AutoVariant("disttrain"),),
)
