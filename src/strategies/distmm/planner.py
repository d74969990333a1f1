"""The DistMM planner (Huang et al., NSDI'24): its four components, each switchable.

1. Modality-aware partitioner (distmm.towers.partition): per tower DP, TP in a node, or
   PP across nodes, whichever is the least that holds one replica.
2. Data load balancer (distmm.balance.balance): device counts and per-replica batches
   minimising the estimated iteration of the towers aligned at every batch-sync, under
   memory (`strategy.balance=dp`);
   `even` splits the devices equally (the "without load balancing" ablation).
3. Heterogeneity-aware placement (distmm.programs): towers on separate nodes with TP
   inside nodes (`separate`), or every tower on every device (`naive`, the baseline's).
4. Pipeline executor: batch-sync groups of the contrastive batch, scheduled by
   DistMM-Pipe (`distmm_pipe`) or GPipe with batch-sync (`gpipe_sync`).

A tower's degrees can be fixed by hand (strategy.vision.tp=4 strategy.text.dp=16); the
memory-saving settings (recompute, ZeRO-1) are chosen per tower, cheapest first, exactly
as far as memory requires, as the Megatron baseline chooses them for the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from src.cluster import GIB, gib
from src.config import UnitCounts, check_positive, options_from
from src.costmodel.memory import check_memory_options, memory_ladder, rank_memory, states_precision
from src.errors import ConfigError, PlanError
from src.models.spec import ModelSpec
from src.program import Plan, Program, UnitPlan
from src.schedules.distmm_pipe import SYNC_SCHEDULES, max_contrastive_batch
from src.strategies.base import Degrees, PlanRequest
from src.strategies.distmm.balance import Choice, aligned_time, balance, own_time
from src.strategies.distmm.programs import colocated_program, cross_flows, place, separate_program, unit_plans
from src.strategies.distmm.towers import (
    TowerCosts,
    TowerPlan,
    activation_per_sample,
    blocks_of,
    partition,
    phase_weights,
    replica_state_bytes,
    stage_ranges,
)
from src.strategies.spec import AutoVariant, StrategySpec
from src.models.flows import unit_order

BALANCE = ("dp", "even")
PLACEMENT = ("separate", "naive")
ALIGNED = "aligned"


@dataclass(frozen=True)
class TowerDegrees(UnitCounts):
    """A tower's degrees set by hand (strategy.vision, strategy.text); None: planned."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None  # replicas


@dataclass(frozen=True)
class DistMMOptions:
    balance: str = "dp"
    placement: str = "separate"
    pipeline: str = "distmm_pipe"
    use_all_devices: bool = True
    microbatches: int | None = None
    recompute: str | None = None
    zero_stage: int | None = None
    vision: TowerDegrees = field(default_factory=TowerDegrees)
    text: TowerDegrees = field(default_factory=TowerDegrees)

    def __post_init__(self) -> None:
        for key, allowed in (("balance", BALANCE), ("placement", PLACEMENT), ("pipeline", SYNC_SCHEDULES)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"strategy.{key}={getattr(self, key)!r}; choose one of {list(allowed)}")
        check_positive("strategy.microbatches", self.microbatches, optional=True)
        if not isinstance(self.use_all_devices, bool):
            raise ConfigError(f"strategy.use_all_devices={self.use_all_devices!r} must be true or false")
        check_memory_options(self.recompute, self.zero_stage, "DistMM shards the optimizer as the baseline does")
        for tower in ("vision", "text"):
            getattr(self, tower).check(f"strategy.{tower}")

    def fixed(self, tower: str) -> TowerDegrees:
        """A tower's hand-set degrees (a tower other than vision and text sets none)."""
        return getattr(self, tower, TowerDegrees())

    def settings(self) -> tuple[tuple[str, int], ...]:
        return memory_ladder(self.recompute, self.zero_stage)


def _towers(model: ModelSpec, opts: DistMMOptions) -> list[str]:
    if model.interaction is None:
        raise PlanError(f"distmm plans towers around a contrastive interaction; model {model.name} has none")
    towers = [name for name in unit_order(model) if name != model.interaction]
    for name in ("vision", "text"):
        if getattr(opts, name) != TowerDegrees() and name not in towers:
            raise ConfigError(f"strategy.{name} is set but model {model.name} has no tower {name!r}: {towers}")
    return towers


def _degrees(request: PlanRequest, tower: str, fixed: TowerDegrees) -> Degrees:
    unit = request.model.unit(tower)
    node = request.cluster.devices_per_node
    tp, pp = fixed.tp, fixed.pp
    if tp is not None and (unit.heads % tp or tp > node):
        raise ConfigError(
            f"strategy.{tower}.tp={tp} must divide the {unit.heads} heads of {tower} and stay inside a node of {node} devices"
        )
    if pp is not None and pp > blocks_of(unit):
        raise ConfigError(f"strategy.{tower}.pp={pp} exceeds the {blocks_of(unit)} blocks of {tower}")
    return partition(unit, request.cluster, request.train.precision, tp, pp)


def _depths(request: PlanRequest, tower: str, degrees: Degrees, fixed: TowerDegrees) -> list[Degrees]:
    """The partitioner's degrees and, for a pipelined tower whose pp is not fixed, the
    deeper pipelines, shallowest first: a batch-sync group's activations stay resident
    until its barrier, and more stages hold a larger contrastive batch
    ((M·P - M_s)/(2·M_a), §5.4)."""
    if degrees.pp == 1 or fixed.pp is not None:
        return [degrees]
    deepest = min(blocks_of(request.model.unit(tower)), request.cluster.devices // degrees.tp)
    return [Degrees(degrees.tp, pp) for pp in range(degrees.pp, deepest + 1)]


def _choices(
    request: PlanRequest,
    costs: TowerCosts,
    tower: str,
    depths: list[Degrees],
    dp: int | None,
    groups: int,
    schedule: str,
    settings: tuple[tuple[str, int], ...],
    microbatches: int | None,
) -> tuple[list[Choice[TowerPlan]], list[str]]:
    """Every device count of the tower whose replicas divide the batch and fit memory, at
    the partitioner's pipeline depth or, only if no size fits there, the shallowest
    deeper one at which some size fits."""
    batch, devices = request.train.global_batch, request.cluster.devices
    choices: list[Choice[TowerPlan]] = []
    skipped: list[str] = []
    for degrees in depths:
        for n in range(degrees.replica_devices, devices + 1, degrees.replica_devices):
            replicas = n // degrees.replica_devices
            if dp is not None and replicas != dp:
                continue
            if batch % replicas or (batch // replicas) % groups:
                skipped.append(f"{replicas} replicas do not divide {groups} batch-sync group(s) of the batch {batch}")
                continue
            found = costs.best(tower, degrees, replicas, batch // replicas, groups, schedule, settings, microbatches)
            if found is None:
                skipped.append(_short(request, costs, tower, degrees, replicas, batch // replicas, groups, schedule))
            else:
                choices.append(Choice(n, costs.phases(found[0]), found[0]))
        if choices:
            break
    return choices, skipped


def _short(
    request: PlanRequest, costs: TowerCosts, tower: str, degrees: Degrees, replicas: int, batch: int, groups: int, schedule: str
) -> str:
    """Why a tower size does not fit: its memory with the most saving settings."""
    stages = stage_ranges(request.model.unit(tower), degrees.pp)
    share = batch // groups
    plan = TowerPlan(
        tower, degrees.tp, degrees.pp, replicas, batch, groups, share if degrees.pp > 1 else 1, "full", 1, stages, schedule
    )
    need, usable = costs.memory(plan), request.cluster.usable_memory_bytes
    bound = ""
    if degrees.pp > 1:
        unit = request.model.unit(tower)
        whole = (0, unit.num_layers)
        static = replica_state_bytes(unit, whole, degrees.tp, states_precision(request.train.precision, request.cluster.amp))
        samples = max_contrastive_batch(usable, static, activation_per_sample(unit, whole, degrees.tp, "full"), degrees.pp)
        bound = f" (DistMM-Pipe's (M·P - M_s)/(2·M_a) allows about {max(0, int(samples))} samples per group here)"
    return (
        f"tower {tower} at tp={degrees.tp} pp={degrees.pp} with {replicas} replicas of {batch} samples needs "
        f"{gib(need)} GiB per device even with full recompute and ZeRO-1; {gib(usable)} GiB usable, "
        f"short by {gib(need - usable)} GiB{bound}"
    )


def _even(choices: list[Choice[TowerPlan]], share: int) -> Choice[TowerPlan] | None:
    """Without load balancing: the largest feasible size within an equal device share."""
    within = [c for c in choices if c.devices <= share]
    return max(within, key=lambda c: c.devices) if within else None


def _separate(request: PlanRequest, opts: DistMMOptions, towers: list[str], groups: int) -> tuple[list[TowerPlan], dict[str, float]]:
    costs = TowerCosts(request.model, request.cluster, request.train.precision, request.train.contrastive_batch)
    linked = {name for flow in cross_flows(request.model, towers) for name in (flow.producer, flow.consumer)}
    per_tower = []
    for tower in towers:
        fixed = opts.fixed(tower)
        # DistMM-Pipe runs a tower's next group ahead of its backwards; a tower that feeds
        # another tower's layers (CoCa's image tokens) would then wait on itself through the
        # consumer: towers linked that way run GPipe with batch-sync.
        schedule = "gpipe_sync" if tower in linked else opts.pipeline
        depths = _depths(request, tower, _degrees(request, tower, fixed), fixed)
        choices, skipped = _choices(request, costs, tower, depths, fixed.dp, groups, schedule, opts.settings(), opts.microbatches)
        if not choices:
            why = skipped[-1] if skipped else "no replica count is possible"
            raise PlanError(f"distmm: no size of tower {tower} fits on {request.cluster.devices} devices: {why}")
        per_tower.append(choices)
    weights = phase_weights(groups)
    if opts.balance == "dp":
        picked = balance(per_tower, request.cluster.devices, weights, fill=opts.use_all_devices)
    else:
        share = request.cluster.devices // len(towers)
        even = [c for c in (_even(c, share) for c in per_tower) if c is not None]
        picked = even if len(even) == len(per_tower) else None
    if picked is None:
        smallest = " + ".join(f"{t} {min(c.devices for c in cs)}" for t, cs in zip(towers, per_tower))
        raise PlanError(
            f"distmm: the towers need at least {smallest} devices with replica counts dividing the batch "
            f"{request.train.global_batch} ({opts.balance} balance) but cluster {request.cluster.name} "
            f"has {request.cluster.devices}"
        )
    estimates = {t: own_time(c, weights) for t, c in zip(towers, picked)}
    estimates[ALIGNED] = aligned_time([c.phases for c in picked], weights)
    return [c.payload for c in picked], estimates


def _colocated(request: PlanRequest, opts: DistMMOptions, towers: list[str], groups: int) -> tuple[list[TowerPlan], Program]:
    """Every tower on every device: replicas = devices / tp; the first settings that fit."""
    devices, batch = request.cluster.devices, request.train.global_batch
    degrees = {}
    for tower in towers:
        fixed = opts.fixed(tower)
        degrees[tower] = _degrees(request, tower, fixed)
        if degrees[tower].pp > 1:
            raise PlanError(
                f"distmm: placement=naive colocates the towers on every device without a pipeline, but "
                f"tower {tower} needs pp={degrees[tower].pp}; use placement=separate"
            )
        replicas = devices // degrees[tower].tp
        if batch % replicas or (batch // replicas) % groups:
            raise ConfigError(f"global batch {batch} is not divisible by {tower}'s {replicas} replicas x {groups} batch-sync group(s)")
    last = ""
    for recompute, zero in opts.settings():
        plans = [
            TowerPlan(
                t,
                degrees[t].tp,
                1,
                devices // degrees[t].tp,
                batch // (devices // degrees[t].tp),
                groups,
                1,
                recompute,
                zero,
                ((0, request.model.unit(t).num_layers),),
            )
            for t in towers
        ]
        program = colocated_program(request.model, request.cluster, request.train.precision, request.train.contrastive_batch, plans)
        need = _peak_memory(request, program, plans, colocated=True)
        if need <= request.cluster.usable_memory_bytes:
            return plans, program
        last = (
            f"needs {gib(need)} GiB per device with recompute={recompute} zero_stage={zero}, "
            f"{gib(request.cluster.usable_memory_bytes)} GiB usable"
        )
    raise PlanError(f"distmm: placement=naive does not fit: every device holds all towers and {last}")


def _peak_memory(request: PlanRequest, program: Program, plans: list[TowerPlan], colocated: bool) -> float:
    units = {u.unit: u for u in _unit_plans(request, plans, colocated)}
    return max(rank_memory(rp, units, request.model, request.train.precision, request.cluster.amp)["total"] for rp in program.classes)


def _unit_plans(request: PlanRequest, plans: list[TowerPlan], colocated: bool) -> list[UnitPlan]:
    return unit_plans(request.model, request.cluster, request.train.contrastive_batch, place(plans), colocated)


def plan_distmm(request: PlanRequest) -> Plan:
    opts = options_from(DistMMOptions, request.options)
    towers = _towers(request.model, opts)
    batch, rbs = request.train.global_batch, request.train.contrastive_batch
    if batch % rbs:
        raise ConfigError(
            f"global batch {batch} is not a multiple of the contrastive batch {rbs}: DistMM runs "
            f"batch/contrastive batch-syncs of {rbs} samples each"
        )
    groups = batch // rbs
    estimates: dict[str, float] = {}
    colocated = opts.placement == "naive"
    if colocated:
        plans, program = _colocated(request, opts, towers, groups)
    else:
        plans, estimates = _separate(request, opts, towers, groups)
        program = separate_program(request.model, request.cluster, request.train.precision, rbs, place(plans))
    units = _unit_plans(request, plans, colocated)
    for unit in units:
        if unit.unit in estimates:
            unit.details["balancer_time_s"] = round(estimates[unit.unit], 6)
    by_name = {u.unit: u for u in units}
    memory = {
        rp.label: rank_memory(rp, by_name, request.model, request.train.precision, request.cluster.amp)["total"]
        for rp in program.classes
    }
    worst = max(memory, key=lambda label: memory[label])
    if memory[worst] > request.cluster.usable_memory_bytes:
        raise PlanError(
            f"distmm: {worst} needs {gib(memory[worst])} GiB but a {request.cluster.device} has "
            f"{gib(request.cluster.usable_memory_bytes)} GiB usable (the balancer's estimate "
            f"disagrees with the Program)"
        )
    used = sum(p.devices for p in plans) if not colocated else request.cluster.devices
    details = {
        "balance": opts.balance if not colocated else "none (colocated)",
        "placement": opts.placement,
        "pipeline": opts.pipeline,
        "batch_sync_groups": groups,
        "contrastive_batch": rbs,
        "idle_devices": request.cluster.devices - used,
        "memory_gib": {k: round(v / GIB, 3) for k, v in memory.items()},
    }
    if ALIGNED in estimates:
        details["balancer_aligned_s"] = round(estimates[ALIGNED], 6)
    return Plan(
        strategy="distmm",
        devices=request.cluster.devices,
        units=units,
        program=program,
        precision=request.train.precision,
        details=details,
    )


STRATEGY = StrategySpec(
    "distmm",
    plan_distmm,
    DistMMOptions,
    plan_fields={
        "tp": "strategy.{unit}.tp",
        "pp": "strategy.{unit}.pp",
        "micro_batch": "strategy.microbatches",
        "recompute": "strategy.recompute",
        "zero_stage": "strategy.zero_stage",
    },
    auto_variants=(AutoVariant("distmm"),),
)
