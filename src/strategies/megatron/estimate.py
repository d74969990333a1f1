"""What a Megatron-LM pipeline candidate needs and costs at least, without its Program.

The search checks and prices every candidate here and builds the Program of only those
it may pick. Every number is read off what the emitter would produce (the same schedule
order, Work items, groups and routes), priced by the same cost model, not off a second
model of Megatron-LM; per-layer prices are summed with prefix sums, so they agree with
the Program's up to rounding.

- `memory_table`: per pipeline stage, what `costmodel.memory.rank_memory` reads off the
  built Program: model states of the stage's layer ranges, and the peak of live
  activations along the stage's schedule order, taken over the undominated counts of
  in-flight micro-batches per chunk (a handful per schedule, whatever the micro-batches).
- `work_bound`: the busiest stage computes at least the average stage's share of every
  layer's forward and backward; it needs no look at the stages and rules out most
  candidates at once.
- `quick_bound`: a stage's compute stream runs its forwards and backwards (compute and
  blocking TP collectives) one after another; it cannot start before micro-batch 0 has
  gone forward through the stages before it, and once it ends, the last micro-batch's
  backward still runs through those stages, each followed by its gradient reduction and
  optimizer step.
- `path_bound`: the longest path through every forward and backward of the schedule
  with their data dependencies over the pipeline hops: the simulation without the
  serialisation of the send and receive streams. Tighter, and costlier (one step per
  schedule operation), it is taken only for candidates that the quick bound could not
  rule out.
Both bounds leave out only waits, which are never negative: no simulation of the
Program is faster.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from src.cluster import ClusterSpec, family_sharing
from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import (
    element_bytes,
    kept_grad_bytes,
    model_state_bytes,
    reduce_bytes,
    rematerialised_bytes,
    states_precision,
    weight_bytes,
    zero_shards,
)
from src.mesh import Sharding, tensor_parallel
from src.models.spec import ModelSpec, UnitSpec
from src.program import Work
from src.schedules.pipeline import PipeOp, build_schedule
from src.strategies.builders.layout import megatron_mesh, pipeline_pairs
from src.strategies.megatron.programs import MegatronSettings
from src.strategies.base import Degrees
from src.strategies.builders.emit import dp_grad_op, share_of
from src.strategies.builders.stages import (
    Segment,
    StageRun,
    StageTransfer,
    boundary_elems,
    replicated_transfer,
    stage_runs,
    stage_transfer,
)

# Rounding: the simulator adds the same prices in another order.
BOUND_SLACK = 1e-9
# Chunks whose activations differ by less than this fraction hold the same layers.
SAME_SIZE = 1e-9

Counts = tuple[int, ...]


@dataclass(frozen=True)
class LiveCounts:
    """In-flight micro-batches per chunk of one stage along its schedule order: after
    each forward, and before each backward (with that backward's chunk), each distinct
    count once."""

    after_forward: tuple[Counts, ...]
    before_backward: tuple[tuple[Counts, int], ...]
    ends_with_first_chunk_backward: bool
    # When every chunk holds the same bytes (the middle stages of an even cut), only the
    # largest totals matter: after a forward, and before a backward of each chunk.
    most_after_forward: int = 0
    most_before_backward: tuple[int, ...] = ()


def live_counts(order: list[PipeOp], chunks: int) -> LiveCounts:
    live = [0] * chunks
    forward: set[Counts] = set()
    backward: set[tuple[Counts, int]] = set()
    for op in order:
        if op.kind == "F":
            live[op.chunk] += 1
            forward.add(tuple(live))
        else:
            backward.add((tuple(live), op.chunk))
            live[op.chunk] -= 1
    last = order[-1] if order else None
    most_backward = tuple(max((sum(c) for c, k in backward if k == chunk), default=-1) for chunk in range(chunks))
    return LiveCounts(
        tuple(forward),
        tuple(backward),
        last is not None and last.kind == "B" and last.chunk == 0,
        max((sum(c) for c in forward), default=0),
        most_backward,
    )


def steady_microbatches(schedule: str, pp: int, microbatches: int, vpp: int, extra_warmup: int = 0) -> int:
    """Past a few rounds, 1F1B and its interleaved form only repeat their steady state:
    the in-flight counts of a longer schedule are those of this many micro-batches."""
    if schedule == "gpipe":
        return microbatches
    warmup = 2 * (pp - 1) + (vpp - 1) * pp + extra_warmup
    rounds = -(-(warmup + pp * vpp) // (pp * vpp))
    return min(microbatches, rounds * pp)


class _MeshCosts:
    """Collective and hop prices of one (tp, dp, pp) mesh, as the emitter's groups and
    routes carry them (their ranks and their family's NIC sharing); `replicated`: the
    stages replicated over their TP group, which reduce gradients over all their ranks."""

    def __init__(self, cluster: ClusterSpec, comm: CommModel, tp: int, dp: int, pp: int, replicated: tuple[bool, ...]) -> None:
        self.comm = comm
        mesh = megatron_mesh(tp, dp, pp)
        firsts = [mesh.rank(pp=stage) for stage in range(pp)]
        self.tp_ranks = [mesh.group("tp", first) for first in firsts]
        self.tp_sharing = family_sharing(cluster, mesh.family("tp")) if tp > 1 else 1
        dp_sharing = family_sharing(cluster, mesh.family("dp")) if dp > 1 else 1
        self.dp_ranks = [mesh.slice(pp=s) if replicated[s] else mesh.group("dp", firsts[s]) for s in range(pp)]
        self.dp_sharing = [family_sharing(cluster, [self.dp_ranks[s]]) if replicated[s] else dp_sharing for s in range(pp)]
        pairs = pipeline_pairs(mesh)
        self.hop_sharing = family_sharing(cluster, pairs) if pairs else 1
        # A hop's price is its slowest pair's: one that crosses nodes if any does.
        self.hop_pair = []
        for stage in range(pp):
            a, b = mesh.slice(pp=stage), mesh.slice(pp=(stage + 1) % pp)
            crossing = [(x, y) for x, y in zip(a, b) if cluster.node_of(x) != cluster.node_of(y)]
            self.hop_pair.append(crossing[0] if crossing else (a[0], b[0]))
        # What a TP collective's price depends on: candidates whose stages agree on it
        # share their per-layer prices.
        self.tp_price = [(len(r), cluster.spans_nodes(r), self.tp_sharing) for r in self.tp_ranks]
        self._cache: dict[tuple, float] = {}

    def tp(self, stage: int, nbytes: float) -> float:
        return self._collective("all_reduce", self.tp_ranks[stage], self.tp_sharing, nbytes)

    def dp(self, stage: int, op: str, nbytes: float) -> float:
        return self._collective(op, self.dp_ranks[stage], self.dp_sharing[stage], nbytes)

    def hop(self, stage: int, transfer: StageTransfer) -> float:
        """Hop `stage` -> `stage`+1: the send, then the receiving stage's TP all-gather."""
        key = ("hop", stage, transfer)
        if key not in self._cache:
            seconds = self.send(stage, transfer.send_bytes)
            if transfer.gather_bytes:
                seconds += self.gather((stage + 1) % len(self.tp_ranks), transfer.gather_bytes)
            self._cache[key] = seconds
        return self._cache[key]

    def send(self, stage: int, nbytes: float) -> float:
        """One message over hop `stage` -> `stage`+1 (either way)."""
        return self.comm.p2p_time(*self.hop_pair[stage], nbytes, self.hop_sharing)

    def gather(self, stage: int, nbytes: float) -> float:
        """An all-gather over stage `stage`'s TP group."""
        return self._collective("all_gather", self.tp_ranks[stage], self.tp_sharing, nbytes)

    def _collective(self, op: str, ranks: tuple[int, ...], sharing: int, nbytes: float) -> float:
        key = (op, ranks, nbytes)
        if key not in self._cache:
            self._cache[key] = self.comm.collective_time(op, ranks, nbytes, sharing)
        return self._cache[key]


@dataclass(frozen=True)
class TimePrefix:
    """Cumulative device, host and blocking TP collective seconds over a unit's layers, one
    micro-batch. A segment of them runs as one Work, which takes at least the longer of its
    device and host streams (exactly that for one layer: ComputeModel.work_streams), then
    its collectives: a bound of the simulated time, as the search needs."""

    device: list[float]
    host: list[float]
    comm: list[float]

    def seconds(self, start: int, end: int) -> float:
        streams = max(self.device[end] - self.device[start], self.host[end] - self.host[start])
        return streams + self.comm[end] - self.comm[start]


@dataclass
class Passes:
    """One candidate's per-virtual-stage prices, one micro-batch each."""

    fwd: list[float]
    bwd: list[float]  # 0 where the virtual stage runs no backward
    hop: list[float]  # hop v: from virtual stage v to v + 1
    hop_back: list[float]  # hop v the other way: the gradient from v + 1 to v
    grads_back: list[bool]  # B(v) waits for B(v + 1)'s gradient
    tail: list[float]  # per stage: gradient reduction, optimizer, parameter gather
    microbatches: int


@dataclass
class MemoryTable:
    """Per stage, the memory of one shape under each memory setting (filled on demand)."""

    estimator: PipelineEstimator
    deg: Degrees
    runs: list[StageRun]  # per stage: how its ranks run its layers
    stages: list[tuple[tuple[Segment, ...], ...]]  # per stage: its chunks' segments
    profile: list[LiveCounts]
    _states: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    _activations: dict[str, list[float]] = field(default_factory=dict)

    def need(self, recompute: str, zero_stage: int) -> list[dict[str, float]]:
        """rank_memory's numbers for every stage."""
        out = []
        for states, activations in zip(self.states(zero_stage), self.activations(recompute)):
            need = {**states, "activations": activations}
            need["total"] = sum(need.values())
            out.append(need)
        return out

    def worst(self, recompute: str, zero_stage: int) -> float:
        return max(
            s["weights"] + s["grads"] + s["optimizer"] + a for s, a in zip(self.states(zero_stage), self.activations(recompute))
        )

    def states(self, zero_stage: int) -> list[dict[str, float]]:
        if zero_stage not in self._states:
            est = self.estimator
            self._states[zero_stage] = [
                est.model_states(chunks, run.sharding.devices, zero_stage, self.deg.dp * est.row_shares(run, self.deg))
                for chunks, run in zip(self.stages, self.runs)
            ]
        return self._states[zero_stage]

    def activations(self, recompute: str) -> list[float]:
        if recompute not in self._activations:
            est = self.estimator
            self._activations[recompute] = [
                est.peak_activations(chunks, live, run.sharding, recompute, self.deg.micro_batch * run.rows)
                for chunks, live, run in zip(self.stages, self.profile, self.runs)
            ]
        return self._activations[recompute]


class PipelineEstimator:
    """Memory and time lower bounds of the Megatron-LM pipeline candidates of one
    request; caches what candidates share (meshes, schedules, per-layer prefix sums)."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        precision: str,
        global_batch: int,
        compute: ComputeModel,
        replicate: tuple[str, ...] = (),
        grad_reduce_dtype: str | None = None,
        grad_accum_dtype: str | None = None,
    ) -> None:
        self.model, self.cluster, self.precision, self.compute = model, cluster, precision, compute
        self.global_batch = global_batch
        self.replicate = replicate
        self.comm = CommModel(cluster)
        self.act_bytes, self.weight_bytes = element_bytes(precision), weight_bytes(precision, cluster.amp)
        self.grad_bytes = reduce_bytes(precision, grad_reduce_dtype)  # on the wire
        self.kept_grad_bytes = kept_grad_bytes(precision, grad_reduce_dtype, grad_accum_dtype)  # in memory
        self._meshes: dict[tuple[int, int, int, tuple[bool, ...]], _MeshCosts] = {}
        self._live: dict[tuple, list[LiveCounts]] = {}
        self._schedules: dict[tuple, list[list[PipeOp]]] = {}
        self._prefix: dict[tuple, list[float]] = {}
        self._time_prefixes: dict[tuple, TimePrefix] = {}
        self._activation_prefixes_cache: dict[tuple, dict[str, list[float]]] = {}
        self._largest: dict[tuple, float] = {}

    def microbatches(self, deg: Degrees) -> int:
        return deg.batch_layout(self.global_batch).microbatches

    def runs(self, deg: Degrees, sequence_parallel: bool, virtual: list[list[Segment]]) -> list[StageRun]:
        return stage_runs(self.model, virtual, deg.pp, deg.tp, sequence_parallel, deg.micro_batch, self.replicate)

    @staticmethod
    def row_shares(run: StageRun, deg: Degrees) -> int:
        """The TP ranks of a stage replicated over them, which split its rows; else 1."""
        return deg.tp if run.replicated else 1

    # ---- memory ---------------------------------------------------------------------------
    def memory_table(
        self, deg: Degrees, schedule: str, sequence_parallel: bool, virtual: list[list[Segment]], extra_warmup: int = 0
    ) -> MemoryTable:
        stages = [tuple(tuple(virtual[chunk * deg.pp + stage]) for chunk in range(deg.vpp)) for stage in range(deg.pp)]
        return MemoryTable(
            self,
            deg,
            self.runs(deg, sequence_parallel, virtual),
            stages,
            self.schedule_profile(schedule, deg.pp, self.microbatches(deg), deg.vpp, extra_warmup),
        )

    def memory(self, deg: Degrees, cfg: MegatronSettings, virtual: list[list[Segment]]) -> list[dict[str, float]]:
        """Per stage: weights, grads, optimizer, activations and total bytes of one rank."""
        table = self.memory_table(deg, cfg.schedule, cfg.sequence_parallel, virtual, cfg.extra_warmup)
        return table.need(cfg.recompute, cfg.zero_stage)

    def model_states(self, chunks: tuple[tuple[Segment, ...], ...], shards: int, zero_stage: int, dp: int) -> dict[str, float]:
        """Model states of a stage's layer ranges (rank_memory sums them range by range;
        they are linear in the parameter count)."""
        trainable = params = 0.0
        for segments in chunks:
            for segment in segments:
                trainable += self._span("trainable", segment)
                params += self._span("params", segment)
        states = states_precision(self.precision, self.cluster.amp)
        out = model_state_bytes(trainable / shards, states, False, zero_stage, dp, self.kept_grad_bytes)
        for key, value in model_state_bytes(params / shards - trainable / shards, states, True, zero_stage, dp).items():
            out[key] += value
        return out

    def peak_activations(
        self, chunks: tuple[tuple[Segment, ...], ...], live: LiveCounts, sharding: Sharding, recompute: str, micro_batch: float
    ) -> float:
        """The peak of live activations along the stage's order (memory.peak_activation_bytes):
        each forward adds its segments' activations, its backward frees them; under full
        recompute a backward first rematerialises its segment's largest layer."""
        prefix = self._activation_prefixes(sharding, recompute)
        sizes: list[float] = []
        extras: list[float | None] = []
        for segments in chunks:
            trained = [s for s in segments if s.unit in prefix]
            each = [(prefix[s.unit][s.layers[1]] - prefix[s.unit][s.layers[0]]) * micro_batch for s in trained]
            extra, freed = None, 0.0
            if recompute == "full":
                # Backward runs the segments last first; those after a segment are freed by then.
                for segment, size in zip(reversed(trained), reversed(each)):
                    above = self._largest_layer(segment, sharding) * micro_batch - freed
                    extra = above if extra is None else max(extra, above)
                    freed += size
            sizes.append(sum(each))
            extras.append(extra)
        largest = max(sizes)
        if largest - min(sizes) <= SAME_SIZE * largest:
            # Chunks of equal depth differ by rounding only; the larger size errs on the safe side.
            peak = largest * live.most_after_forward
            for chunk, extra in enumerate(extras):
                if extra is not None and live.most_before_backward[chunk] >= 0:
                    peak = max(peak, largest * live.most_before_backward[chunk] + extra)
            return peak
        peak = max((sum(n * a for n, a in zip(counts, sizes)) for counts in live.after_forward), default=0.0)
        for counts, chunk in live.before_backward:
            extra = extras[chunk]
            if extra is not None:
                peak = max(peak, sum(n * a for n, a in zip(counts, sizes)) + extra)
        return peak

    def _activation_prefixes(self, sharding: Sharding, recompute: str) -> dict[str, list[float]]:
        """Per-sample activation prefix sums of every unit that runs backward."""
        key = ("activations", sharding, recompute)
        found = self._activation_prefixes_cache.get(key)
        if found is None:
            found = self._activation_prefixes_cache[key] = {
                u.name: self._unit_prefix(key, u.name) for u in self.model.units if self.model.needs_backward(u.name)
            }
        return found

    def _largest_layer(self, segment: Segment, sharding: Sharding) -> float:
        key = (segment, sharding)
        if key not in self._largest:
            layers = self.model.unit(segment.unit).layers[segment.layers[0] : segment.layers[1]]
            self._largest[key] = rematerialised_bytes(layers, sharding)
        return self._largest[key]

    def _orders(self, schedule: str, pp: int, microbatches: int, vpp: int, extra_warmup: int) -> list[list[PipeOp]]:
        key = (schedule, pp, microbatches, vpp, extra_warmup)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(*key)
        return self._schedules[key]

    def schedule_profile(self, schedule: str, pp: int, microbatches: int, vpp: int, extra_warmup: int = 0) -> list[LiveCounts]:
        key = (schedule, pp, steady_microbatches(schedule, pp, microbatches, vpp, extra_warmup), vpp, extra_warmup)
        if key not in self._live:
            self._live[key] = [live_counts(order, vpp) for order in self._orders(*key)]
        return self._live[key]

    # ---- per-layer prefix sums ------------------------------------------------------------
    def _span(self, what, segment: Segment) -> float:
        prefix = self._unit_prefix(what, segment.unit)
        return prefix[segment.layers[1]] - prefix[segment.layers[0]]

    @staticmethod
    def _time_key(
        phase: str, sharding: Sharding, recompute: str, micro_batch: int, mesh: _MeshCosts, stage: int, rows: float = 1.0
    ) -> tuple:
        return (phase, sharding, recompute, micro_batch, rows, mesh.tp_price[stage], (mesh, stage))

    def _unit_prefix(self, what, unit_name: str) -> list[float]:
        """Cumulative sums over a unit's layers of `what`: 'params', 'trainable' or per-sample
        ('activations', sharding, recompute)."""
        key = (what, unit_name)
        prefix = self._prefix.get(key)
        if prefix is None:
            unit = self.model.unit(unit_name)
            prefix = [0.0]
            for index, layer in enumerate(unit.layers):
                prefix.append(prefix[-1] + self._layer_value(what, unit, index))
            self._prefix[key] = prefix
        return prefix

    def _layer_value(self, what, unit: UnitSpec, index: int) -> float:
        layer = unit.layers[index]
        if what == "params":
            return float(layer.params)
        if what == "trainable":
            return float(unit.trainable_params(index, index + 1))
        _, sharding, recompute = what
        return 0.0 if layer.forward_only else layer.kept_activations(sharding, recompute)

    def _time_prefix(self, what, unit_name: str) -> TimePrefix:
        """A unit's layers' seconds of one micro-batch (_time_key: phase, sharding,
        recompute, micro-batch, TP price class, and a mesh and stage of that class to price
        the layer's TP all-reduces; rows: the share of the micro-batch a rank runs,
        emit.TPConfig's), cumulated."""
        # A time key's last entry only says where to price: it is left out of the cache key.
        key = (what[:-1], unit_name)
        prefix = self._time_prefixes.get(key)
        if prefix is None:
            unit = self.model.unit(unit_name)
            device, host, comm = [0.0], [0.0], [0.0]
            for index in range(unit.num_layers):
                d, h, c = self._layer_seconds(what, unit, index)
                device.append(device[-1] + d)
                host.append(host[-1] + h)
                comm.append(comm[-1] + c)
            prefix = self._time_prefixes[key] = TimePrefix(device, host, comm)
        return prefix

    def _layer_time(self, what, unit: UnitSpec, index: int) -> float:
        """One layer's seconds of one micro-batch (_time_key), its TP collectives' included."""
        device, host, comm = self._layer_seconds(what, unit, index)
        return max(device, host) + comm

    def _layer_seconds(self, what, unit: UnitSpec, index: int) -> tuple[float, float, float]:
        """One layer's device and host seconds (ComputeModel.work_streams) and its blocking
        TP collectives'."""
        layer = unit.layers[index]
        phase, sharding, recompute, micro_batch, rows, _, (mesh, stage) = what
        samples, fraction = share_of(micro_batch, rows)
        work = Work(
            unit.name,
            phase,
            samples,
            (index, index + 1),
            sharding=sharding,
            recompute=recompute if phase == "bwd" else "none",
            fraction=fraction,
        )
        device, host = self.compute.work_streams(work, self.model)
        comm = 0.0
        if sharding.degree("tp") > 1 and layer.tp_allreduces:
            count = layer.tp_collectives(phase == "bwd", work.recompute)
            comm = count * mesh.tp(stage, layer.tp_comm_elems * micro_batch * self.act_bytes)
        return device, host, comm

    # ---- time -----------------------------------------------------------------------------
    def passes(self, deg: Degrees, cfg: MegatronSettings, virtual: list[list[Segment]]) -> Passes:
        """Every virtual stage's forward and backward (compute and blocking TP
        collectives, as segment_pass emits them), hop and stage tail."""
        pp, mb = deg.pp, deg.micro_batch
        runs = self.runs(deg, cfg.sequence_parallel, virtual)
        mesh = self._mesh(deg.tp, deg.dp, pp, runs)
        prefixes: dict[tuple, TimePrefix] = {}

        def seconds(phase: str, stage: int, segment: Segment) -> float:
            run = runs[stage]
            key = (phase, segment.unit, mesh.tp_price[stage], run)
            prefix = prefixes.get(key)
            if prefix is None:
                recompute = cfg.recompute if phase == "bwd" else "none"
                time_key = self._time_key(phase, run.sharding, recompute, mb, mesh, stage, run.rows)
                prefix = prefixes[key] = self._time_prefix(time_key, segment.unit)
            return prefix.seconds(*segment.layers)

        fwd, bwd, hop, hop_back, grads_back = [], [], [], [], []
        for v, segments in enumerate(virtual):
            stage = v % pp
            fwd.append(sum(seconds("fwd", stage, s) for s in segments))
            bwd.append(sum(seconds("bwd", stage, s) for s in segments if self.model.needs_backward(s.unit)))
            # B(v) receives its gradient from B(v+1) when its last segment trains or feeds a unit that does.
            grads_back.append(self.model.needs_backward(segments[-1].unit))
            if v < len(virtual) - 1:
                last = segments[-1]
                nbytes = boundary_elems(self.model.unit(last.unit), last.layers[1]) * mb * self.act_bytes
                after = (v + 1) % pp
                ahead, behind = runs[stage], runs[after]
                if ahead.replicated or behind.replicated:
                    rows = max(run.rows for run in (ahead, behind) if run.replicated)
                    transfer = replicated_transfer(nbytes, deg.tp, rows)
                    hop.append(self._replicated_hop(mesh, stage, (stage, after), (ahead, behind), transfer))
                    hop_back.append(self._replicated_hop(mesh, stage, (after, stage), (behind, ahead), transfer))
                else:
                    hop.append(mesh.hop(stage, stage_transfer(nbytes, deg.tp, cfg.sequence_parallel, cfg.scatter_gather)))
                    hop_back.append(hop[-1])
        tail = [self._tail(virtual, stage, deg, cfg, runs[stage], mesh) for stage in range(pp)]
        return Passes(fwd, bwd, hop, hop_back, grads_back, tail, self.microbatches(deg))

    @staticmethod
    def _replicated_hop(
        mesh: _MeshCosts, hop: int, stages: tuple[int, int], runs: tuple[StageRun, StageRun], transfer: StageTransfer
    ) -> float:
        """One way over hop `hop` with a replicated stage, from the first of `stages` (and
        `runs`) to the second: a share of rows, all-gathered over TP by a TP receiver, or
        first by a sequence-parallel sender where the receiver is replicated
        (pipeline.PipelineEmitter)."""
        seconds = mesh.send(hop, transfer.send_bytes)
        if not runs[1].replicated:
            seconds += mesh.gather(stages[1], transfer.gather_bytes)
        elif runs[0].sharding.sequence_parallel:
            seconds += mesh.gather(stages[0], transfer.gather_bytes)
        return seconds

    def layer_times(self, units: list[UnitSpec], deg: Degrees, cfg: MegatronSettings) -> list[float]:
        """Seconds of forward and backward of every layer of a chain of units, one
        micro-batch on stage 0: what the balanced cut (Optimus Appendix B) equalises."""
        sharding = tensor_parallel(deg.tp, cfg.sequence_parallel)
        mesh = self._mesh(deg.tp, deg.dp, deg.pp, [])
        out = []
        for unit in units:
            trained = self.model.needs_backward(unit.name)
            for index in range(unit.num_layers):
                # Each layer priced alone (not a difference of running sums, whose rounding
                # would tell equal layers apart and decide the cut's ties).
                seconds = self._layer_time(self._time_key("fwd", sharding, "none", deg.micro_batch, mesh, 0), unit, index)
                if trained:
                    key = self._time_key("bwd", sharding, cfg.recompute, deg.micro_batch, mesh, 0)
                    seconds += self._layer_time(key, unit, index)
                out.append(seconds)
        return out

    def work_bound(self, deg: Degrees, cfg: MegatronSettings) -> float:
        """The busiest stage's compute stream is at least the average one's: every layer's
        forward and backward for every micro-batch, over pp. Cheaper than any other bound
        (no virtual stage is looked at); 0 when stages price their TP collectives apart, or
        run their layers apart (a unit replicated over its TP group)."""
        mesh = self._mesh(deg.tp, deg.dp, deg.pp, [])
        if len(set(mesh.tp_price)) > 1 or (self.replicate and deg.tp > 1):
            return 0.0
        sharding = tensor_parallel(deg.tp, cfg.sequence_parallel)
        total = 0.0
        for unit in self.model.units:
            end = unit.num_layers
            total += self._time_prefix(self._time_key("fwd", sharding, "none", deg.micro_batch, mesh, 0), unit.name).seconds(0, end)
            if self.model.needs_backward(unit.name):
                key = self._time_key("bwd", sharding, cfg.recompute, deg.micro_batch, mesh, 0)
                total += self._time_prefix(key, unit.name).seconds(0, end)
        return self.microbatches(deg) * total / deg.pp * (1.0 - BOUND_SLACK)

    def quick_bound(self, deg: Degrees, cfg: MegatronSettings, passes: Passes) -> float:
        pp, m = deg.pp, passes.microbatches
        fwd, bwd, hop, tail = passes.fwd, passes.bwd, passes.hop, passes.tail
        profile = self.schedule_profile(cfg.schedule, pp, m, deg.vpp, cfg.extra_warmup)
        best, ready = 0.0, 0.0  # ready: when micro-batch 0 can enter stage s's first chunk
        for stage in range(pp):
            end = ready + m * sum(fwd[c * pp + stage] + bwd[c * pp + stage] for c in range(deg.vpp))
            best = max(best, end + tail[stage])
            if profile[stage].ends_with_first_chunk_backward and bwd[stage] > 0:
                # The same micro-batch's backward then runs through chunk 0 of the stages before.
                after = end
                for v in range(stage - 1, -1, -1):
                    if not passes.grads_back[v]:
                        break
                    after += passes.hop_back[v] + bwd[v]
                    best = max(best, after + tail[v])
            if stage < pp - 1:
                ready += fwd[stage] + hop[stage]
        return best * (1.0 - BOUND_SLACK)

    def path_bound(self, deg: Degrees, cfg: MegatronSettings, passes: Passes) -> float:
        pp, vpp = deg.pp, deg.vpp
        orders = self._orders(cfg.schedule, pp, passes.microbatches, vpp, cfg.extra_warmup)
        fwd, bwd, hop, grads_back = passes.fwd, passes.bwd, passes.hop, passes.grads_back
        last = len(fwd) - 1
        done: dict[tuple[str, int, int], float] = {}
        waiting: dict[tuple[str, int, int], list[int]] = {}
        clock, position = [0.0] * pp, [0] * pp
        ready = deque(range(pp))
        while ready:
            stage = ready.popleft()
            order = orders[stage]
            while position[stage] < len(order):
                op = order[position[stage]]
                v = op.chunk * pp + stage
                if op.kind == "F":
                    need = ("F", v - 1, op.microbatch) if v > 0 else None
                    seconds, gap = fwd[v], (hop[v - 1] if v > 0 else 0.0)
                else:
                    need = ("B", v + 1, op.microbatch) if v < last and grads_back[v] and bwd[v] > 0 else None
                    seconds, gap = bwd[v], (passes.hop_back[v] if v < last else 0.0)
                start = clock[stage]
                if need is not None:
                    arrived = done.get(need)
                    if arrived is None:
                        waiting.setdefault(need, []).append(stage)
                        break
                    start = max(start, arrived + gap)
                clock[stage] = start + seconds
                key = (op.kind, v, op.microbatch)
                done[key] = clock[stage]
                ready.extend(waiting.pop(key, ()))
                position[stage] += 1
        if any(position[s] < len(orders[s]) for s in range(pp)):
            raise RuntimeError(f"the {cfg.schedule} schedule of pp={pp} vpp={vpp} deadlocks")
        return max(clock[s] + passes.tail[s] for s in range(pp)) * (1.0 - BOUND_SLACK)

    def _tail(
        self, virtual: list[list[Segment]], stage: int, deg: Degrees, cfg: MegatronSettings, run: StageRun, mesh: _MeshCosts
    ) -> float:
        """The end of a stage's iteration (emit.iteration_tail): the blocking gradient
        reduction (asynchronous under overlap_grad_reduce: left out), the optimizer step of
        the local shard, the parameter all-gather of the distributed optimizer (chained into
        the next forward under overlap_param_gather: left out)."""
        segments = [s for chunk in range(deg.vpp) for s in virtual[chunk * deg.pp + stage]]
        params = sum(self.model.unit(s.unit).trainable_params(*s.layers) for s in segments) / run.sharding.devices
        if params == 0:
            return 0.0
        seconds = 0.0
        replicas = deg.dp * self.row_shares(run, deg)
        if replicas > 1 and not cfg.overlap_grad_reduce:
            seconds += mesh.dp(stage, dp_grad_op(cfg.zero_stage, cfg.grad_all_reduce), params * self.grad_bytes)
        shard = zero_shards(replicas, cfg.zero_stage).optimizer
        for segment in segments:
            if not self.model.unit(segment.unit).frozen:
                seconds += self.compute.work_time(
                    Work(segment.unit, "optimizer", 0, segment.layers, sharding=run.sharding, shard=shard), self.model
                )
        if cfg.zero_stage == 1 and replicas > 1 and not cfg.overlap_param_gather:
            seconds += mesh.dp(stage, "all_gather", params * self.weight_bytes)
        return seconds

    def _mesh(self, tp: int, dp: int, pp: int, runs: list[StageRun]) -> _MeshCosts:
        """`runs`: the stages' StageRuns, where any is replicated (else the mesh's DP groups)."""
        replicated = tuple(run.replicated for run in runs) or (False,) * pp
        key = (tp, dp, pp, replicated)
        if key not in self._meshes:
            self._meshes[key] = _MeshCosts(self.cluster, self.comm, tp, dp, pp, replicated)
        return self._meshes[key]
