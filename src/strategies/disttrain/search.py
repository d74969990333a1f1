"""DistTrain's decision among the orchestration's best choices, as the Megatron-LM search
decides: rank by the model, decide by simulation.

The orchestration (Algorithm 1) ranks its integer choices by a 1F1B model of nominal
micro-batches. Each of the best few is then laid out as the Program would be: the batch's
sequences placed by the reordering (data.py), every replica's micro-batch loads, and the
iteration timed stage by stage with those loads (timing.py), which is the estimate the
plan reports. The best by that estimate are built and simulated, with the ratio-based
plan (§8.2.1's baseline) beside them, and the fastest simulated plan that fits memory is
the plan: never slower than the ratio baseline or any plan simulated.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

from src.data.loads import BatchLoads
from src.cluster import gib
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import rank_memory
from src.models.spec import ModelSpec
from src.program import Program, UnitPlan, compress_ranks
from src.schedules.pipeline import PipeOp
from src.sim.engine import simulate
from src.strategies.base import PlanRequest
from src.data.balance import Dealt
from src.data.disaggregated import Assignment, Reordering, dealt_unit_loads, unit_loads
from src.strategies.disttrain.orchestration import UNITS, Choice, Orchestrator, UnitChoice, broker_end
from src.strategies.disttrain.profile import StageArrays
from src.schedules.chain import Chain, Deadlock, chain_orders
from src.strategies.builders.layout import replicated_mesh
from src.strategies.disttrain.programs import Broker, UnitLayout, disttrain_program, place
from src.strategies.disttrain.timing import Hop, dag_ends

# How many of the orchestration's choices are timed against the batch's data by default
# (strategy.ranked), of how many distinct LLM shapes the best choice is timed beside them
# (strategy.ranked_shapes: the best few can be near-copies of one shape, which the data's
# skew slows alike), and how many of those (the best by that estimate) are simulated.
# The skew costs a deep LLM pipeline most, so the data's best shape can rank well down at the
# mean load: on DistTrain Fig. 15's MLLM-15B 17th of about a thousand shapes, the best of all of
# them timed beside the 64 choices below (benchmarks/disttrain_shape_breadth.py: 8.333 s at 8
# shapes, 8.170 at 16, 7.890 at 32 and at all); 32 covers it (MLLM-9B's leads at 64 choices).
# Which choices the data ranks first is not the shape alone (a generator replicated wider, its
# micro-batches of several sequences dealt out, absorbs a heavy sequence): timed from 8 to 256
# under train.balance=cost (benchmarks/results/disttrain_choice_breadth.md), Fig. 15's MLLM-9B
# finds its plan at 64 (4.900 -> 4.773 s; it ranks 55th at the mean load), and doubling further
# gains at most 1.1 % a doubling (MLLM-15B 7.827 -> 7.741 -> 7.724 s at 128 and 256) for 1.3-1.9x
# the plan's CPU.
RANKED = 64
RANKED_SHAPES = 32
SIMULATED = 3


@dataclass
class Candidate:
    """One integer choice of the orchestration on its way to a plan."""

    choice: Choice
    microbatches: int
    model_s: float  # the orchestration's 1F1B model
    origin: str  # which orchestration found it
    reordering: Reordering | None = None
    assignment: Assignment | None = None  # the reordering on the batch's loads
    layouts: list[UnitLayout] = field(default_factory=list)
    estimate_s: float = math.inf  # timed with the batch's loads
    program: Program | None = None
    brokers: list[Broker] = field(default_factory=list)
    units: list[UnitPlan] = field(default_factory=list)
    simulated_s: float | None = None
    memory: dict[str, tuple[float, str]] = field(default_factory=dict)  # per unit: its fullest rank class

    def describe(self) -> str:
        return "; ".join(f"{c.unit} tp{c.tp} dp{c.dp} pp{c.pp}" for c in self.choice)

    def record(self) -> dict:
        return {
            "origin": self.origin,
            "units": {c.unit: _choice_record(c) for c in self.choice},
            "microbatches": self.microbatches,
            "model_s": round(self.model_s, 6),
            "estimate_s": round(self.estimate_s, 6),
            "simulated_s": None if self.simulated_s is None else round(self.simulated_s, 6),
        }


def _choice_record(c: UnitChoice) -> dict:
    s = c.setting
    return {
        "tp": c.tp,
        "dp": c.dp,
        "pp": c.pp,
        "vpp": s.vpp,
        "recompute": s.recompute,
        "sequence_parallel": s.sequence_parallel,
        "scatter_gather": s.scatter_gather,
        "zero_stage": s.zero_stage,
    }


class Decision:
    """Times, builds and simulates candidates of one request."""

    def __init__(self, request: PlanRequest, orchestrator: Orchestrator, loads: BatchLoads, reorder: str, chunks: int) -> None:
        self.request, self.o, self.loads, self.reorder, self.chunks = request, orchestrator, loads, reorder, chunks
        self.compute = ComputeModel(request.cluster, request.train.precision)

    # ---- the estimate ----------------------------------------------------------------------
    def estimate(self, candidate: Candidate) -> None:
        """Place the batch's sequences, lay the units out, and time the iteration with
        every micro-batch's load; infinite where a stage's memory does not hold the
        forwards its order keeps in flight."""
        choice, m = candidate.choice, candidate.microbatches
        candidate.reordering = self._reordering(choice)
        candidate.assignment = candidate.reordering.assignment(self.loads.by_unit["encoder"], self.loads.by_unit["generator"])
        candidate.layouts = [self._layout(c, candidate.assignment, m) for c in choice]
        chain = Chain(tuple((c.pp, c.setting.vpp) for c in choice))
        try:
            orders = chain_orders(chain, m)
        except Deadlock:
            return  # interleaved units (by hand) whose orders wait on each other: not a plan
        stages = [self.o.stages(c) for c in choice]
        if not self._fits(choice, stages, orders):
            return
        offsets = {layout.unit: layout.offset for layout in place(candidate.layouts)}
        hops = [self.o.p.hops(c.unit, c.setting, c.micro_batch, c.dp, c.pp, offsets[c.unit]) for c in choice]
        brokers = [self.o.p.broker_parts(broker_end(a), broker_end(b)) for a, b in zip(choice, choice[1:])]
        firsts = itertools.accumulate((c.pp for c in choice), initial=0)
        stage_orders = [orders[first : first + c.pp] for first, c in zip(firsts, choice)]
        ends = [0.0] * len(orders)
        for group in _groups(choice):
            found = self._group_ends(choice, candidate.layouts, stages, stage_orders, hops, brokers, group)
            ends = [max(a, b) for a, b in zip(ends, found)]
        tails = [float(t) for arrays in stages for t in arrays.tail]
        candidate.estimate_s = max(end + tail for end, tail in zip(ends, tails))

    def _group_ends(
        self,
        choice: Choice,
        layouts: list[UnitLayout],
        stages: list[StageArrays],
        stage_orders: list[list[list[PipeOp]]],
        hops: list[tuple[float, ...]],
        brokers: list[tuple[float, float]],
        group: range,
    ) -> list[float]:
        """When each stage of a group of LLM replicas run in step ends its last operation:
        every replica of each unit that serves the group, each with its own micro-batch
        loads; an LLM replica's forward waits for its encoder replica's, a generator
        replica's for those of all the LLM replicas it serves, and backwards the other way
        (timing.dag_ends). Per stage of the chain, the last of its replicas' ends."""
        llm_dp = choice[1].dp
        fwd: list[list[float]] = []
        bwd: list[list[float]] = []
        before: list[tuple[Hop, ...]] = []
        trains: list[bool] = []
        orders: list[list[PipeOp]] = []
        virtual_of: list[list[int]] = []
        lanes: list[int] = []  # per order: its stage of the chain
        last: list[dict[int, int]] = []  # per unit: its replicas' last virtual stage
        first_stage = 0
        for k, (c, layout, arrays) in enumerate(zip(choice, layouts, stages)):
            depth = c.pp * c.setting.vpp
            trained = self.request.model.needs_backward(c.unit)
            last.append({})
            for d in sorted({r * c.dp // llm_dp for r in group}):
                base = len(fwd)
                load = layout.loads[d]
                for v in range(depth):
                    fwd.append([float(arrays.fwd[v]) * x for x in load])
                    bwd.append([float(arrays.bwd[v]) * x for x in load])
                    trains.append(trained)
                    if v:
                        before.append(((base + v - 1, hops[k][v - 1], hops[k][v - 1]),))
                    elif k:
                        there, back = brokers[k - 1]
                        fed = {r * choice[k - 1].dp // llm_dp for r in group if r * c.dp // llm_dp == d}
                        before.append(tuple((last[k - 1][e], there, back) for e in sorted(fed)))
                    else:
                        before.append(())
                last[k][d] = base + depth - 1
                for s, order in enumerate(stage_orders[k]):
                    orders.append(order)
                    virtual_of.append([base + chunk * c.pp + s for chunk in range(c.setting.vpp)])
                    lanes.append(first_stage + s)
            first_stage += c.pp
        ends = dag_ends(orders, virtual_of, fwd, bwd, before, trains)
        per_stage = [0.0] * first_stage
        for stage, end in zip(lanes, ends):
            per_stage[stage] = max(per_stage[stage], end)
        return per_stage

    def _fits(self, choice: Choice, stages: list[StageArrays], orders: list[list[PipeOp]]) -> bool:
        """Each stage's memory (StageArrays.holds) with the unit's heaviest load in flight."""
        usable = self.request.cluster.usable_memory_bytes
        firsts = itertools.accumulate((c.pp for c in choice), initial=0)
        units = zip(choice, stages, firsts)
        return all(arrays.holds(orders[first : first + c.pp], self.loads.peak[c.unit], usable) for c, arrays, first in units)

    def _reordering(self, choice: Choice) -> Reordering:
        enc, llm, gen = choice
        stages = {c.unit: self.o.stages(c) for c in choice}
        per_sequence = (float(stages[enc.unit].fb.sum()) / enc.micro_batch, float(stages[gen.unit].fb.sum()) / gen.micro_batch)
        fwd, bwd = (tuple(tuple(getattr(stages[u], phase).tolist()) for u in UNITS) for phase in ("fwd", "bwd"))
        chain = Chain(tuple((c.pp, c.setting.vpp) for c in choice))
        return Reordering(self.reorder, llm.dp, enc.dp, gen.dp, per_sequence, fwd, bwd, chain)

    def _layout(self, c: UnitChoice, assignment: Assignment, m: int) -> UnitLayout:
        per_sequence = self.loads.of(c.unit)
        spec = self.request.model.unit(c.unit)
        if per_sequence is None:
            loads = ((1.0,) * m,) * c.dp
        elif c.setting.replicated and spec.arch.per_image:
            dealt = Dealt(c.unit, c.tp, spec.arch.images)
            loads = dealt_unit_loads(assignment, self.loads.per_image(c.unit), c.dp, m, dealt)
        else:
            loads = unit_loads(assignment, per_sequence, c.dp, m)
        return UnitLayout(c.unit, c.dp, c.pp, c.micro_batch, c.setting, self.o.stages(c).layers, 0, loads)

    # ---- the Program -----------------------------------------------------------------------
    def build(self, candidate: Candidate) -> None:
        request = self.request
        model, cluster, train = request.model, request.cluster, request.train
        layouts = place(candidate.layouts)
        candidate.program, candidate.brokers = disttrain_program(
            model, cluster, train.precision, train.global_batch, candidate.microbatches, layouts, self.chunks
        )
        by_unit = {u.unit: u for u in layouts}
        candidate.units = [_unit_plan(cluster, by_unit[u], candidate.microbatches) for u in UNITS]
        candidate.memory = _memory(candidate.program, candidate.units, model, train.precision, cluster.amp)

    def fits(self, candidate: Candidate) -> bool:
        usable = self.request.cluster.usable_memory_bytes
        return all(need <= usable for need, _ in candidate.memory.values())

    def simulate(self, candidate: Candidate) -> None:
        assert candidate.program is not None, "built before it is simulated"
        request = self.request
        result = simulate(candidate.program, request.model, request.cluster, request.train.precision, self.compute)
        candidate.simulated_s = result.iteration_time


def _groups(choice: Choice) -> list[range]:
    """LLM replicas that run in step: joined through a shared encoder or generator replica."""
    enc, llm, gen = choice
    b_me, b_mg = llm.dp // enc.dp, llm.dp // gen.dp
    width = b_me * b_mg // math.gcd(b_me, b_mg)
    return [range(first, first + width) for first in range(0, llm.dp, width)]


def _unit_plan(cluster, layout: UnitLayout, m: int) -> UnitPlan:
    s = layout.setting
    # A replicated unit's plan has the rows axis where the others have tp (layout.replicated_mesh).
    mesh = replicated_mesh(layout.mesh, 0) if s.replicated else layout.mesh
    return UnitPlan(
        unit=layout.unit,
        mesh=mesh,
        micro_batch=layout.micro_batch,
        num_microbatches=m,
        batch_per_replica=m * layout.micro_batch,
        stage_layers=layout.stages,
        sample_groups=m,
        vpp=s.vpp,
        zero_stage=s.zero_stage,
        recompute=s.recompute,
        sequence_parallel=s.sequence_parallel,
        details={
            "nodes": compress_ranks(tuple(sorted({cluster.node_of(r) for r in mesh.ranks}))),
            "max_load": round(max(max(row) for row in layout.loads), 3),
            "scatter_gather": s.scatter_gather,
        },
    )


def _memory(program: Program, units: Sequence[UnitPlan], model: ModelSpec, precision: str, amp: bool) -> dict[str, tuple[float, str]]:
    """Every unit's fullest rank class as the Program holds it (loads included)."""
    by_name = {u.unit: u for u in units}
    worst: dict[str, tuple[float, str]] = {}
    for rank_program in program.classes:
        need = rank_memory(rank_program, by_name, model, precision, amp)["total"]
        unit = rank_program.units[0]
        if need > worst.get(unit, (0.0, ""))[0]:
            worst[unit] = (need, rank_program.label)
    return worst


def memory_problem(request: PlanRequest, candidate: Candidate) -> str:
    usable = request.cluster.usable_memory_bytes
    unit, (need, label) = max(candidate.memory.items(), key=lambda item: item[1][0] - usable)
    return (
        f"disttrain: {label} ({unit} of {candidate.describe()}) needs {gib(need)} GiB but a "
        f"{request.cluster.device} has {gib(usable)} GiB usable, short by {gib(need - usable)} GiB"
    )
