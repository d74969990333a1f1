"""One emitter for colocated units: every rank runs every unit, each unit with its own
tensor-parallel degree and data-parallel replicas over all ranks, no pipeline.

Megatron-LM's contrastive baseline (both towers, same TP and DP), DistMM's naive
placement (towers with their own TP) and pure data parallelism with ZeRO 0-3 are this
shape. Per micro-batch: the units' forwards in data-flow order, the interaction (a
contrastive loss over the gathered batch) if the model has one, the backwards in reverse;
then each unit's gradient reduction and optimizer step.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from dataclasses import dataclass, replace

from src.cluster import ClusterSpec
from src.costmodel.memory import element_bytes, reduce_bytes, weight_bytes, zero_shards
from src.mesh import Mesh, tensor_parallel
from src.models.spec import LayerSpec, ModelSpec
from src.program import (
    DEEPSPEED_PERSISTENCE_THRESHOLD,
    Collective,
    Compute,
    Instruction,
    Message,
    Phase,
    Program,
    RankProgram,
    Wait,
    Work,
)
from src.strategies.builders.contrastive import Holder, gathered_batch, local_queries, local_routes
from src.strategies.builders.emit import TPConfig, dp_grad_op, iteration_tail, segment_pass
from src.strategies.builders.layout import axis_group
from src.models.flows import unit_order
from src.strategies.builders.stages import Segment

QUERY_ROUTE = "interaction.queries"
# ZeRO-3's asynchronous gradient reduce-scatters run on a stream of their own, beside the
# prefetching all-gathers (DeepSpeed's reduce-and-partition stream; FSDP's reduce-scatter
# stream), sharing the node's NICs with them.
REDUCE_STREAM = "dp_reduce"


@dataclass(frozen=True)
class ColocatedUnit:
    """A unit's layout over all ranks: a (tp, dp) mesh, its memory settings.

    Under ZeRO-3, overlap_comm (DeepSpeed's name) reduce-scatters each layer's gradients
    asynchronously during the backward and prefetches up to `prefetch_params` parameters
    of the next layer while the current one computes (DeepSpeed's
    stage3_prefetch_bucket_size); without it every gather and reduction blocks. Below
    ZeRO-3 it reduces each layer's gradients asynchronously as the step's last
    micro-batch's backward finishes them (Megatron-LM's --overlap-grad-reduce, PyTorch
    DDP's buckets), instead of all at once before the optimizer step.

    Under ZeRO-3 with full recomputation, `reuse_distance` (DeepSpeed's
    stage3_max_reuse_distance) keeps a module's parameters gathered from its recomputed
    forward to its backward only when fewer parameters than that are fetched in between;
    the others are released after the recomputation and gathered again (inf: all kept).
    Parameter tensors of at most `persistence_threshold` elements (DeepSpeed's
    stage3_param_persistence_threshold) are never partitioned: every rank holds them whole
    and no module hook fetches them. `fetch_per_tensor`: each partitioned tensor is
    fetched by an all-gather of its own into a zero-filled buffer, through PyTorch's list
    all_gather (one copy out per rank of the group: DeepSpeed before 0.5.5,
    partition_parameters.py _allgather_param) rather than a module's tensors by one (its
    coalesced fetch since). `synchronous_release` (DeepSpeed before 0.6.0): every fetch ends
    (per tensor: begins) with a torch.cuda.synchronize() (_allgather_param, and
    _allgather_params_coalesced's "guarantee the communication to be completed"), which waits
    for every stream, so the reduce-scatter overlap_comm issued after a layer's backward
    holds the next layer's fetch: it overlaps nothing; and the gradients are reduce-scattered
    by one list collective per trained tensor (stage3's _reduce_scatter_gradients; coalesced
    since)."""

    unit: str
    mesh: Mesh
    recompute: str
    zero_stage: int
    sequence_parallel: bool = False
    group_prefix: str = ""
    overlap_comm: bool = False
    prefetch_params: float = 0.0
    reuse_distance: float = math.inf
    persistence_threshold: float = DEEPSPEED_PERSISTENCE_THRESHOLD
    fetch_per_tensor: bool = False
    synchronous_release: bool = False


class ColocatedEmitter:
    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        precision: str,
        program: Program,
        units: list[ColocatedUnit],
        grad_reduce_dtype: str | None = None,
    ) -> None:
        """`grad_reduce_dtype`: the type the data-parallel reduction sends gradients in;
        None: Megatron-LM's (memory.reduce_bytes)."""
        self.model, self.cluster, self.program = model, cluster, program
        self.units = {u.unit: u for u in units}
        self.act_bytes, self.weight_bytes = element_bytes(precision), weight_bytes(precision, cluster.amp)
        self.reduce_bytes = reduce_bytes(precision, grad_reduce_dtype)
        self.pending: list[str] = []
        self.reducing: dict[str, list[str]] = {u.unit: [] for u in units}  # below ZeRO-3: a unit's reductions in flight
        self.tp_group, self.dp_group = {}, {}
        for u in units:
            first = u.mesh.ranks[0]
            self.tp_group[u.unit] = axis_group(program, cluster, f"{u.group_prefix}tp", u.mesh, "tp", first)
            self.dp_group[u.unit] = axis_group(program, cluster, f"{u.group_prefix}dp", u.mesh, "dp", first)

    def _tp(self, unit: str) -> TPConfig:
        u = self.units[unit]
        return TPConfig(tensor_parallel(u.mesh.degree("tp"), u.sequence_parallel), self.tp_group[unit], u.recompute, self.act_bytes)

    def _pass(self, unit: str, phase: Phase, samples: int, microbatch: int, final: bool) -> list[Instruction]:
        """A unit's forward or backward; under ZeRO-3 with replicas, layer by layer: each
        layer's parameters all-gathered before it runs, its gradients reduce-scattered
        after its backward (every micro-batch: ZeRO-3 keeps no whole gradients), in
        the reduction's type. `final`: the
        step's last micro-batch, whose backward overlap_comm reduces layer by layer below ZeRO-3."""
        spec, u = self.model.unit(unit), self.units[unit]
        dp = u.mesh.degree("dp")
        if u.zero_stage < 3 or dp == 1:
            if final and phase != "fwd" and u.overlap_comm and dp > 1:
                return self._reducing_backward(unit, samples, microbatch)
            return segment_pass(self.model, Segment(unit, (0, spec.num_layers)), phase, samples, microbatch, self._tp(unit))
        backward = phase != "fwd"
        order = [i for i in (reversed(range(spec.num_layers)) if backward else range(spec.num_layers))]
        modules = [spec.layers[i].fetched_modules(u.persistence_threshold) for i in order]
        gathers = [_gathers(spec.layers[i], m, u.fetch_per_tensor) for i, m in zip(order, modules)]
        params = [sum(m) / u.mesh.degree("tp") for m in modules]
        group = self.dp_group[unit]
        assert group is not None, "ZeRO-3 layers are gathered over a DP group of more than one rank"
        out: list[Instruction] = []
        for index, layer in enumerate(order):
            out += self._gather(unit, phase, microbatch, params, gathers[index], index)
            blocked = params[index] > self._prefetched(u, params, index)
            again = self._released(unit, modules[index]) if backward and u.recompute == "full" else []
            fetched, fetches = params[index], gathers[index]
            if again:
                regathered = params[index] * sum(again) / sum(modules[index])
                out.append(Collective("all_gather", group, regathered * self.weight_bytes / len(again), "dp", count=len(again)))
                fetched, fetches, blocked = fetched + regathered, fetches + len(again), True
            layer_pass = segment_pass(self.model, Segment(unit, (layer, layer + 1)), phase, samples, microbatch, self._tp(unit))
            copies = u.mesh.degree("dp") if u.fetch_per_tensor else 0
            layer_pass = _with_work(layer_pass, False, fetches=fetches, fetched=fetched, fetch_blocking=blocked, fetch_copies=copies)
            trainable = spec.trainable_params(layer, layer + 1) / u.mesh.degree("tp")
            scatters = _trained_tensors(spec.layers[layer], spec.arch.style == "gpt") if u.synchronous_release else 1
            if backward and trainable and u.synchronous_release:
                layer_pass = _with_work(layer_pass, True, scatters=scatters, scattered=trainable, scatter_copies=dp)
            out += layer_pass
            if backward and trainable:
                if u.overlap_comm and not u.synchronous_release:
                    handle = f"rs.{unit}.mb{microbatch}.L{layer}"
                    out.append(
                        Collective(
                            "reduce_scatter",
                            group,
                            trainable * self.reduce_bytes,
                            "dp",
                            stream=REDUCE_STREAM,
                            blocking=False,
                            handle=handle,
                        )
                    )
                    self.pending.append(handle)
                else:
                    # Each collective pays the ring's latency.
                    out.append(Collective("reduce_scatter", group, trainable * self.reduce_bytes / scatters, "dp", count=scatters))
        return out

    def _reducing_backward(self, unit: str, samples: int, microbatch: int) -> list[Instruction]:
        """The last micro-batch's backward, layer by layer, each layer's gradients reduced
        asynchronously as soon as it is done (waited for in the tail)."""
        spec, u = self.model.unit(unit), self.units[unit]
        group = self.dp_group[unit]
        assert group is not None, "gradients are reduced over a DP group of more than one rank"
        op = dp_grad_op(u.zero_stage)
        out: list[Instruction] = []
        for layer in reversed(range(spec.num_layers)):
            out += segment_pass(self.model, Segment(unit, (layer, layer + 1)), "bwd", samples, microbatch, self._tp(unit))
            trainable = spec.trainable_params(layer, layer + 1) / u.mesh.degree("tp")
            if trainable:
                handle = f"grad.{unit}.L{layer}"
                out.append(
                    Collective(
                        op,
                        group,
                        trainable * self.reduce_bytes,
                        "dp",
                        stream="dp",
                        blocking=False,
                        handle=handle,
                        grads_of=(unit, (layer, layer + 1)),
                    )
                )
                self.reducing[unit].append(handle)
        return out

    @staticmethod
    def _prefetched(u: ColocatedUnit, params: list[float], index: int) -> float:
        """The parameters of the `index`-th layer gathered while the previous one ran."""
        return min(params[index], u.prefetch_params) if (u.overlap_comm and index > 0) else 0.0

    def _gather(self, unit: str, phase: str, microbatch: int, params: list[float], gathers: int, index: int) -> list[Instruction]:
        """The all-gather of the `index`-th layer's partitioned parameters (in `gathers`
        all-gathers) in the pass's order: the part prefetched during the previous layer is
        waited for, the rest gathered now; then the next layer's prefetch is issued."""
        u, group = self.units[unit], self.dp_group[unit]
        assert group is not None, "ZeRO-3 layers are gathered over a DP group of more than one rank"
        prefetched = self._prefetched(u, params, index)
        out: list[Instruction] = []
        if prefetched:
            out.append(Wait(f"ag.{unit}.{phase}.mb{microbatch}.{index}"))
        if params[index] > prefetched:
            # Each all-gather pays the ring's latency.
            rest = params[index] - prefetched
            out.append(Collective("all_gather", group, rest * self.weight_bytes / gathers, "dp", count=gathers))
        if u.overlap_comm and index + 1 < len(params):
            ahead = min(params[index + 1], u.prefetch_params)
            if ahead:
                out.append(
                    Collective(
                        "all_gather",
                        group,
                        ahead * self.weight_bytes,
                        "dp",
                        stream="dp",
                        blocking=False,
                        handle=f"ag.{unit}.{phase}.mb{microbatch}.{index + 1}",
                    )
                )
        return out

    def _released(self, unit: str, modules: tuple[int, ...]) -> list[int]:
        """Of a layer's fetched `modules`, those whose parameters its recomputed forward
        releases before its backward: they come back after more than the reuse distance
        (the recomputed forward of the modules after it, then their backwards: twice their
        parameters), so they are gathered again, blocking (each follows the recomputation
        that released it)."""
        after = [sum(modules[i + 1 :]) for i in range(len(modules))]
        return [m for m, rest in zip(modules, after) if 2 * rest > self.units[unit].reuse_distance]

    def gathered_params(self, unit: str) -> float:
        """ZeRO-3's live parameters at the peak beyond the rank's shard: the layer running
        (and the next one's prefetched part) and the persistent tensors, per rank."""
        spec, u = self.model.unit(unit), self.units[unit]
        if u.zero_stage < 3 or u.mesh.degree("dp") == 1:
            return 0.0
        fetched = [sum(layer.fetched_modules(u.persistence_threshold)) for layer in spec.layers]
        largest = max(fetched) / u.mesh.degree("tp")
        # Whole on every rank, where the model states count 1/dp of them (a tied head fetches
        # a weight its layer does not own: none of its own then).
        whole = sum(max(0, layer.params - f) for layer, f in zip(spec.layers, fetched))
        persistent = whole / u.mesh.degree("tp") * (1 - 1 / u.mesh.degree("dp"))
        return largest + (min(largest, u.prefetch_params) if u.overlap_comm else 0.0) + persistent

    def microbatch(
        self, microbatch: int, samples: dict[str, int], interaction: list[Instruction], final: bool = False
    ) -> list[Instruction]:
        """One micro-batch: forwards, the interaction's instructions, backwards. `final`:
        the step's last."""
        order = self.towers()
        out: list[Instruction] = []
        for unit in order:
            out += self._pass(unit, "fwd", samples[unit], microbatch, final)
        out += interaction
        for unit in reversed(order):
            if self.model.needs_backward(unit):
                out += self._pass(unit, "bwd", samples[unit], microbatch, final)
        return out

    def replicated_step(self, microbatches: int, micro_batch: int, dp: int) -> None:
        """One step of every tower replicated alike over `dp` replicas (`micro_batch` samples
        of each a micro-batch): its micro-batches, each scoring the gathered contrastive batch
        of its replicas where the model has a contrastive loss, then the tail; the program's
        one rank class. Each device scores its local samples of every modality against the
        gathered other: one similarity product per tower, hence towers x micro_batch rows."""
        towers = self.towers()
        share = {t: micro_batch for t in towers}
        contrastive = self.model.interaction is not None
        if contrastive:
            self.query_routes(microbatches, share, share, with_keys=dp == 1)
        instructions: list[Instruction] = []
        for j in range(microbatches):
            rows = micro_batch * dp
            interaction = self.contrastive(j, self.dp_group[towers[0]], rows, len(towers) * micro_batch, rows) if contrastive else []
            instructions += self.microbatch(j, share, interaction, final=j == microbatches - 1)
        instructions += self.tail()
        self.program.classes.append(self.rank_program(instructions))

    def contrastive(
        self, microbatch: int, group: str | None, rows: int, rows_scored: int, contrastive_batch: int
    ) -> list[Instruction]:
        """The interaction of one micro-batch, gathering the batch's `rows` over `group`."""
        return gathered_batch(
            self.model, self.towers(), microbatch, group, rows, QUERY_ROUTE, rows_scored, contrastive_batch, self.act_bytes
        )

    def towers(self) -> list[str]:
        return [u for u in unit_order(self.model) if u in self.units and u != self.model.interaction]

    def query_routes(self, batches: int, share: dict[str, int], micro_batch: dict[str, int], with_keys: bool) -> None:
        """Every rank copies its replica's rows of each tower into its queries: replica d of
        a tower holds rows [d·share, (d+1)·share) of each contrastive batch, cut into
        micro-batches in order (and the keys too when no gather makes them)."""
        messages: list[Message] = []
        for batch in range(batches):
            holders = []
            for tower in self.towers():
                mesh, share_t, mb = self.units[tower].mesh, share[tower], micro_batch[tower]
                per_batch = share_t // mb
                for rank in mesh.ranks:
                    start = mesh.coords(rank).get("dp", 0) * share_t
                    pieces = tuple((batch * per_batch + i, start + i * mb, mb) for i in range(per_batch))
                    holders.append(Holder(rank, tower, start, start + share_t, pieces, rank))
            messages += local_queries(self.model, batch, holders, self.act_bytes, with_keys)
        for route in local_routes(self.cluster, QUERY_ROUTE, messages):
            self.program.add_route(route)

    def tail(self, pending: Sequence[str] = ()) -> list[Instruction]:
        """Each unit's gradient reduction and optimizer step; units sharing a DP group
        reduce together. ZeRO-3 units reduced layer by layer in their backward: they wait
        for the asynchronous reductions and step."""
        out: list[Instruction] = [Wait(h) for h in self.pending]
        by_group: dict[tuple, list[str]] = {}
        for unit, u in self.units.items():
            by_group.setdefault((u.mesh, self.dp_group[unit]), []).append(unit)
        for (mesh, _), names in by_group.items():
            u = self.units[names[0]]
            segments = [Segment(n, (0, self.model.unit(n).num_layers)) for n in names]
            layered = u.zero_stage >= 3 and mesh.degree("dp") > 1
            if layered:
                sharding, shards = tensor_parallel(mesh.degree("tp")), zero_shards(mesh.degree("dp"), u.zero_stage)
                out += [
                    Compute(Work(s.unit, "optimizer", 0, s.layers, sharding=sharding, shard=shards.optimizer, grad_shard=shards.grads))
                    for s in segments
                    if not self.model.unit(s.unit).frozen
                ]
                continue
            out += iteration_tail(
                self.model,
                segments,
                tensor_parallel(mesh.degree("tp")),
                self.dp_group[names[0]],
                mesh.degree("dp"),
                u.zero_stage,
                self.reduce_bytes,
                self.weight_bytes,
                [*pending, *(h for n in names for h in self.reducing[n])],
            )
        return out

    def rank_program(self, instructions: list[Instruction]) -> RankProgram:
        return RankProgram(
            ranks=tuple(range(self.program.world_size)), instructions=instructions, label="all ranks", units=tuple(self.units)
        )


def _gathers(layer: LayerSpec, modules: tuple[int, ...], per_tensor: bool) -> int:
    """How many all-gathers fetch a layer: one per module (DeepSpeed's pre-forward hook per
    submodule), or, fetching tensor by tensor, one per partitioned tensor (a normalisation
    has two; a weighted product's bias stays whole below the persistence threshold, under
    which every model here keeps it)."""
    if not per_tensor:
        return len(modules)
    return len(modules) + sum(1 for kern in layer.kernels if kern.norm_width and 2 * kern.norm_width in modules)


def _trained_tensors(layer: LayerSpec, biased: bool) -> int:
    """A layer's parameter tensors: each weighted product's weight and each normalisation's
    scale, with their biases and shifts where the model has them; a lookup table is one."""
    per = 2 if biased else 1
    return max(1, sum(per for kern in layer.kernels if kern.has_weight or kern.norm_width))


def _with_work(instructions: list[Instruction], last: bool, **fields: Any) -> list[Instruction]:
    """A layer's pass whose first (or last) Compute carries `fields` of its Work: the fetches
    the framework's hooks make before it, or the list reduce-scatters of its gradients that
    follow it."""
    computes = [i for i, instruction in enumerate(instructions) if isinstance(instruction, Compute)]
    index = computes[-1] if last else computes[0]
    compute = instructions[index]
    assert isinstance(compute, Compute)
    return [*instructions[:index], replace(compute, work=replace(compute.work, **fields)), *instructions[index + 1 :]]
