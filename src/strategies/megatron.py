"""The Megatron-LM baseline planner: TP x PP x DP, searched or fixed by hand.

Given no tp/pp, it enumerates the usual space (TP a power of two dividing every unit's
heads, inside a node first; PP a divisor of the blocks; micro-batch sizes dividing the
per-replica batch), builds each candidate's Program, drops those that do not fit in
memory, simulates the rest and keeps the fastest. Every choice it made is reported.
"""
from __future__ import annotations

from dataclasses import dataclass

from src.config import options_from
from src.costmodel.memory import check_memory_options, memory_ladder, rank_memory
from src.cluster import GIB
from src.errors import ConfigError, PlanError
from src.program import Plan
from src.schedules.pipeline import SCHEDULES
from src.costmodel.compute import ComputeModel
from src.sim.engine import compute_lower_bound, simulate
from src.strategies.base import PlanRequest
from src.strategies.megatron_programs import Degrees, MegatronSettings, colocated_program, pipeline_program
from src.strategies.stages import main_unit

# Pipelines want many micro-batches; larger ones only help GEMM efficiency, which saturates.
MAX_PIPELINE_MICRO_BATCH = 8


@dataclass(frozen=True)
class MegatronOptions:
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    vpp: int = 1
    micro_batch_size: int | None = None
    schedule: str = "1f1b"
    recompute: str | None = None
    sequence_parallel: bool = False
    zero_stage: int | None = None
    overlap_grad_reduce: bool = False
    modality_stages: str = "extra"
    uneven_pp: bool = False

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "micro_batch_size"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"strategy.{key} must be a positive integer, got {value!r}")
        if isinstance(self.vpp, bool) or not isinstance(self.vpp, int) or self.vpp <= 0:
            raise ConfigError(f"strategy.vpp must be a positive integer, got {self.vpp!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"strategy.schedule={self.schedule!r}; choose one of {list(SCHEDULES)}")
        if self.vpp > 1 and self.schedule != "interleaved":
            raise ConfigError(f"strategy.vpp={self.vpp} needs strategy.schedule=interleaved, not {self.schedule}")
        check_memory_options(self.recompute, self.zero_stage, "Megatron-LM's distributed optimizer is ZeRO "
                             "stage 1 (stages 2-3 belong to strategy=ddp)")

    def settings(self) -> list[MegatronSettings]:
        """Memory-saving settings to try, cheapest first: recomputation and the
        distributed optimizer are turned on only as far as memory requires."""
        return [MegatronSettings(self.schedule, recompute, self.sequence_parallel, zero, self.overlap_grad_reduce,
                                 self.modality_stages, self.uneven_pp)
                for recompute, zero in memory_ladder(self.recompute, self.zero_stage)]


def _powers_of_two(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_choices(request: PlanRequest, opts: MegatronOptions, across_nodes: bool) -> list[int]:
    """TP degrees to try: powers of two dividing every unit's heads, inside a node; only
    when nothing fits there, degrees that span nodes (DistMM §7.1: CoCa(13B,13B) at 16)."""
    if opts.tp is not None:
        return [opts.tp]
    heads = [u.heads for u in request.model.units if u.kind == "transformer" and u.heads > 1]
    node = request.cluster.devices_per_node
    return [t for t in _powers_of_two(request.cluster.devices) if all(h % t == 0 for h in heads)
            and (t > node) == across_nodes]


def _pp_choices(request: PlanRequest, opts: MegatronOptions, contrastive: bool) -> list[int]:
    if opts.pp is not None:
        return [opts.pp]
    if contrastive:
        return [1]
    main = main_unit(request.model)
    blocks = sum(1 for layer in main.layers if layer.tp_allreduces > 0) or main.num_layers
    extra = len(request.model.units) - 1 if opts.modality_stages == "extra" else 0
    return [p + extra for p in range(1, blocks + 1)
            if (opts.uneven_pp or blocks % (p * opts.vpp) == 0) and p * opts.vpp <= blocks]


def _check_degrees(request: PlanRequest, opts: MegatronOptions, tp: int, pp: int) -> int:
    """Validate one (tp, pp) choice against the model and cluster; return dp."""
    devices = request.cluster.devices
    # Transformer units split attention heads across TP ranks. A U-Net's TP splits its
    # convolutions' output channels; its few attention heads (5 in SD-2.1's first level)
    # are priced as an even split of the attention work, as a spatially split attention
    # would run.
    for unit in request.model.units:
        if unit.kind == "transformer" and unit.heads > 1 and unit.heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {unit.heads} attention heads of unit {unit.name}")
    if devices % (tp * pp):
        raise ConfigError(f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the cluster's {devices} devices")
    dp = devices // (tp * pp)
    if opts.dp is not None and opts.dp != dp:
        raise ConfigError(f"tp x pp x dp = {tp} x {pp} x {opts.dp} = {tp * pp * opts.dp} but cluster "
                          f"{request.cluster.name} has {devices} devices")
    if request.train.global_batch % dp:
        raise ConfigError(f"global batch {request.train.global_batch} is not divisible by dp={dp}")
    return dp


def _micro_batches(request: PlanRequest, opts: MegatronOptions, dp: int, contrastive: bool) -> list[int]:
    per_replica = request.train.global_batch // dp
    if opts.micro_batch_size is not None:
        if per_replica % opts.micro_batch_size:
            raise ConfigError(f"global batch {request.train.global_batch} is not divisible by dp x micro-batch = "
                              f"{dp} x {opts.micro_batch_size} = {dp * opts.micro_batch_size}")
        choices = [opts.micro_batch_size]
    else:
        # Largest first: for contrastive models the whole replica batch is one micro-batch
        # unless memory forces accumulation.
        choices = [m for m in reversed(_divisors(per_replica)) if contrastive or m <= MAX_PIPELINE_MICRO_BATCH]
    if contrastive:
        rbs = request.train.contrastive_batch
        fitting = [m for m in choices if m * dp >= rbs]
        if not fitting:
            raise ConfigError(f"micro-batch {choices[0]} x dp {dp} = {choices[0] * dp} samples per step is below the "
                              f"contrastive batch {rbs}: Megatron-LM cannot accumulate gradients without "
                              f"shrinking the contrastive loss's batch")
        choices = fitting
    return choices


@dataclass
class _Candidate:
    degrees: Degrees
    settings: MegatronSettings
    plan: Plan
    memory: list[dict[str, float]]
    time: float | None = None


def _build(request: PlanRequest, degrees: Degrees, settings: MegatronSettings, contrastive: bool) -> _Candidate:
    builder = colocated_program if contrastive else pipeline_program
    program, unit_plans, _ = builder(request.model, request.cluster, request.train.global_batch,
                                     request.train.precision, degrees, settings)
    units = {u.unit: u for u in unit_plans}
    memory = [rank_memory(rp, units, request.model, request.train.precision) for rp in program.classes]
    plan = Plan(strategy="megatron", devices=program.world_size, units=unit_plans, program=program,
                details={"tp": degrees.tp, "pp": degrees.pp, "dp": degrees.dp, "vpp": degrees.vpp,
                         "micro_batch": degrees.micro_batch, "schedule": settings.schedule,
                         "recompute": settings.recompute, "sequence_parallel": settings.sequence_parallel,
                         "zero_stage": settings.zero_stage, "placement": "colocated" if contrastive else "pipeline"})
    return _Candidate(degrees, settings, plan, memory)


def _over_memory(request: PlanRequest, candidate: _Candidate) -> str | None:
    usable = request.cluster.usable_memory_bytes
    worst = max(range(len(candidate.memory)), key=lambda i: candidate.memory[i]["total"])
    need = candidate.memory[worst]
    if need["total"] <= usable:
        return None
    d = candidate.degrees
    parts = ", ".join(f"{k} {need[k] / GIB:.1f}" for k in ("weights", "grads", "optimizer", "activations"))
    label = candidate.plan.program.classes[worst].label
    return (f"megatron tp={d.tp} pp={d.pp} dp={d.dp} micro-batch={d.micro_batch} "
            f"recompute={candidate.settings.recompute} zero_stage={candidate.settings.zero_stage}: {label} needs "
            f"{need['total'] / GIB:.1f} GiB ({parts}) but a {request.cluster.device} has "
            f"{usable / GIB:.1f} GiB usable, short by {(need['total'] - usable) / GIB:.1f} GiB")


def _search(request: PlanRequest, opts: MegatronOptions, contrastive: bool, searched: bool, across_nodes: bool,
            tried: list[_Candidate], rejected: list[str]) -> None:
    """Build every candidate of the space; keep those that fit, note why others do not."""
    for tp in _tp_choices(request, opts, across_nodes):
        for pp in _pp_choices(request, opts, contrastive):
            try:
                dp = _check_degrees(request, opts, tp, pp)
                micro_batches = _micro_batches(request, opts, dp, contrastive)
            except ConfigError as err:
                if not searched:
                    raise
                rejected.append(str(err))
                continue
            for mb in micro_batches:
                candidate = _first_fitting(request, opts, Degrees(tp, pp, dp, opts.vpp, mb), contrastive,
                                           searched, rejected)
                if candidate is not None:
                    tried.append(candidate)
                    if contrastive:
                        break  # the largest micro-batch that fits: accumulation only costs time here


def _first_fitting(request: PlanRequest, opts: MegatronOptions, degrees: Degrees, contrastive: bool,
                   searched: bool, rejected: list[str]) -> _Candidate | None:
    for settings in opts.settings():
        try:
            candidate = _build(request, degrees, settings, contrastive)
        except ConfigError as err:
            if not searched:
                raise
            rejected.append(str(err))
            return None
        problem = _over_memory(request, candidate)
        if problem is None:
            return candidate
        rejected.append(problem)
    return None


def plan_megatron(request: PlanRequest) -> Plan:
    opts = options_from(MegatronOptions, request.options)
    contrastive = request.model.interaction is not None
    if contrastive and opts.pp not in (None, 1):
        raise ConfigError(f"strategy.pp={opts.pp}: the Megatron-LM baseline of contrastive models uses only TP "
                          f"and DP (pipelining would shrink the contrastive batch; DistMM §5.4, §7.1)")
    searched = (opts.tp is None or (opts.pp is None and not contrastive) or opts.micro_batch_size is None
                or opts.recompute is None or opts.zero_stage is None)
    tried: list[_Candidate] = []
    rejected: list[str] = []
    for across_nodes in (False, True):
        if tried or (across_nodes and opts.tp is not None):
            break
        _search(request, opts, contrastive, searched, across_nodes, tried, rejected)
    if not tried:
        if not rejected:
            raise PlanError(f"no Megatron-LM plan exists for {request.model.name} on {request.cluster.devices} devices")
        memory = [r for r in rejected if "short by" in r]
        if not searched or not memory:
            raise PlanError(rejected[0])
        raise PlanError(f"no Megatron-LM plan fits memory ({len(rejected)} candidates rejected); closest: "
                        f"{_closest(memory)}")
    if len(tried) > 1:
        _time_candidates(request, tried)
    timed = [c for c in tried if c.time is not None] or tried
    best = min(timed, key=lambda c: (c.time or 0.0, c.degrees.tp, c.degrees.pp))
    best.plan.details["search"] = {
        "searched": searched,
        "candidates_fitting": len(tried),
        "candidates_simulated": len(timed),
        "candidates_rejected": len(rejected),
        "ranking": [{"tp": c.degrees.tp, "pp": c.degrees.pp, "dp": c.degrees.dp, "micro_batch": c.degrees.micro_batch,
                     "recompute": c.settings.recompute, "zero_stage": c.settings.zero_stage,
                     "iteration_time_s": c.time} for c in sorted(timed, key=lambda c: c.time or 0.0)[:5]],
    }
    best.plan.details["memory_gib"] = {rp.label: round(m["total"] / GIB, 3)
                                       for rp, m in zip(best.plan.program.classes, best.memory)}
    return best.plan


def _time_candidates(request: PlanRequest, candidates: list[_Candidate]) -> None:
    """Simulate candidates in order of their compute lower bound, skipping those whose
    bound already exceeds the best simulated time: the fastest plan is the same as when
    simulating all of them (branch and bound), in a fraction of the time."""
    compute = ComputeModel(request.cluster, request.train.precision)
    bounds = {id(c): compute_lower_bound(c.plan.program, request.model, compute) for c in candidates}
    best = float("inf")
    for candidate in sorted(candidates, key=lambda c: bounds[id(c)]):
        if bounds[id(candidate)] >= best:
            break
        candidate.time = simulate(candidate.plan.program, request.model, request.cluster,
                                  request.train.precision, compute).iteration_time
        best = min(best, candidate.time)


def _closest(rejected: list[str]) -> str:
    """The memory rejection short by the least."""
    return min(rejected, key=lambda message: float(message.rsplit("short by ", 1)[1].split()[0]))
