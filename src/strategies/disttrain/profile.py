"""DistTrain's performance profile of each unit, priced by our cost model.

DistTrain profiles every module in trial runs and interpolates linearly (§3); we price
the same quantities with the cost model instead: for one unit at a TP degree, with or
without sequence parallelism, per recompute mode, every layer's forward and backward
seconds (the Work items the Program will hold), its TP all-reduces, its activation
bytes and parameters, at micro-batches of 1, 2, 4, ... sequences, interpolated linearly
in between (GEMM time is affine in the rows once they fill the GPU). Stages are cut at
block boundaries and priced from prefix sums.

A unit is Megatron-LM inside (DistTrain §7), with Megatron-LM's options per unit
(`Setting`): sequence parallelism, the pipeline's scatter/gather, the distributed
optimizer, recomputation and interleaving (vpp virtual stages per pipeline stage).
What the options change is priced as the Program runs them: a boundary's transfer as
`stages.stage_transfer` moves it (over the links its pipeline's pairs share), a stage's
end-of-iteration gradient reduction, optimizer step and parameter gather as
`emit.iteration_tail` emits them.

TP overlap (StepCCL, DistTrain §7) prices a pass as the Program runs it: `n` row chunks
whose collectives run under the next chunk's GEMMs, max(C_n + X/n, C_n/n + X) for
compute C_n (n chunks of 1/n of the rows) and communication X.

A unit replicated over its TP group (`Setting.replicated`, strategy.replicate: DistTrain
§8.1, "we replicate the encoder and generator across the GPUs within the TP group to
process different images, whereas TP itself is not used") holds the whole unit on each of
the group's GPUs and runs its share of every micro-batch's images, dealt out whole
(stages.replicated_rows: the busiest GPU's share sets the pace); it does no TP collective
and reduces its gradients over the group's and the replicas' GPUs together. It runs on one
pipeline stage (one GPU holds the whole unit).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from src.cluster import ClusterSpec
from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import (
    element_bytes,
    grad_bytes,
    model_state_bytes,
    rematerialised_bytes,
    states_precision,
    weight_bytes,
    zero_shards,
)
from src.mesh import Sharding, tensor_parallel
from src.models.flows import flows_of
from src.models.spec import ModelSpec
from src.program import RECOMPUTE_MODES, Phase, Work
from src.schedules.pipeline import PipeOp
from src.strategies.builders.emit import paired_gemms, share_of
from src.strategies.builders.stages import block_cuts, boundary_elems, replicated_rows, replicated_transfer, stage_transfer

TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Setting:
    """One unit's Megatron-LM options: what its stages, transfers and memory depend on
    besides its degrees."""

    tp: int
    recompute: str = "none"
    sequence_parallel: bool = False
    zero_stage: int = 1
    scatter_gather: bool = True
    vpp: int = 1
    replicated: bool = False  # the whole unit on each GPU of its TP group, the images dealt out

    @property
    def sharding(self) -> Sharding:
        return Sharding() if self.replicated else tensor_parallel(self.tp, self.sequence_parallel)

    @property
    def data_replicas(self) -> int:
        """GPUs of one stage that hold the same parameters, per DP replica."""
        return self.tp if self.replicated else 1

    def describe(self) -> str:
        return (
            f"tp={self.tp}{' replicated' if self.replicated else ''} recompute={self.recompute} "
            f"sp={'on' if self.sequence_parallel else 'off'} zero={self.zero_stage} "
            f"sg={'on' if self.scatter_gather else 'off'} vpp={self.vpp}"
        )


@dataclass(frozen=True)
class StageArrays:
    """A unit's pipeline: per virtual stage (pp x vpp of them, in model order; virtual
    stage v runs on pipeline stage v % pp) its seconds and activations per micro-batch,
    per pipeline stage its model states and end-of-iteration seconds."""

    layers: tuple[tuple[int, int], ...]
    fwd: np.ndarray
    bwd: np.ndarray
    activations: np.ndarray  # bytes one micro-batch keeps on one GPU until its backward
    states: np.ndarray  # per stage: bytes of model states per GPU
    trainable: np.ndarray  # per stage: trainable parameters per GPU
    tail: np.ndarray  # per stage: gradient reduction, optimizer step, parameter gather
    # per stage: bytes one micro-batch's backward brings back for a moment under full recompute
    # (its largest block's whole activations, src.costmodel.memory.rematerialised_bytes)
    transient: np.ndarray

    @property
    def pp(self) -> int:
        return len(self.states)

    @property
    def fb(self) -> np.ndarray:
        """Per pipeline stage: forward and backward of one micro-batch through all its chunks."""
        return (self.fwd + self.bwd).reshape(-1, self.pp).sum(axis=0)

    @property
    def kept(self) -> np.ndarray:
        """Per pipeline stage: activations of one micro-batch through all its chunks."""
        return self.activations.reshape(-1, self.pp).sum(axis=0)

    def holds(self, orders: list[list[PipeOp]], peak: float, usable: float) -> bool:
        """Whether each stage (orders: its order of chunk forwards and backwards) holds its
        model states and the most activations its order keeps at once (each chunk's forward
        adds its own until its backward, at `peak` times the nominal load), with what a
        backward under full recompute brings back for a moment, in `usable` bytes."""
        for stage, order in enumerate(orders):
            live = most = 0.0
            for op in order:
                kept = float(self.activations[op.chunk * self.pp + stage])
                live += kept if op.kind == "F" else -kept
                most = max(most, live)
            if float(self.states[stage]) + peak * (most + float(self.transient[stage])) > usable:
                return False
        return True


# Rows of a unit's profile table: per-layer prefix sums (column i: layers [0, i)). The TP
# all-reduces' latency and transfer seconds of the forward and of the backward (which
# under full recompute re-runs the forward's).
FWD, BWD, LATENCY, TRANSFER, BWD_LATENCY, BWD_TRANSFER, EXCESS, BWD_EXCESS, ACT, TRAINABLE, FIXED = range(11)
# One side of a hand-off between units: (name, tp, dp, micro-batch, replicated over its TP group).
BrokerEnd = tuple[str, int, int, int, bool]


class Profiler:
    def __init__(self, model: ModelSpec, cluster: ClusterSpec, precision: str, overlap_chunks: int) -> None:
        self.model, self.cluster, self.precision = model, cluster, precision
        self.chunks = overlap_chunks
        self.compute = ComputeModel(cluster, precision)
        self.comm = CommModel(cluster)
        self.act_bytes, self.weight_bytes = element_bytes(precision), weight_bytes(precision, cluster.amp)
        self.grad_bytes = grad_bytes(precision)
        self._grids: dict[tuple[str, int, bool, int, bool], dict[str, np.ndarray]] = {}
        self.stages = lru_cache(maxsize=None)(self._stages)

    def tp_degrees(self, unit: str, replicated: bool = False) -> list[int]:
        """TP inside one node, dividing a transformer's heads (a U-Net's TP splits channels;
        a unit replicated over the group splits nothing)."""
        spec = self.model.unit(unit)
        node = self.cluster.devices_per_node
        splits = spec.kind == "transformer" and not replicated
        return [t for t in TP_DEGREES if t <= node and (not splits or spec.heads % t == 0)]

    @lru_cache(maxsize=None)
    def blocks(self, unit: str) -> int:
        """The most virtual pipeline stages a unit can be cut into (one block each)."""
        spec = self.model.unit(unit)
        return sum(1 for layer in spec.layers if layer.tp_allreduces > 0) or spec.num_layers

    @lru_cache(maxsize=None)
    def cuts(self, unit: str, parts: int) -> tuple[tuple[int, int], ...]:
        """[start, end) layers of each of `parts` virtual stages, cut at block boundaries."""
        return tuple(block_cuts(self.model.unit(unit), parts, uneven=True, what="pp"))

    # ---- the profile -----------------------------------------------------------------------
    def _grid(self, unit: str, tp: int, sequence_parallel: bool, size: int, replicated: bool = False) -> dict[str, np.ndarray]:
        """The profile table of a unit at one sharding and micro-batch `size` (rows FWD
        ... FIXED: compute seconds as the pass runs them, its TP all-reduces' latency and
        transfer seconds, bytes kept per sequence, trainable and frozen parameters per TP
        rank), per recompute mode. Replicated over `tp` GPUs: the busiest GPU's share of
        the micro-batch, the whole unit's parameters."""
        replicated = replicated and tp > 1
        key = (unit, tp, sequence_parallel and tp > 1 and not replicated, size, replicated)
        if key not in self._grids:
            rows = replicated_rows(self.model.unit(unit), size, tp) if replicated else 1.0
            sharding = Sharding() if replicated else tensor_parallel(tp, sequence_parallel)
            self._grids[key] = self._price(unit, sharding, size, rows)
        return self._grids[key]

    def _price(self, unit: str, sharding: Sharding, size: int, rows: float = 1.0) -> dict[str, np.ndarray]:
        spec, model = self.model.unit(unit), self.model
        tp = sharding.degree("tp")
        chunks = self.chunks if tp > 1 else 1
        backward = model.needs_backward(unit)
        count = spec.num_layers
        columns = {r: np.zeros((ACT + 1, count)) for r in RECOMPUTE_MODES}  # FWD .. ACT
        memo: dict[tuple, dict[str, tuple]] = {}
        for i, layer in enumerate(spec.layers):
            kept = not layer.forward_only and (spec.trains(layer) or model.needs_input_grad(unit, i))
            key = (id(layer), kept, model.needs_input_grad(unit, i), spec.trains(layer))
            if key not in memo:
                memo[key] = self._layer(unit, i, size, sharding, chunks, backward, kept, rows)
            for r, values in memo[key].items():
                columns[r][:, i] = values
        trainable = np.array([spec.trainable_params(i, i + 1) / tp for i in range(count)])
        fixed = np.array([layer.params / tp for layer in spec.layers]) - trainable
        out = {}
        for r, c in columns.items():
            table = np.vstack([c, trainable, fixed])
            out[r] = np.concatenate([np.zeros((len(table), 1)), np.cumsum(table, axis=1)], axis=1)
        return out

    def _layer(
        self, unit: str, index: int, size: int, sharding: Sharding, chunks: int, backward: bool, kept: bool, rows: float = 1.0
    ) -> dict[str, tuple[float, ...]]:
        """(forward, backward, the forward's and the backward's TP all-reduce latency and
        transfer seconds, what of a chunk's paired transfers outlasts their GEMMs' chunks in
        forward and in backward (emit's overlapped pass), activation bytes per sequence) of
        one layer for `size` sequences, per recompute mode; `rows`: the share of them this
        GPU runs (a unit replicated over its TP group), as the Program's Work runs it
        (emit.share_of)."""
        layer = self.model.unit(unit).layers[index]
        span = (index, index + 1)
        tp = sharding.degree("tp")
        samples, fraction = share_of(size, rows)

        def seconds(phase: Phase, recompute: str = "none") -> float:
            work = Work(unit, phase, samples, span, sharding=sharding, recompute=recompute, fraction=fraction / chunks, chunks=chunks)
            return chunks * self.compute.work_time(work, self.model)

        fwd = seconds("fwd")
        latency = transfer = 0.0
        if layer.tp_allreduces and tp > 1:
            group = tuple(range(tp))
            latency, transfer = self.comm.collective_parts("all_reduce", group, layer.tp_comm_elems * size * self.act_bytes)

        def outlasting(backward_pass: bool, recompute: str) -> float:
            pairs = layer.tp_pairs(backward_pass, recompute, sharding.sequence_parallel) if chunks > 1 and transfer else None
            if pairs is None:
                return 0.0
            chunk_s = latency + transfer / chunks
            return sum(
                self.compute.outlasting(chunk_s, paired_gemms(unit, index, samples, sharding, fraction / chunks, pair), self.model)
                for pair in pairs
            )

        out: dict[str, tuple[float, ...]] = {}
        for r in RECOMPUTE_MODES:
            forward, back = layer.tp_collectives(False, r), layer.tp_collectives(True, r)
            out[r] = (
                fwd,
                seconds("bwd", r) if backward else 0.0,
                forward * latency,
                forward * transfer,
                back * latency,
                back * transfer,
                outlasting(False, r),
                outlasting(True, r) if backward else 0.0,
                rows * layer.kept_activations(sharding, r) if kept and backward else 0.0,
            )
        return out

    # ---- stages from the profile -----------------------------------------------------------
    def _pass(self, compute: np.ndarray, latency: np.ndarray, transfer: np.ndarray, excess: np.ndarray, tp: int) -> np.ndarray:
        """A stage's pass as emit.segment_pass runs it: compute, then its TP collectives on
        the compute stream; or StepCCL's n row chunks, each chunk's collectives (each with
        its whole latency and 1/n of the transfer) on their own stream under the next
        chunk's compute, which they do not slow (StepCCL's copy engines hold no SMs), what
        of each transfer but the last chunk's outlasts its paired GEMM (`excess`, a chunk's)
        holding the compute stream back."""
        n = self.chunks if tp > 1 else 1
        if n == 1:
            return compute + latency + transfer
        part, comm = compute / n, latency + transfer / n
        done = part.copy()  # the first chunk's compute ends
        landed = done + comm  # and its collectives
        for _ in range(n - 1):
            done = done + excess + part
            landed = np.maximum(done, landed) + comm
        return np.where(latency + transfer > 0, landed, compute)

    @lru_cache(maxsize=None)
    def _state_coefficients(self, zero_stage: int, dp: int) -> tuple[float, float]:
        """Bytes per trainable and per frozen parameter on one GPU (ZeRO over dp)."""
        trainable, frozen = (
            sum(model_state_bytes(1.0, states_precision(self.precision, self.cluster.amp), f, zero_stage, dp).values())
            for f in (False, True)
        )
        return trainable, frozen

    def _stages(self, unit: str, setting: Setting, b: int, dp: int, pp: int) -> StageArrays:
        """Every virtual stage of the unit cut into pp x vpp (block boundaries, unequal
        depths allowed), for micro-batches of b sequences."""
        if setting.replicated and pp * setting.vpp > 1:
            raise ValueError(f"{unit} replicated over its TP group runs on one pipeline stage, not {pp} x {setting.vpp}")
        vpp, replicas = setting.vpp, dp * setting.data_replicas
        tp = 1 if setting.replicated else setting.tp  # the degree that splits the unit
        fwd, bwd, act, trainable, fixed = self._passes(
            unit, setting.tp, setting.sequence_parallel, setting.recompute, b, pp * vpp, setting.replicated
        )
        per_trainable, per_fixed = self._state_coefficients(setting.zero_stage, replicas)
        states = (per_trainable * trainable + per_fixed * fixed).reshape(vpp, pp).sum(axis=0)
        tail = self._tails(unit, tp, setting.zero_stage, replicas, pp, vpp)
        cuts = self.cuts(unit, pp * vpp)
        transient = np.zeros(pp)
        if setting.recompute == "full" and self.model.needs_backward(unit):
            largest = self._rematerialised(unit, tp, setting.sequence_parallel)
            chunks = np.array([largest[start:end].max(initial=0.0) for start, end in cuts]).reshape(vpp, pp)
            # A TP pass in StepCCL's row chunks recomputes one chunk at a time; a replicated
            # unit its busiest GPU's share of the micro-batch.
            share = replicated_rows(self.model.unit(unit), b, setting.tp) if setting.replicated else 1.0
            transient = b * share * chunks.max(axis=0) / (self.chunks if tp > 1 else 1)
        return StageArrays(cuts, fwd, bwd, act, states, trainable.reshape(vpp, pp).sum(axis=0), tail, transient)

    @lru_cache(maxsize=None)
    def _rematerialised(self, unit: str, tp: int, sequence_parallel: bool) -> np.ndarray:
        """Per layer: one sequence's bytes full recomputation brings back while its backward
        runs (a block's whole activations; none for the layers around the blocks)."""
        sharding = tensor_parallel(tp, sequence_parallel)
        return np.array([rematerialised_bytes([layer], sharding) for layer in self.model.unit(unit).layers])

    @lru_cache(maxsize=None)
    def _passes(
        self, unit: str, tp: int, sequence_parallel: bool, recompute: str, b: int, parts: int, replicated: bool = False
    ) -> tuple[np.ndarray, ...]:
        """Per virtual stage of `parts`: forward and backward seconds, activations kept,
        trainable and frozen parameters per TP rank, for micro-batches of b sequences:
        priced at the powers of two around b and interpolated linearly (replicated over
        `tp` GPUs: at b itself, whose busiest GPU's share of the images is not linear in
        b). What the DP degree and the optimizer's sharding leave alone, shared by all of them."""
        cuts = np.array(self.cuts(unit, parts))
        lo, hi = cuts[:, 0], cuts[:, 1]
        low = b if replicated else 1 << (b.bit_length() - 1)
        below = self._grid(unit, tp, sequence_parallel, low, replicated)[recompute]
        sums = below[:, hi] - below[:, lo]
        if low != b:
            above = self._grid(unit, tp, sequence_parallel, 2 * low)[recompute]
            weight = (b - low) / low
            sums = (1 - weight) * sums + weight * (above[:, hi] - above[:, lo])
        split = 1 if replicated else tp
        fwd = self._pass(sums[FWD], sums[LATENCY], sums[TRANSFER], sums[EXCESS], split)
        backward = self.model.needs_backward(unit)
        bwd = self._pass(sums[BWD], sums[BWD_LATENCY], sums[BWD_TRANSFER], sums[BWD_EXCESS], split) if backward else np.zeros(parts)
        return fwd, bwd, sums[ACT] * b, sums[TRAINABLE], sums[FIXED]

    def whole(self, unit: str, setting: Setting, b: int, dp: int) -> StageArrays:
        """The unit on one stage (no interleaving)."""
        return self.stages(unit, replace(setting, scatter_gather=True, vpp=1), b, dp, 1)

    # ---- communication ---------------------------------------------------------------------
    @lru_cache(maxsize=None)
    def _pipeline_links(self, tp: int, dp: int, pp: int, offset: int) -> tuple[tuple[bool, ...], int]:
        """Which of a (tp, dp, pp) mesh's stage boundaries (placed at `offset`) cross
        nodes, and how many of its pipeline's pairs share a node's links
        (cluster.family_sharing of builders.layout.pipeline_pairs), counted over the
        contiguous ranks without building the mesh."""
        node, size = self.cluster.devices_per_node, tp * dp
        senders = offset + np.arange(size * (pp - 1))
        src, dst = senders // node, (senders + size) // node
        crossing = src != dst
        sharing = int(np.bincount(np.concatenate([src[crossing], dst[crossing]])).max()) if crossing.any() else 1
        return tuple(crossing.reshape(pp - 1, size).any(axis=1).tolist()), sharing

    @lru_cache(maxsize=None)
    def _dp_sharing(self, tp: int, dp: int, pp: int) -> int:
        """How many of a (tp, dp, pp) mesh's DP groups (placed at rank 0) share a node's
        links (cluster.family_sharing of its DP family): on each node, the groups that
        span nodes and have a rank there. A group's ranks are tp apart, no more than a
        node's GPUs (TP stays in a node), so it has a rank on every node from its first
        rank's to its last's: the count is a sum of intervals, one per group."""
        node, size = self.cluster.devices_per_node, tp * dp
        if dp == 1:
            return 1
        assert tp <= node, f"TP {tp} spans nodes of {node} GPUs"
        first = (np.arange(pp)[:, None] * size + np.arange(tp)).ravel()  # per stage and TP rank
        start, end = first // node, (first + (dp - 1) * tp) // node
        spans = start != end
        if not spans.any():
            return 1
        nodes = int(end.max()) + 2
        starts = np.bincount(start[spans], minlength=nodes) - np.bincount(end[spans] + 1, minlength=nodes)
        return int(np.cumsum(starts).max())

    @lru_cache(maxsize=None)
    def hops(self, unit: str, setting: Setting, b: int, dp: int, pp: int, offset: int = 0) -> tuple[float, ...]:
        """Seconds of one micro-batch's activation (or its gradient) across each boundary
        between the unit's virtual stages (virtual stage v runs on stage v % pp), its mesh
        placed at `offset`: each TP rank's send (stages.stage_transfer; the slowest pair
        of the hop's stages, over the links the pipeline's pairs share), then the receiving
        stage's TP all-gather where the transfer was scattered."""
        parts = pp * setting.vpp
        if parts == 1:
            return ()
        nbytes = b * boundary_elems(self.model.unit(unit), 0) * self.act_bytes
        transfer = stage_transfer(nbytes, setting.tp, setting.sequence_parallel, setting.scatter_gather)
        node = self.cluster.devices_per_node
        if pp > 1:
            crossing, sharing = self._pipeline_links(setting.tp, dp, pp, offset)
            crossing += (offset // node != (offset + pp * setting.tp * dp - 1) // node,)  # the last stage back to the first
        else:
            crossing, sharing = (False,), 1
        gather = self._gather(setting.tp, transfer.gather_bytes)
        seconds = [self.comm.p2p_time(0, node if crosses else 1, transfer.send_bytes, sharing) + gather for crosses in crossing]
        return tuple(seconds[v % pp] for v in range(parts - 1))

    def hop(self, unit: str, setting: Setting, b: int, dp: int) -> float:
        """A boundary's transfer between two nodes: what the relaxation charges per stage."""
        nbytes = b * boundary_elems(self.model.unit(unit), 0) * self.act_bytes
        if setting.replicated:
            transfer = replicated_transfer(nbytes, setting.tp, replicated_rows(self.model.unit(unit), b, setting.tp))
        else:
            transfer = stage_transfer(nbytes, setting.tp, setting.sequence_parallel, setting.scatter_gather)
        _, sharing = self._pipeline_links(setting.tp, dp, 2, 0)
        return self.comm.p2p_time(0, self.cluster.devices_per_node, transfer.send_bytes, sharing) + self._gather(
            setting.tp, transfer.gather_bytes
        )

    def _gather(self, tp: int, nbytes: float) -> float:
        return self.comm.collective_time("all_gather", tuple(range(tp)), nbytes) if nbytes else 0.0

    @lru_cache(maxsize=None)
    def broker_parts(self, src: BrokerEnd, dst: BrokerEnd) -> tuple[float, float]:
        """Seconds of one micro-batch's hand-off from unit (name, tp, dp, micro-batch,
        replicated) `src` to `dst`, and of its gradient back (programs.Broker): the side
        with fewer replicas sends one sequence to each replica of the other in turn (its
        sends leave one after another), or receives theirs at once; a receiving replica's
        lead broadcasts what it got to its TP peers, and a sending replica replicated over
        its TP group first all-gathers its GPUs' shares."""
        (producer, src_tp, src_dp, src_b, src_rep), (consumer, dst_tp, dst_dp, dst_b, dst_rep) = src, dst
        flow = next(f for f in flows_of(self.model) if (f.producer, f.consumer) == (producer, consumer))
        node = self.cluster.devices_per_node
        # The leads (first TP rank of each replica) of a node send and receive at once.
        sharing = max(min(src_dp, max(1, node // src_tp)), min(dst_dp, max(1, node // dst_tp)))
        message = self.comm.p2p_time(0, node, flow.elems * self.act_bytes, sharing)
        fan = max(src_dp, dst_dp) // min(src_dp, dst_dp)
        forward = message * (fan if src_dp < dst_dp else 1) + self._broadcast(dst_tp, dst_b * flow.elems)
        backward = message * (fan if dst_dp < src_dp else 1) + self._broadcast(src_tp, src_b * flow.elems)
        forward += self._gather(src_tp, src_b * flow.elems * self.act_bytes) if src_rep else 0.0
        backward += self._gather(dst_tp, dst_b * flow.elems * self.act_bytes) if dst_rep else 0.0
        return forward, backward

    def broker(self, src: BrokerEnd, dst: BrokerEnd) -> float:
        """The hand-off there and back."""
        return sum(self.broker_parts(src, dst))

    def _broadcast(self, tp: int, elems: float) -> float:
        return self.comm.collective_time("broadcast", tuple(range(tp)), elems * self.act_bytes) if tp > 1 else 0.0

    @lru_cache(maxsize=None)
    def _tails(self, unit: str, tp: int, zero_stage: int, dp: int, pp: int, vpp: int) -> np.ndarray:
        """Per stage, what emit.iteration_tail ends the iteration with: the gradient
        reduction over DP (reduce-scatter under the distributed optimizer), the optimizer
        step on each chunk's shard (the cost model's bandwidth-bound Adam), the 16-bit
        parameters' all-gather."""
        cuts = np.array(self.cuts(unit, pp * vpp))
        prefix = self._grid(unit, tp, False, 1)["none"][TRAINABLE]
        chunks = prefix[cuts[:, 1]] - prefix[cuts[:, 0]]  # trainable parameters per TP rank
        shards = zero_shards(dp, zero_stage)
        out = np.zeros(pp)
        if not self.model.unit(unit).frozen:
            for v, params in enumerate(chunks.tolist()):
                out[v % pp] += self.compute.optimizer_time(params, shards.optimizer, shards.grads) if params else 0.0
        if dp == 1:
            return out
        sharing = self._dp_sharing(tp, dp, pp)
        ring = self._dp_ring(tp, dp)
        priced: dict[float, float] = {}
        for stage, params in enumerate(chunks.reshape(vpp, pp).sum(axis=0).tolist()):
            if params and params not in priced:
                if zero_stage >= 1:
                    priced[params] = self.comm.collective_time(
                        "reduce_scatter", ring, params * self.grad_bytes, sharing
                    ) + self.comm.collective_time("all_gather", ring, params * self.weight_bytes, sharing)
                else:
                    priced[params] = self.comm.collective_time("all_reduce", ring, params * self.grad_bytes, sharing)
            out[stage] += priced.get(params, 0.0)
        return out

    @lru_cache(maxsize=None)
    def _dp_ring(self, tp: int, dp: int) -> tuple[int, ...]:
        """A stage's DP group (a mesh placed at rank 0): every tp-th rank."""
        return tuple(range(0, tp * dp, tp))
