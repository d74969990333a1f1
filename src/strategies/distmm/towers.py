"""DistMM's per-tower view: the modality-aware partitioner (§5.1) and the cost model's
estimate of one tower's iteration time and memory, which the load balancer minimises.

A tower (a modal submodule: vision, text) is parallelised on its own: tp inside a node,
pp across nodes, `replicas` data-parallel copies each taking `batch` samples per
iteration. The estimates price the same Work items the Program will hold, with the same
ComputeModel/CommModel; the simulator then prices the Program itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from src.batch_layout import BatchLayout
from src.cluster import gib, ClusterSpec, family_sharing
from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import (
    element_bytes,
    grad_bytes,
    memory_ladder,
    model_state_bytes,
    rematerialised_bytes,
    states_precision,
    weight_bytes,
    zero_shards,
)
from src.errors import PlanError
from src.models.spec import ModelSpec, UnitSpec
from src.mesh import tensor_parallel
from src.program import Phase, Work
from src.schedules.distmm_pipe import build_sync_schedule, resident
from src.strategies.base import Degrees
from src.strategies.builders.contrastive import interaction_of
from src.strategies.builders.layout import megatron_mesh, pipeline_pairs
from src.strategies.builders.stages import block_cuts, boundary_elems


@dataclass(frozen=True)
class TowerPlan:
    """One tower's complete parallelisation. Each of the iteration's `groups` batch-sync
    groups takes batch/groups samples of every replica, run as `microbatches` micro-batches."""

    unit: str
    tp: int
    pp: int
    replicas: int
    batch: int
    groups: int
    microbatches: int
    recompute: str
    zero_stage: int
    stages: tuple[tuple[int, int], ...]
    schedule: str = "distmm_pipe"

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.replicas

    @property
    def share(self) -> int:
        """Samples of one replica in one batch-sync group."""
        return self.batch // self.groups

    @property
    def micro_batch(self) -> int:
        return self.share // self.microbatches

    def batch_layout(self) -> BatchLayout:
        return BatchLayout(self.batch * self.replicas, self.replicas, self.micro_batch, self.groups)


def stage_ranges(unit: UnitSpec, pp: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges of the tower's pipeline stages (cut between blocks, unequal depths
    allowed: DistMM is not bound by Megatron's divisibility rule)."""
    return tuple(block_cuts(unit, pp, uneven=True, what="pp"))


def blocks_of(unit: UnitSpec) -> int:
    return sum(1 for layer in unit.layers if layer.tp_allreduces > 0) or unit.num_layers


def tp_degrees(unit: UnitSpec, limit: int) -> list[int]:
    """Powers of two up to `limit` that divide the tower's heads."""
    out, tp = [], 1
    while tp <= limit:
        if unit.heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def replica_state_bytes(unit: UnitSpec, layers: tuple[int, int], tp: int, precision: str) -> float:
    """Unsharded model states of one stage on one TP rank (no ZeRO): what "the tower fits
    on d devices" means in DistMM §7 ("trainable on a single device")."""
    params = sum(layer.params for layer in unit.layers[layers[0] : layers[1]]) / tp
    return sum(model_state_bytes(params, precision, unit.frozen, 0, 1).values())


def activation_per_sample(unit: UnitSpec, layers: tuple[int, int], tp: int, recompute: str) -> float:
    sharding = tensor_parallel(tp)
    return sum(layer.kept_activations(sharding, recompute) for layer in unit.layers[layers[0] : layers[1]])


def _fits(unit: UnitSpec, degrees: Degrees, precision: str, usable: float) -> bool:
    ranges = stage_ranges(unit, degrees.pp)
    return all(
        replica_state_bytes(unit, r, degrees.tp, precision) + activation_per_sample(unit, r, degrees.tp, "none") <= usable
        for r in ranges
    )


def partition(unit: UnitSpec, cluster: ClusterSpec, precision: str, tp: int | None = None, pp: int | None = None) -> Degrees:
    """§5.1: DP if one replica (model states + one sample's activations) fits a device;
    else the smallest TP inside a node that fits; else TP over the node and the fewest
    pipeline stages across nodes that fit. A degree given by hand is kept."""
    usable = cluster.usable_memory_bytes
    node = cluster.devices_per_node
    precision = states_precision(precision, cluster.amp)  # only the model states read it below
    tps = [tp] if tp is not None else tp_degrees(unit, node)
    if pp is not None:
        candidates = [Degrees(t, pp) for t in tps]
    else:
        candidates = [Degrees(t, 1) for t in tps]
        across = max(tps)
        candidates += [Degrees(across, p) for p in range(2, blocks_of(unit) + 1) if across * p <= cluster.devices]
    for degrees in candidates:
        if degrees.replica_devices <= cluster.devices and _fits(unit, degrees, precision, usable):
            return degrees
    total = replica_state_bytes(unit, (0, unit.num_layers), 1, precision)
    have = usable * cluster.devices
    if total > have:
        raise PlanError(
            f"distmm: tower {unit.name} ({unit.params / 1e9:.2f}B parameters) needs {gib(total)} GiB "
            f"of model states, more than the {gib(have)} GiB of all {cluster.devices} devices of "
            f"cluster {cluster.name}: short by {gib(total - have)} GiB"
        )
    finest = candidates[-1]
    need = max(
        replica_state_bytes(unit, r, finest.tp, precision) + activation_per_sample(unit, r, finest.tp, "none")
        for r in stage_ranges(unit, finest.pp)
    )
    raise PlanError(
        f"distmm: tower {unit.name} fits no tp x pp on cluster {cluster.name}: even at tp={finest.tp} "
        f"pp={finest.pp} its fullest stage needs {gib(need)} GiB, a device has {gib(usable)} GiB "
        f"usable, short by {gib(need - usable)} GiB"
    )


def phase_weights(groups: int) -> tuple[float, float, float, float]:
    """How often each phase of `TowerCosts.phases` occurs in an iteration of `groups`
    batch-sync groups: once before, g batch-syncs, g - 1 periods between them, once after."""
    return (1.0, float(groups), float(groups - 1), 1.0)


@lru_cache(maxsize=None)
def _resident(schedule: str, stages: int, groups: int, k: int) -> tuple[int, ...]:
    """Micro-batches each stage keeps alive under the schedule (the balancer asks often)."""
    return tuple(resident(order) for order in build_sync_schedule(schedule, stages, groups, k))


@dataclass
class TowerCosts:
    """Prices towers on one cluster: the balancer's T_k and Mem_k. Caches by plan."""

    model: ModelSpec
    cluster: ClusterSpec
    precision: str
    contrastive_batch: int

    @cached_property
    def compute(self) -> ComputeModel:
        return ComputeModel(self.cluster, self.precision)

    @cached_property
    def comm(self) -> CommModel:
        return CommModel(self.cluster)

    @property
    def act_bytes(self) -> int:
        return element_bytes(self.precision)

    def memory(self, plan: TowerPlan) -> float:
        """Bytes of the fullest device of the tower: its stage's states (ZeRO-1 shards
        the optimizer over the replicas) and the activations its schedule keeps alive,
        as costmodel.memory.rank_memory counts them."""
        unit = self.model.unit(plan.unit)
        worst = 0.0
        for stage, layers in enumerate(plan.stages):
            params = sum(layer.params for layer in unit.layers[layers[0] : layers[1]]) / plan.tp
            states = sum(
                model_state_bytes(
                    params, states_precision(self.precision, self.cluster.amp), unit.frozen, plan.zero_stage, plan.replicas
                ).values()
            )
            activations = 0.0
            if self.model.needs_backward(unit.name):
                live = _resident(plan.schedule, plan.pp, plan.groups, plan.microbatches)[stage]
                activations = live * plan.micro_batch * activation_per_sample(unit, layers, plan.tp, plan.recompute)
                if plan.recompute == "full":
                    activations += plan.micro_batch * rematerialised_bytes(
                        unit.layers[layers[0] : layers[1]], tensor_parallel(plan.tp)
                    )
            worst = max(worst, states + activations)
        return worst

    def _pass(self, plan: TowerPlan, layers: tuple[int, int], phase: Phase) -> float:
        unit = self.model.unit(plan.unit)
        if phase == "bwd" and not self.model.needs_backward(unit.name):
            return 0.0
        work = Work(
            unit.name,
            phase,
            plan.micro_batch,
            layers,
            sharding=tensor_parallel(plan.tp),
            recompute=plan.recompute if phase == "bwd" else "none",
        )
        seconds = self.compute.work_time(work, self.model)
        if plan.tp > 1:
            group = tuple(range(plan.tp))
            for layer in unit.layers[layers[0] : layers[1]]:
                if layer.tp_allreduces:
                    seconds += layer.tp_collectives(phase == "bwd", work.recompute) * self.comm.collective_time(
                        "all_reduce", group, layer.tp_comm_elems * plan.micro_batch * self.act_bytes
                    )
        return seconds

    def interaction_time(self, plan: TowerPlan) -> float:
        """The tower's shard of one batch-sync: its local rows (split over its TP ranks)
        against the whole contrastive batch."""
        inter = self.model.unit(interaction_of(self.model))
        rows = math.ceil(plan.share / plan.tp)
        work = Work(inter.name, "interaction", rows, (0, inter.num_layers), contrastive_batch=self.contrastive_batch)
        return self.compute.work_time(work, self.model)

    def phases(self, plan: TowerPlan) -> tuple[float, float, float, float]:
        """The tower's iteration cut where the towers align (`phase_weights`): before the
        first batch-sync, one batch-sync (its shard of the interaction), one period between
        two batch-syncs, after the last one (drain, gradient reduction, optimizer step).
        Its pipeline (fill, steady state and drain of the schedule) is priced at a
        placement starting on a node boundary; the edge of the schedule (what is not a
        repeated period) is split before/after the barrier in the proportion of forward to
        backward work, exact without a pipeline (one forward before, one backward after)."""
        unit = self.model.unit(plan.unit)
        fwd = [self._pass(plan, r, "fwd") for r in plan.stages]
        bwd = [self._pass(plan, r, "bwd") for r in plan.stages]
        hop = 0.0
        if plan.pp > 1:
            mesh = megatron_mesh(plan.tp, plan.replicas, plan.pp)
            elems = boundary_elems(unit, plan.stages[0][1]) * plan.micro_batch * self.act_bytes
            hop = self.comm.p2p_time(mesh.rank(pp=0), mesh.rank(pp=1), elems, family_sharing(self.cluster, pipeline_pairs(mesh)))
        fill = sum(fwd) + sum(bwd) + 2 * hop * (plan.pp - 1)
        steady = max(f + b for f, b in zip(fwd, bwd))
        edge = fill + (plan.microbatches - 1) * steady
        # gpipe_sync drains the pipeline at every barrier: each period is a whole edge;
        # DistMM-Pipe keeps it full: a period is k steady steps.
        period = edge if plan.schedule == "gpipe_sync" or plan.pp == 1 else plan.microbatches * steady
        forward = sum(fwd) / (sum(fwd) + sum(bwd)) if sum(fwd) + sum(bwd) > 0 else 1.0
        return (forward * edge, self.interaction_time(plan), period, (1 - forward) * edge + self.tail_time(plan))

    def time(self, plan: TowerPlan) -> float:
        """Seconds of one iteration of the tower alone (no waiting on other towers)."""
        return sum(w * p for w, p in zip(phase_weights(plan.groups), self.phases(plan)))

    def tail_time(self, plan: TowerPlan) -> float:
        """Gradient reduce (+ parameter all-gather under ZeRO-1) and optimizer step of the
        slowest stage."""
        unit = self.model.unit(plan.unit)
        if unit.frozen:
            return 0.0
        mesh = megatron_mesh(plan.tp, plan.replicas, plan.pp)
        sharing = family_sharing(self.cluster, mesh.family("dp"))
        worst = 0.0
        for stage, layers in enumerate(plan.stages):
            params = sum(layer.params for layer in unit.layers[layers[0] : layers[1]]) / plan.tp
            group = mesh.group("dp", mesh.rank(pp=stage))
            seconds = 0.0
            if plan.replicas > 1:
                if plan.zero_stage >= 1:
                    seconds += self.comm.collective_time("reduce_scatter", group, params * grad_bytes(self.precision), sharing)
                    seconds += self.comm.collective_time(
                        "all_gather", group, params * weight_bytes(self.precision, self.cluster.amp), sharing
                    )
                else:
                    seconds += self.comm.collective_time("all_reduce", group, params * grad_bytes(self.precision), sharing)
            shard = zero_shards(plan.replicas, plan.zero_stage).optimizer
            seconds += self.compute.work_time(
                Work(unit.name, "optimizer", 0, layers, sharding=tensor_parallel(plan.tp), shard=shard), self.model
            )
            worst = max(worst, seconds)
        return worst

    def best(
        self,
        unit: str,
        degrees: Degrees,
        replicas: int,
        batch: int,
        groups: int,
        schedule: str,
        settings: tuple[tuple[str, int], ...] = memory_ladder(),
        microbatches: int | None = None,
    ) -> tuple[TowerPlan, float] | None:
        """The fastest plan of a tower at this size that fits memory: the cheapest
        memory-saving settings that fit, and (pipelined towers) the micro-batch count per
        batch-sync group unless `microbatches` fixes it. None if nothing fits."""
        share = batch // groups
        stages = stage_ranges(self.model.unit(unit), degrees.pp)
        if degrees.pp == 1:
            counts = [1]  # every forward of a group stays resident until its batch-sync anyway
        elif microbatches is not None:
            counts = [microbatches] if share % microbatches == 0 else []
        else:
            counts = [k for k in range(1, share + 1) if share % k == 0]
        usable = self.cluster.usable_memory_bytes
        for recompute, zero in settings:
            best: tuple[TowerPlan, float] | None = None
            for k in counts:
                plan = TowerPlan(unit, degrees.tp, degrees.pp, replicas, batch, groups, k, recompute, zero, stages, schedule)
                if self.memory(plan) > usable:
                    continue
                seconds = self.time(plan)
                if best is None or seconds < best[1]:
                    best = (plan, seconds)
            if best is not None:
                return best
        return None
