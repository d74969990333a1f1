"""The Program of an Optimus schedule: the LLM's pipeline stages with the encoders' work
inserted where the bubble scheduler placed it (Optimus §4.2-4.3).

Per rank class (LLM stage s, column c; strategies.optimus.encoder.Layout):
  the LLM's parameter all-gather (asynchronous) | the pre-bubble encoder forwards | wait |
  the LLM's schedule operations, each preceded by the encoder kernels placed in the gap
  before it and the encoder all-reduces issued to overlap its compute, and with the
  kernels placed in its TP bins between its (now asynchronous) all-reduces and their
  waits | the LLM's gradient reduce-scatter (asynchronous) | the post-bubble encoder
  backwards | wait | the LLM's optimizer step | the encoder's gradient reduction,
  optimizer step and parameter all-gather.

Data flow: an encoder stage receives its input over the encoder's hop routes (forward: from
the previous stage, backward: from the next) before its first kernel and sends its output
after its last; the encoder pipeline's last stage sends its output to every first-stage
rank of the LLM (route `<encoder>.to_llm`), which the LLM's first segment consumes (a
chain flow, tensor 'x'), and one first-stage LLM rank per encoder rank sends the gradient
back (`<encoder>.to_llm.grad`). An encoder micro-batch is named by the LLM micro-batch it
becomes (the global order of CheckEncLLMDep).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from src.cluster import ClusterSpec
from src.costmodel.memory import element_bytes, grad_bytes, weight_bytes
from src.mesh import tensor_parallel
from src.models.spec import ModelSpec
from src.program import Collective, Compute, Hop, Instruction, Message, Payload, Phase, Program, RankProgram, Recv, Send, Wait, Work
from src.strategies.builders.emit import TPConfig, iteration_tail, range_io, segment_pass
from src.strategies.builders.layout import axis_group, table
from src.strategies.optimus.encoder import EncoderCosts, Layout
from src.strategies.optimus.scheduler import Placed, Schedule
from src.strategies.builders.pipeline import Stage
from src.strategies.builders.stages import Segment, boundary_elems
from src.cluster import family_sharing

ENC_SEND, ENC_RECV, ENC_TP, ENC_DP = "enc_send", "enc_recv", "enc_tp", "enc_dp"
LLM_GATHER, LLM_REDUCE = "llm.gather", "llm.reduce"
Loads = Mapping[str, tuple[float, ...]]  # encoder -> load of each LLM micro-batch's sequences


def to_llm(unit: str) -> str:
    return f"{unit}.to_llm"


class EncoderLinks:
    """The LLM pipeline's side of the hand-off: its first segment receives each encoder's
    output and sends back its gradient."""

    def __init__(self, encoders: list[str]) -> None:
        self.encoders = set(encoders)

    def receive(self, payload: Payload) -> list[Instruction]:
        if payload.unit not in self.encoders or payload.grad:
            raise ValueError(f"the LLM pipeline reads {payload}, which no encoder provides")
        return [Recv(to_llm(payload.unit), payload)]

    def send(self, payload: Payload) -> list[Instruction]:
        if payload.unit not in self.encoders or not payload.grad:
            raise ValueError(f"the LLM pipeline sends {payload} out, which no encoder reads")
        return [Send(f"{to_llm(payload.unit)}.grad", payload)]


@dataclass
class EncoderRoutes:
    """Names of one encoder's groups and routes in the Program."""

    tp_group: str | None
    dp_groups: list[str | None]
    hops: list[str]


def add_encoder_routes(
    model: ModelSpec,
    cluster: ClusterSpec,
    precision: str,
    program: Program,
    layout: Layout,
    costs: EncoderCosts,
    unit: str,
    samples: int,
    mapping_pipeline: dict[int, int],
) -> EncoderRoutes:
    """Groups (TP, DP per stage), hop routes between encoder stages and the hand-off
    routes to the LLM's first stage. `mapping_pipeline`: LLM micro-batch -> pipeline."""
    mesh = layout.encoder_mesh()
    act = element_bytes(precision)
    tp_group = axis_group(program, cluster, f"{unit}.tp", mesh, "tp", mesh.ranks[0])
    dp_groups = [axis_group(program, cluster, f"{unit}.dp.e{e}", mesh, "dp", mesh.rank(pp=e)) for e in range(layout.plan.pp)]
    hops = []
    for e in range(layout.plan.pp - 1):
        a, b = mesh.slice(pp=e), mesh.slice(pp=e + 1)
        nbytes = boundary_elems(model.unit(unit), costs.layers[unit][e][1]) * samples * act
        route = Hop(f"{unit}.hop.e{e}", "pp", a, b, nbytes, family_sharing(cluster, list(zip(a, b))))
        program.add_route(route)
        hops.append(route.name)
    spec = model.unit(unit)
    nbytes = spec.output_elems * samples * act
    forward, backward = [], []
    llm, tp_enc, last = layout.llm, layout.plan.tp, layout.plan.pp - 1
    for r in range(llm.degree("dp")):
        for i, pipeline in sorted(mapping_pipeline.items()):
            k, c = divmod(pipeline, layout.columns)
            payload = Payload(unit, spec.num_layers, i)
            for u in range(llm.degree("tp")):
                src = layout.rank(u % tp_enc, c, r, k, last)
                forward.append(Message(src, llm.rank(tp=u, dp=r, pp=0), payload, payload, nbytes))
            for t in range(tp_enc):
                src = llm.rank(tp=c * tp_enc + t, dp=r, pp=0)
                backward.append(Message(src, layout.rank(t, c, r, k, last), payload.gradient(), payload.gradient(), nbytes))
    program.add_route(table(cluster, to_llm(unit), "pp", forward))
    program.add_route(table(cluster, f"{to_llm(unit)}.grad", "pp", backward))
    return EncoderRoutes(tp_group, dp_groups, hops)


class ClassEmitter:
    """The instruction list of one rank class."""

    def __init__(
        self,
        model: ModelSpec,
        layout: Layout,
        costs: EncoderCosts,
        schedule: Schedule,
        backward_points: list[float],
        routes: dict[str, EncoderRoutes],
        samples: int,
        precision: str,
        amp: bool,
        encoder_zero: int,
    ) -> None:
        self.model, self.layout, self.costs, self.schedule = model, layout, costs, schedule
        self.backward_points = backward_points
        self.routes, self.samples = routes, samples
        self.act, self.grad, self.weight = element_bytes(precision), grad_bytes(precision), weight_bytes(precision, amp)
        self.encoder_zero = encoder_zero
        self.sharding = tensor_parallel(layout.plan.tp)
        self.encoders = list(costs.layers)
        self._handles = 0

    # ---- whole stage passes (pre- and post-bubble) ----------------------------------------
    def _tp(self, unit: str) -> TPConfig:
        return TPConfig(self.sharding, self.routes[unit].tp_group, "none", self.act)

    def _input(self, unit: str, e: int, i: int, phase: str) -> list[Instruction]:
        """Receive what stage e of `unit` reads for LLM micro-batch i."""
        start, end = self.costs.layers[unit][e]
        if phase == "fwd":
            return [Recv(self.routes[unit].hops[e - 1], Payload(unit, start, i), stream=ENC_RECV)] if e else []
        last = e == self.layout.plan.pp - 1
        route = f"{to_llm(unit)}.grad" if last else self.routes[unit].hops[e]
        return [Recv(route, Payload(unit, end, i).gradient(), stream=ENC_RECV)]

    def _output(self, unit: str, e: int, i: int, phase: str) -> list[Instruction]:
        start, end = self.costs.layers[unit][e]
        if phase == "fwd":
            last = e == self.layout.plan.pp - 1
            route = to_llm(unit) if last else self.routes[unit].hops[e]
            return [Send(route, Payload(unit, end, i), stream=ENC_SEND)]
        return [Send(self.routes[unit].hops[e - 1], Payload(unit, start, i).gradient(), stream=ENC_SEND)] if e else []

    def stage_pass(self, e: int, i: int, phase: Phase, loads: Loads | None = None) -> list[Instruction]:
        out: list[Instruction] = []
        units = self.encoders if phase == "fwd" else [u for u in self.encoders if self.model.needs_backward(u)]
        for unit in units:
            out += self._input(unit, e, i, phase)
            work = segment_pass(self.model, Segment(unit, self.costs.layers[unit][e]), phase, self.samples, i, self._tp(unit))
            out += at_load(work, _load(loads, unit, i))
            out += self._output(unit, e, i, phase)
        return out

    # ---- items placed in bubbles ----------------------------------------------------------------
    def placed(
        self, items: list[Placed], loads: Loads | None = None
    ) -> tuple[dict[tuple[str, int], list[Instruction]], dict[int, list[Instruction]]]:
        """Instructions per slot ((kind, op)) and per issue point (op), in time order, each
        encoder kernel and all-reduce at its micro-batch's load (`loads`). A stage's first
        kernel of a unit for a micro-batch is preceded by its input's receive (and by the
        wait for an all-reduce issued before it), its last followed by its send."""
        slots: dict[tuple[str, int], list[Instruction]] = {}
        issues: dict[int, list[Instruction]] = {}
        e_of = self.layout.position(items[0].klass)[2] if items else 0
        firsts: dict[tuple[int, int, str, str], int] = {}
        lasts: dict[tuple[int, int, str, str], int] = {}
        for index, p in enumerate(items):
            if not p.item.is_comm:
                key = (p.pipeline, p.local, p.phase, p.item.unit)
                firsts.setdefault(key, index)
                lasts[key] = index
        pending: dict[tuple[int, int, str], str] = {}
        run: list[tuple[Placed, int]] = []
        kernel_counts: dict[tuple[str, int], int] = {}

        def flush() -> None:
            if not run:
                return
            p, _ = run[0]
            kernels = sorted(q.item.kernel for q, _ in run)
            i = self.schedule.mapping[(p.pipeline, p.local)]
            layer = (p.item.layer, p.item.layer + 1)
            work = Work(
                p.item.unit,
                p.phase,
                self.samples,
                layer,
                sharding=self.sharding,
                kernels=(kernels[0], kernels[-1] + 1),
                load=_load(loads, p.item.unit, i),
            )
            target = slots.setdefault(self._slot_key(p), [])
            key = (p.pipeline, p.local, p.phase, p.item.unit)
            indices = [index for _, index in run]
            if firsts[key] in indices:
                target += self._input(p.item.unit, e_of, i, p.phase)
            count = kernel_counts.get((p.item.unit, p.item.layer))
            if count is None:
                count = kernel_counts[(p.item.unit, p.item.layer)] = len(self.model.unit(p.item.unit).layers[p.item.layer].kernels)
            first, last = kernels[0] == 0, kernels[-1] + 1 == count
            # A range holding neither end of the layer's kernels reads and writes nothing.
            inputs, outputs = range_io(self.model, Segment(p.item.unit, layer), p.phase, i, first, last) if first or last else ((), ())
            target.append(Compute(work, microbatch=i, inputs=inputs, outputs=outputs))
            if lasts[key] in indices:
                target += self._output(p.item.unit, e_of, i, p.phase)
            run.clear()

        # The run's slot, micro-batch, unit and layer: a kernel of the same joins it.
        head: tuple | None = None
        for index, p in enumerate(items):
            item = p.item
            mb_key = (p.pipeline, p.local, p.phase)
            if item.kernel < 0:  # an all-reduce
                flush()
                head = None
                handle = self._handle()
                group = self.routes[item.unit].tp_group
                assert group is not None, "an encoder all-reduce runs on its TP group"
                issues.setdefault(p.op, []).append(
                    Collective(
                        "all_reduce",
                        group,
                        item.nbytes * _load(loads, item.unit, self.schedule.mapping[(p.pipeline, p.local)]),
                        "tp",
                        stream=ENC_TP,
                        blocking=False,
                        handle=handle,
                    )
                )
                pending[mb_key] = handle
                continue
            joins = (p.kind, p.op, p.pipeline, p.local, p.phase, item.unit, item.layer)
            if joins != head or mb_key in pending:
                flush()
                head = joins
            if mb_key in pending:
                slots.setdefault(self._slot_key(p), []).append(Wait(pending.pop(mb_key)))
            run.append((p, index))
        flush()
        return slots, issues

    @staticmethod
    def _slot_key(p: Placed) -> tuple[str, int]:
        return p.kind, p.op

    def _handle(self) -> str:
        self._handles += 1
        return f"enc.{self._handles}"

    def tail(self, e: int) -> list[Instruction]:
        out: list[Instruction] = []
        for unit in self.encoders:
            segments = [Segment(unit, self.costs.layers[unit][e])]
            out += iteration_tail(
                self.model,
                segments,
                self.sharding,
                self.routes[unit].dp_groups[e],
                self.layout.encoder_mesh().degree("dp"),
                self.encoder_zero,
                self.grad,
                self.weight,
            )
        return out


def _llm_layers(stage: Stage) -> tuple[str, tuple[int, int]] | None:
    """The LLM's layers on a pipeline stage, from the first to the last (with virtual
    stages, the others' layers between are not held here)."""
    works = [i.work for op in stage.ops for i in op.instructions if isinstance(i, Compute) and i.work.phase == "fwd"]
    if not works:
        return None
    return works[0].unit, (min(w.layers[0] for w in works), max(w.layers[1] for w in works))


def at_load(instructions: list[Instruction], load: float) -> list[Instruction]:
    """One micro-batch's pass of an encoder at `load`: its compute, and the rows its TP
    all-reduces move, scaled (a micro-batch of more image tokens moves that many more)."""
    if load == 1.0:
        return instructions
    out: list[Instruction] = []
    for instruction in instructions:
        if isinstance(instruction, Compute):
            instruction = replace(instruction, work=replace(instruction.work, load=load))
        elif isinstance(instruction, Collective) and instruction.kind == "tp":
            instruction = replace(instruction, bytes=instruction.bytes * load)
        out.append(instruction)
    return out


def _load(loads: Loads | None, unit: str, microbatch: int) -> float:
    return 1.0 if loads is None or unit not in loads else loads[unit][microbatch]


def class_label(layout: Layout, klass: int) -> str:
    s, _, e = layout.position(klass)
    return f"stage {s} col {klass % layout.columns} (encoder stage {e})"


@dataclass(frozen=True)
class ReplicaLoads:
    """LLM replicas whose micro-batches carry the same encoder loads, and those loads (per
    encoder, by the LLM micro-batch each encoder micro-batch feeds)."""

    replicas: tuple[int, ...]
    loads: Loads


def class_program(
    emitter: ClassEmitter, klass: int, stage: Stage, items: list[Placed], label: str, on_data: ReplicaLoads | None = None
) -> RankProgram:
    """Rank class `klass`'s instructions over every LLM replica, or, `on_data`, over those
    replicas only, with their micro-batches' loads (on the groups of every replica: the
    caller gives a class its own, builders.replicas.own_tp_groups)."""
    layout, schedule = emitter.layout, emitter.schedule
    loads = on_data.loads if on_data is not None else None
    s, pipeline, e = layout.position(klass)
    mapping = schedule.mapping
    gather = [i for i in stage.tail if isinstance(i, Collective) and i.op == "all_gather"]
    reduce = [i for i in stage.tail if isinstance(i, Collective) and i.kind == "dp" and i.op != "all_gather"]
    rest = [i for i in stage.tail if i not in gather and i not in reduce]
    # The LLM's DP collectives name the stage's layers: the all-reduce (ZeRO-0) their
    # gradients, the distributed optimizer's reduce-scatter and all-gather (ZeRO-1) their
    # gradients and parameters, which these run where the schedule places them.
    held = _llm_layers(stage)
    out: list[Instruction] = [replace(c, stream="dp", blocking=False, handle=LLM_GATHER, grads_of=held) for c in gather]
    for t in range(schedule.pre[pipeline]):
        out += emitter.stage_pass(e, mapping[(pipeline, t)], "fwd", loads)
    out += [Wait(LLM_GATHER)] if gather else []
    slots, issues = emitter.placed(sorted(items, key=lambda p: (p.start, p.kind == "tp")), loads)
    for x, stage_op in enumerate(stage.ops):
        out += slots.get(("gap", x), []) + issues.get(x, [])
        bins = slots.get(("tp", x), [])
        if not bins:
            out += stage_op.instructions
            continue
        handles = []
        tp_indices = [
            n for n, i in enumerate(stage_op.instructions) if isinstance(i, Collective) and i.kind == "tp" and i.stream == "compute"
        ]
        for n, instruction in enumerate(stage_op.instructions):
            if isinstance(instruction, Collective) and n in tp_indices:
                handle = f"llm.tp.{x}.{n}"
                handles.append(handle)
                out.append(replace(instruction, stream="tp", blocking=False, handle=handle))
            else:
                out.append(instruction)
            if tp_indices and n == tp_indices[-1]:
                out += bins + [Wait(h) for h in handles]
    out += [replace(c, stream="dp", blocking=False, handle=LLM_REDUCE, grads_of=held) for c in reduce]
    if any(emitter.model.needs_backward(u) for u in emitter.encoders):
        waiting = sorted(
            (emitter.backward_points[mapping[(pipeline, t)]], t)
            for t in range(schedule.counts[pipeline])
            if (pipeline, t) not in schedule.fine_backward
        )
        for _, t in waiting:
            out += emitter.stage_pass(e, mapping[(pipeline, t)], "bwd", loads)
    out += [Wait(LLM_REDUCE)] if reduce else []
    out += rest + emitter.tail(e)
    units = tuple(emitter.encoders) + ("llm",)
    ranks = layout.class_ranks(klass, on_data.replicas if on_data is not None else None)
    return RankProgram(ranks=ranks, instructions=out, label=label, units=units, pipelined=layout.llm.degree("pp") > 1)
