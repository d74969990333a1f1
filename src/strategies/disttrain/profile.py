"""DistTrain's performance profile of each unit, priced by our cost model.

DistTrain profiles every module in trial runs and interpolates linearly (§3); we price
the same quantities with the cost model instead: for one unit at a TP degree and a
recompute mode, every layer's forward and backward seconds (the Work items the Program
will hold), its TP all-reduces inside a node, its activation bytes and parameters, at
micro-batches of 1, 2, 4, ... sequences, interpolated linearly in between (GEMM time is
affine in the rows once they fill the GPU). Stages are cut at block boundaries and
priced from prefix sums.

TP overlap (StepCCL, DistTrain §7) prices a pass as the Program runs it: `n` row chunks
whose collectives run under the next chunk's GEMMs, max(C_n + X/n, C_n/n + X) for
compute C_n (n chunks of 1/n of the rows) and communication X.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from src.cluster import ClusterSpec
from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import element_bytes, grad_bytes, model_state_bytes
from src.mesh import tensor_parallel
from src.models.spec import ModelSpec
from src.program import RECOMPUTE_MODES, Phase, Work
from src.strategies.builders.stages import block_cuts, boundary_elems

TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class StageCost:
    layers: tuple[int, int]
    fwd: float
    bwd: float
    states: float  # bytes of model states per GPU (ZeRO over the unit's DP)
    activations: float  # bytes one micro-batch leaves on one GPU until its backward

    @property
    def fb(self) -> float:
        return self.fwd + self.bwd


@dataclass(frozen=True)
class StageArrays:
    """A unit's pipeline stages, one entry per stage."""

    layers: tuple[tuple[int, int], ...]
    fwd: np.ndarray
    bwd: np.ndarray
    states: np.ndarray  # bytes of model states per GPU
    activations: np.ndarray  # bytes one micro-batch keeps per GPU until its backward
    trainable: np.ndarray  # trainable parameters per GPU

    @property
    def fb(self) -> np.ndarray:
        return self.fwd + self.bwd


# Rows of a unit's profile table: per-layer prefix sums (column i: layers [0, i)).
FWD, BWD, COMM, ACT, TRAINABLE, FIXED = range(6)


class Profiler:
    def __init__(self, model: ModelSpec, cluster: ClusterSpec, precision: str, zero_stage: int, overlap_chunks: int) -> None:
        self.model, self.cluster, self.precision = model, cluster, precision
        self.zero_stage, self.chunks = zero_stage, overlap_chunks
        self.compute = ComputeModel(cluster, precision)
        self.comm = CommModel(cluster)
        self.act_bytes = element_bytes(precision)
        self.grad_bytes = grad_bytes(precision)
        self._grids: dict[tuple[str, int, int], dict[str, np.ndarray]] = {}
        self.profile_s = 0.0
        self.stages = lru_cache(maxsize=None)(self._stages)
        self.whole = lru_cache(maxsize=None)(self._whole)

    def tp_degrees(self, unit: str) -> list[int]:
        """TP inside one node, dividing a transformer's heads (a U-Net's TP splits channels)."""
        spec = self.model.unit(unit)
        node = self.cluster.devices_per_node
        return [t for t in TP_DEGREES if t <= node and (spec.kind != "transformer" or spec.heads % t == 0)]

    @lru_cache(maxsize=None)
    def blocks(self, unit: str) -> int:
        """The most pipeline stages a unit can be cut into (one block each)."""
        spec = self.model.unit(unit)
        return sum(1 for layer in spec.layers if layer.tp_allreduces > 0) or spec.num_layers

    @lru_cache(maxsize=None)
    def cuts(self, unit: str, pp: int) -> np.ndarray:
        """[start, end) layers of each of pp stages, cut at block boundaries."""
        return np.array(block_cuts(self.model.unit(unit), pp, uneven=True, what="pp"))

    # ---- the profile -----------------------------------------------------------------------
    def _grid(self, unit: str, tp: int, size: int) -> dict[str, np.ndarray]:
        """The profile table of a unit at one TP degree and micro-batch `size` (rows FWD
        ... FIXED: compute seconds as the pass runs them, TP all-reduce seconds, bytes
        kept per sequence, trainable and frozen parameters per TP rank), per recompute
        mode."""
        key = (unit, tp, size)
        if key not in self._grids:
            self._grids[key] = self._price(unit, tp, size)
        return self._grids[key]

    def _price(self, unit: str, tp: int, size: int) -> dict[str, np.ndarray]:
        spec, model = self.model.unit(unit), self.model
        sharding = tensor_parallel(tp)
        chunks = self.chunks if tp > 1 else 1
        group = tuple(range(tp))
        backward = model.needs_backward(unit)
        count = spec.num_layers
        columns = {r: np.zeros((4, count)) for r in RECOMPUTE_MODES}  # fwd, bwd, comm, act
        memo: dict[tuple, dict[str, tuple]] = {}
        for i, layer in enumerate(spec.layers):
            kept = not layer.forward_only and (spec.trains(layer) or model.needs_input_grad(unit, i))
            key = (id(layer), kept, model.needs_input_grad(unit, i), spec.trains(layer))
            if key not in memo:
                memo[key] = self._layer(unit, i, size, sharding, chunks, group, backward, kept)
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
        self, unit: str, index: int, size: int, sharding, chunks: int, group: tuple[int, ...], backward: bool, kept: bool
    ) -> dict[str, tuple[float, float, float, float]]:
        """(forward, backward, TP all-reduce seconds, activation bytes per sequence) of one
        layer for `size` sequences, per recompute mode."""
        layer = self.model.unit(unit).layers[index]
        span = (index, index + 1)

        def seconds(phase: Phase, recompute: str = "none") -> float:
            work = Work(unit, phase, size, span, sharding=sharding, recompute=recompute, fraction=1.0 / chunks)
            return chunks * self.compute.work_time(work, self.model)

        fwd = seconds("fwd")
        comm = (
            layer.tp_allreduces * self.comm.collective_time("all_reduce", group, layer.tp_comm_elems * size * self.act_bytes)
            if layer.tp_allreduces
            else 0.0
        )
        return {
            r: (
                fwd,
                seconds("bwd", r) if backward else 0.0,
                comm,
                layer.activations.per_device(sharding, r) if kept and backward else 0.0,
            )
            for r in RECOMPUTE_MODES
        }

    # ---- stages from the profile -----------------------------------------------------------
    def _pass(self, compute: np.ndarray, comm: np.ndarray, tp: int) -> np.ndarray:
        n = self.chunks if tp > 1 else 1
        if n == 1:
            return compute + comm
        return np.where(comm > 0, np.maximum(compute + comm / n, compute / n + comm), compute)

    @lru_cache(maxsize=None)
    def _state_coefficients(self, dp: int) -> tuple[float, float]:
        """Bytes per trainable and per frozen parameter on one GPU (ZeRO over dp)."""
        trainable, frozen = (sum(model_state_bytes(1.0, self.precision, f, self.zero_stage, dp).values()) for f in (False, True))
        return trainable, frozen

    def _stages(self, unit: str, tp: int, b: int, recompute: str, dp: int, pp: int) -> StageArrays:
        """Every stage of the unit cut into pp (block boundaries, unequal depths allowed),
        for micro-batches of b sequences: priced at the powers of two around b and
        interpolated linearly."""
        cuts = self.cuts(unit, pp)
        lo, hi = cuts[:, 0], cuts[:, 1]
        low = 1 << (b.bit_length() - 1)
        below = self._grid(unit, tp, low)[recompute]
        sums = below[:, hi] - below[:, lo]
        if low != b:
            above = self._grid(unit, tp, 2 * low)[recompute]
            weight = (b - low) / low
            sums = (1 - weight) * sums + weight * (above[:, hi] - above[:, lo])
        fwd = self._pass(sums[FWD], sums[COMM], tp)
        bwd = self._pass(sums[BWD], sums[COMM], tp) if self.model.needs_backward(unit) else np.zeros(len(cuts))
        per_trainable, per_fixed = self._state_coefficients(dp)
        states = per_trainable * sums[TRAINABLE] + per_fixed * sums[FIXED]
        return StageArrays(self.layers(unit, pp), fwd, bwd, states, sums[ACT] * b, sums[TRAINABLE])

    @lru_cache(maxsize=None)
    def layers(self, unit: str, pp: int) -> tuple[tuple[int, int], ...]:
        return tuple(map(tuple, self.cuts(unit, pp).tolist()))

    def _whole(self, unit: str, tp: int, b: int, recompute: str, dp: int) -> StageCost:
        whole = self.stages(unit, tp, b, recompute, dp, 1)
        return StageCost(
            whole.layers[0], float(whole.fwd[0]), float(whole.bwd[0]), float(whole.states[0]), float(whole.activations[0])
        )

    # ---- communication ---------------------------------------------------------------------
    def hop_bytes(self, unit: str, b: int) -> float:
        """Bytes a micro-batch carries across a stage boundary inside a unit (the LLM's
        token states, an encoder's patch tokens), its gradient as many back."""
        return 2 * b * boundary_elems(self.model.unit(unit), 0) * self.act_bytes

    def p2p(self, nbytes: float) -> float:
        """One boundary's transfer between nodes (the conservative link)."""
        return self.comm.p2p_time(0, self.cluster.devices_per_node, nbytes) if nbytes else 0.0

    def dp_reduce(self, params: float, dp: int) -> float:
        """The end-of-iteration gradient reduction of `params` trainable parameters per GPU
        over dp replicas (ZeRO-1: reduce-scatter + all-gather; a ring across nodes)."""
        if dp == 1 or params == 0:
            return 0.0
        return self._ring(float(params), dp)

    @lru_cache(maxsize=None)
    def _ring(self, params: float, dp: int) -> float:
        node = self.cluster.devices_per_node
        ring = tuple(range(0, dp * node, node))
        if self.zero_stage >= 1:
            return self.comm.collective_time("reduce_scatter", ring, params * self.grad_bytes) + self.comm.collective_time(
                "all_gather", ring, params * self.act_bytes
            )
        return self.comm.collective_time("all_reduce", ring, params * self.grad_bytes)
