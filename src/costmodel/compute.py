"""Compute time of kernels, layers and Work items on one device.

A GEMM runs at peak x efficiency, where the efficiency saturates in each of its
dimensions (cluster.gemm_half_dim): a thin GEMM (small per-device batch, a dimension cut
by an over-large TP degree) is slow, as DistMM §3.2 argues. Where the preset holds its
library's GEMMs measured by shape (cluster.gemm_measurements), they correct that curve
(src/gemm_measurements.py). Every kernel is also bounded
below by the bytes it moves over HBM, and costs the device a fixed gap
(cluster.kernel_overhead_s); a GEMM kernel a fixed time more (cluster.gemm_fixed_s: its
tiles' first operands in flight, its epilogue), which sets a small GEMM's time.

The framework issues every kernel from the host (eager PyTorch: module calls, the
dispatcher, autograd), at host_forward_kernel_s per kernel of a forward and
host_backward_kernel_s per kernel of a backward (both per kernel as kernel_launches
counts them); under PyTorch AMP each cast it adds (a weight's and a bias's at their
GEMM, a 16-bit copy of an fp32 normalisation's or loss's input, and each one's backward)
at host_forward_kernel_s; one launch per layer and pass where it replays each layer from
CUDA graphs (cluster.host_launch). A GPU runs behind its host, so a layer takes the
longer of its device time and its host time: small layers (narrow hidden sizes, few
samples per device) are bound by the framework, large ones by the device. Nothing inside
a Work item blocks the host, so while the device runs a device-bound layer the host
issues the next layers' kernels, and host-bound layers after it start that much sooner:
a Work item is a flow of its layers (in the order it runs them) through the host, then
the device. Where the host is the device (CPU workers: cluster.host_async false) the two
add up, the host's part and the bandwidth-bound kernels too at the worker's share of the
cores (oversubscription), as its GEMMs (the peak). Under ZeRO-3 the framework's hooks
also fetch each module's parameters on the host (cluster.host_fetch_s per fetch,
host_fetch_byte_s per byte fetched; host_list_entry_s per rank of a list collective's
list, where the framework gathers and reduce-scatters through lists). All constants come
from the cluster preset; nothing here is specific to a strategy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from src.cluster import ClusterSpec
from src.costmodel.memory import element_bytes, grad_bytes
from src.costmodel.optimizer_step import step_bytes
from src.gemm_measurements import GemmCorrection
from src.mesh import Sharding
from src.models.cross_entropy import LOGIT_BYTES, eager_logit_bytes
from src.models.spec import Kernel, LayerSpec, ModelSpec, UnitSpec
from src.program import Work

BACKWARD_PHASES = ("bwd", "bwd_input", "bwd_weight")  # the phases that run a work's layers last to first

# FlashAttention's tile of query rows (kBlockM = 128 for head dimensions up to 128 on Ampere
# and Hopper: Dao-AILab/flash-attention csrc/flash_attn/src/flash_fwd_launch_template.h,
# run_mha_fwd_hdim64/128, and its backward's key tile). A causal mask leaves the tiles above
# the diagonal out: of n x n tiles, n (n + 1) / 2 run.
FLASH_TILE = 128


@dataclass(frozen=True)
class Launches:
    """Kernels one layer launches per micro-batch, by part (as LayerTimes); `cast_*`: the
    casts PyTorch AMP adds, by the part that runs them (a forward's, its backward's input
    and weight parts')."""

    fwd: int = 0
    bwd_input: int = 0
    bwd_weight: int = 0
    core_fwd: int = 0
    cast_fwd: int = 0
    cast_bwd_input: int = 0
    cast_bwd_weight: int = 0

    def __add__(self, other: "Launches") -> "Launches":
        return Launches(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Launches)))


@dataclass(frozen=True)
class LayerTimes:
    """Device seconds for one layer and one micro-batch: forward, input-gradient and
    weight-gradient parts of backward, and the forward of the attention core alone (what
    selective recomputation re-runs); `launches` counts their kernels."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    core_fwd: float = 0.0
    launches: Launches = Launches()

    def recompute(self, mode: str) -> float:
        return {"none": 0.0, "selective": self.core_fwd, "full": self.fwd}[mode]

    def recompute_launches(self, mode: str) -> tuple[int, int]:
        """(kernels, AMP casts) that recomputation re-runs in backward: the attention core
        casts nothing (its inputs are 16-bit), a whole forward its casts again."""
        launches = self.launches
        return {"none": (0, 0), "selective": (launches.core_fwd, 0), "full": (launches.fwd, launches.cast_fwd)}[mode]


def kernel_launches(kernel: Kernel, amp: bool = False) -> Launches:
    """The kernels one of the layer's kernels launches per micro-batch: its forward (an
    unfused operation's steps: Kernel.launches, and Kernel.backward_launches); in backward one
    per input gradient (two for a product of activations, one more where FlashAttention
    recomputes its scores) and one for the weight gradient. A parameter
    gradient's reduction kernel (Kernel.grad_reduction_bytes) is not counted: the host's
    per-kernel times were measured on blocks that run them and are per kernel of this count
    (src/models/grad_kernels.py).

    Under PyTorch AMP (`amp`) autocast adds casts, each a kernel of its own, where those
    blocks (16-bit weights) ran none: a weighted GEMM casts its fp32 weight, and its bias
    (a bias whose gradient is a reduction of its own: with one folded into a GEMM the bias
    is not known to exist and its cast is not counted), and backward casts each one's
    gradient back; an eager normalisation (one whose parameters' gradients are reduced by a
    kernel of their own) runs in fp32, and the GEMM after it casts its output to 16 bits;
    PyTorch's loss casts the logits up (each input cast's backward casts the gradient). The
    host prices each at host_forward_kernel_s, in either pass: on one H200's host a block
    under AMP ran 9.8 more kernels in its forward and 12 more in its backward than with bf16
    weights, each 28-35 us of host time (benchmarks/results/amp_host_h200.json)."""
    core = 1 if kernel.attention_core else 0
    input_casts = 1 if amp and (kernel.cross_entropy == "eager" or (kernel.norm_width and kernel.grad_reduction_bytes)) else 0
    if kernel.kind == "memory":
        n = kernel.launches
        return Launches(n, kernel.backward_launches or n, 0, core * n, input_casts, input_casts, 0)
    weight_casts = (2 if kernel.grad_reduction_bytes else 1) if amp and kernel.has_weight else 0
    inputs = (1 if kernel.has_weight else 2) + (1 if kernel.backward_recompute else 0)
    return Launches(1, inputs, 1 if kernel.has_weight else 0, core, input_casts + weight_casts, input_casts, weight_casts)


def _amp_stream(kernel: Kernel, forward: float, backward: float, reduction: float) -> tuple[float, float, float]:
    """A memory-bound kernel's bytes (forward, backward, its parameters' reduction) under
    PyTorch AMP, which keeps the residual stream in fp32: a residual add reads the stream (4
    bytes a value) and a block's 16-bit output (2) and writes the stream (4), 10 bytes where
    16-bit weights move 6 (a fused dropout-add-LayerNorm moves the same); an eager
    normalisation (one whose parameters' gradients are a kernel of their own) runs in fp32,
    twice its bytes, and the GEMM after it casts its output (read 4, write 2 a value: 6 more
    over its 4 forward; the cast's backward the other way, 6 over its 8). PyTorch's cross
    entropy runs in fp32 too, priced by src/models/cross_entropy.py's eager_logit_bytes. A
    fused framework's normalisation, and a fused or fp32 cross entropy, take and give their
    dtypes themselves, and an unfused operation's bytes are counted in the dtypes its steps
    run (src/models/elementwise.py)."""
    if kernel.launches > 1:
        return forward, backward, reduction
    if kernel.residual:
        return forward * 10 / 6, backward * 10 / 6, reduction
    if kernel.norm_width and kernel.grad_reduction_bytes:
        return 3.5 * forward, 2.75 * backward, 2.0 * reduction
    return forward, backward, reduction


def layer_launches(layer: LayerSpec, amp: bool = False) -> Launches:
    total = Launches()
    for kernel in layer.kernels:
        total += kernel_launches(kernel, amp)
    return total


class ComputeModel:
    """Prices kernels on one cluster at one precision, caching by (layer, shape)."""

    def __init__(self, cluster: ClusterSpec, precision: str):
        self.cluster = cluster
        self.peak = cluster.peak(precision)
        # Devices that share a host's cores (CPU workers) run their host work and their
        # bandwidth-bound kernels on their share of the cores, as their GEMMs (the peak).
        self.core_share = cluster.compute_share()
        self.hbm = cluster.memory_bandwidth * cluster.memory_efficiency * self.core_share
        # A GEMM streams its operands' tiles as a copy streams memory, faster than the
        # framework's elementwise and reduction kernels reach.
        self.stream = cluster.memory_bandwidth * (cluster.copy_efficiency or cluster.memory_efficiency) * self.core_share
        self.bytes_per_elem = element_bytes(precision)
        self.amp = cluster.amp and precision != "fp32"  # PyTorch AMP over 16-bit GEMMs (fp32 runs cast nothing)
        self.step = step_bytes(precision, cluster.amp)
        # A micro-batch's weight gradient added into the accumulated one in a pass of its own
        # (hook): the fresh gradient read, the buffer's element read and written; or cast to
        # fp32 first (cast): read, written as fp32, then added into an fp32 buffer.
        fp32 = element_bytes("fp32")
        hook = self.bytes_per_elem + 2.0 * grad_bytes(precision)
        self.accumulation_bytes = {"hook": hook, "cast": self.bytes_per_elem + fp32 + 3.0 * fp32}
        self._layer_cache: dict[tuple, LayerTimes] = {}
        self._work_cache: dict[tuple[int, Work], float] = {}
        self._models: dict[int, ModelSpec] = {}
        # A GEMM's time beyond its arithmetic: the per-kernel gap and a GEMM kernel's fixed time.
        self._gemm_overhead = cluster.kernel_overhead_s + cluster.gemm_fixed_s
        table = cluster.gemm_measurements
        self._measured = (
            GemmCorrection(table, self._curve, cluster.peak_flops[precision], self._gemm_overhead)
            if table is not None and precision in table.precisions
            else None
        )

    def _curve(self, m: float, n: float, k: float) -> float:
        half = self.cluster.gemm_half_dim
        sat = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
        return self.cluster.gemm_max_efficiency * sat

    def efficiency(self, m: float, n: float, k: float) -> float:
        return self._curve(m, n, k) if self._measured is None else self._measured.efficiency(m, n, k)

    def gemm_time(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return 0.0
        flops = 2.0 * m * n * k * batch
        # b GEMMs in one kernel launch b times the row tiles of one: they fill the device as
        # one GEMM of b x m rows does (the curve's m factor), each still k deep.
        compute = flops / (self.peak * self.efficiency(m * batch, n, k))
        traffic = self.bytes_per_elem * (m * k + k * n + m * n) * batch / self.stream
        return max(compute, traffic) + self._gemm_overhead

    def gemm_duration(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """A GEMM kernel's own duration, as a profiler records it: gemm_time less the gap
        between kernels, which no kernel's duration holds."""
        seconds = self.gemm_time(m, n, k, batch)
        return seconds - self.cluster.kernel_overhead_s if seconds > 0 else 0.0

    def _measured_attention(
        self, kernel: Kernel, m: float, n: float, k: float, batch: float, causal: bool, groups: float
    ) -> tuple[float, float] | None:
        """One product of a FlashAttention core of a measured version (QK^T: k the head
        dimension and n the keys; PV: the other way round) at that version's rate over that
        many keys, in its forward and in its backward (each scaled by how the kernel's grid of
        `groups` samples x heads packs on the SMs against the benchmark's:
        AttentionMeasurements.packing); None for any other kernel, or a head wider than the
        table measured."""
        if not kernel.flash_kernel:
            return None
        table = self.cluster.attention_measurements
        assert table is not None, "setup.validate refuses a measured version the preset has no table of"
        keys, head_dim = (n, k) if kernel.attention_scores else (k, n)
        if not table.covers(kernel.flash_kernel, causal, head_dim):
            return None
        flops = 2.0 * m * n * k * batch * (0.5 if causal else 1.0)
        seconds = flops / table.rate(kernel.flash_kernel, causal, head_dim, keys)
        forward, backward = table.packing(kernel.flash_kernel, causal, head_dim, keys, groups)
        return seconds * forward, seconds * backward

    def listed_gather_copies(self, nbytes: float, parts: int) -> float:
        """Device seconds of an all-gather into a list of `parts` tensors, concatenated
        (Collective.listed): the flat buffer's `nbytes` copied out part by part, then the parts
        copied into one tensor (each read and written), `parts` + 1 copy kernels; copies
        stream at a device copy's rate."""
        return 4.0 * nbytes / self.stream + (parts + 1) * self.cluster.kernel_overhead_s

    def memory_time(self, nbytes: float, kernels: int = 1) -> float:
        """`kernels` bandwidth-bound kernels moving `nbytes` among them."""
        if nbytes <= 0:
            return 0.0
        return nbytes / self.hbm + kernels * self.cluster.kernel_overhead_s

    def _eager_loss_bytes(self, kernel: Kernel, logits: float, sharding: Sharding) -> tuple[float, float]:
        """PyTorch's cross entropy over `logits` logits on one device, forward and backward:
        its rows are the vocabulary's columns this device holds (src/models/cross_entropy.py)."""
        row = kernel.vocab / sharding.gemm_divisors(kernel.tp_split)[1]
        forward, backward = eager_logit_bytes(row, self.cluster.shared_memory_per_block, self.amp)
        return logits * forward, logits * backward

    def _table_gradient(self, kernel: Kernel, sharding: Sharding) -> float:
        """A lookup table's dense gradient, once a micro-batch however many rows it looked up
        (Kernel.table, this device's share of the table): zero-filled in the weights' dtype,
        then added into the accumulated gradient (its read, the buffer's read and write);
        under PyTorch AMP an fp32 table's gradient, added into `.grad` (4 + 12 bytes)."""
        if not kernel.table:
            return 0.0
        per_entry = 16.0 if self.amp else self.bytes_per_elem + self.accumulation_bytes["hook"]
        return self.memory_time(per_entry * kernel.table / sharding.devices)

    def optimizer_time(self, params: float, shard: int = 1, grad_shard: int = 1) -> float:
        """One optimizer step over `params` parameters on one device, its optimizer state
        shared by `shard` ranks and its gradients by `grad_shard` (ZeRO-2/3's partitions):
        the passes src/costmodel/optimizer_step.py lists."""
        return self.memory_time(params / grad_shard * self.step.grads + params / shard * self.step.shard)

    def kernel_times(
        self,
        kernel: Kernel,
        rows: float,
        sharding: Sharding,
        contrastive_batch: int,
        causal: bool = False,
        grid_rows: float | None = None,
    ) -> LayerTimes:
        """Times of one kernel over `rows` samples' worth of input on one device; `causal`:
        FlashAttention under a causal mask, which skips the score tiles it hides; `grid_rows`:
        the samples one launch of an attention core holds where a pass is priced in parts
        that launch it once (Work.chunks; default `rows`)."""
        launches = kernel_launches(kernel, self.amp)
        if kernel.batch_transpose and (rows if grid_rows is None else grid_rows) <= 1:
            return LayerTimes(0.0, 0.0, 0.0)
        if kernel.kind == "memory":
            divisor = sharding.memory_divisor(kernel.tp_split)
            forward = kernel.bytes * rows / divisor
            backward, reduction = kernel.backward_moves * forward, kernel.grad_reduction_bytes * rows / divisor
            if kernel.cross_entropy == "eager":
                forward, backward = self._eager_loss_bytes(kernel, forward / LOGIT_BYTES["eager"][0], sharding)
            elif self.amp:
                forward, backward, reduction = _amp_stream(kernel, forward, backward, reduction)
            fwd = self.memory_time(forward, kernel.launches)
            bwd = self.memory_time(backward, kernel.backward_launches or kernel.launches)
            weight = self.memory_time(reduction) + self._table_gradient(kernel, sharding)
            return LayerTimes(fwd, bwd, weight, fwd if kernel.attention_core else 0.0, launches)
        m_div, n_div, k_div, batch_div = sharding.gemm_divisors(kernel.tp_split)
        m = kernel.m * rows / m_div
        n = (contrastive_batch if kernel.n_contrastive else kernel.n) / n_div
        k, batch = kernel.k / k_div, kernel.batch / batch_div
        fwd = self.gemm_time(m, n, k, batch)
        # dX = dY @ W^T is an (m x n)@(n x k) product; dW = X^T @ dY is (k x m)@(m x n).
        bwd_input = self.gemm_time(m, k, n, batch)
        bwd_weight = self.gemm_time(k, n, m, batch) if kernel.has_weight else 0.0
        # A bias's gradient reduces the output's gradient, which lies as the output does: a
        # row-parallel product's is whole on each rank (or sequence-split), a column-parallel
        # one's split by TP.
        out_split = "none" if kernel.tp_split == "k" else kernel.tp_split
        bwd_weight += self.memory_time(kernel.grad_reduction_bytes * rows / sharding.memory_divisor(out_split))
        groups = (rows if grid_rows is None else grid_rows) / m_div * batch
        measured = self._measured_attention(kernel, m, n, k, batch, causal and kernel.name.startswith("attn_"), groups)
        recomputed = None
        if measured is not None:
            # A measured version's rate holds for its forward and backward alike and counts a
            # causal core's FLOPs as half (src/attention_measurements.py); the backward kernel
            # recomputes the scores on its own grid.
            fwd, bwd_input = measured
            recomputed = bwd_input
        elif causal and kernel.attention_core and kernel.name.startswith("attn_"):
            # A self-attention core's products over the s x s scores (QK^T: n = s; PV: k = s).
            tiles = math.ceil((n if kernel.attention_scores else k) / FLASH_TILE)
            ran = (tiles + 1) / (2 * tiles)
            fwd, bwd_input = fwd * ran, bwd_input * ran
        if not kernel.has_weight:
            # A product of two activations (attention) has two input gradients.
            bwd_input *= 2.0
        if kernel.backward_recompute:
            # FlashAttention's backward first recomputes the scores it did not keep.
            bwd_input += fwd if recomputed is None else recomputed
        if kernel.has_weight and self.amp:
            # Autocast casts the fp32 weight where the forward uses it (read 4, write 2 bytes
            # an element); backward casts its gradient back (read 2, write 4) and adds it into
            # `.grad` (read 4 + 4, write 4): once a micro-batch, whatever its rows.
            weights = k * n * batch
            fwd += self.memory_time(6.0 * weights)
            bwd_weight += self.memory_time(18.0 * weights)
        elif kernel.accumulation:
            bwd_weight += self.memory_time(self.accumulation_bytes[kernel.accumulation] * k * n * batch)
        return LayerTimes(fwd, bwd_input, bwd_weight, fwd if kernel.attention_core else 0.0, launches)

    def layer_times(
        self,
        layer: LayerSpec,
        samples: float,
        sharding: Sharding = Sharding(),
        contrastive_batch: int = 1,
        kernels: tuple[int, int] | None = None,
        causal: bool = False,
        grid_rows: float | None = None,
    ) -> LayerTimes:
        """A layer's times; `causal`: its unit's self-attention is causally masked, which
        FlashAttention (a layer whose scores GEMM recomputes in backward) turns into tiles
        it skips; eager attention computes every score and masks them; `grid_rows`: as
        kernel_times'."""
        key = (layer, samples, sharding, contrastive_batch, kernels, causal, grid_rows)
        cached = self._layer_cache.get(key)
        if cached is not None:
            return cached
        selected = layer.kernels if kernels is None else layer.kernels[kernels[0] : kernels[1]]
        flash_causal = causal and any(kernel.backward_recompute for kernel in layer.kernels)
        fwd = bwd_in = bwd_w = core = 0.0
        launches = Launches()
        for kernel in selected:
            t = self.kernel_times(kernel, samples, sharding, contrastive_batch, flash_causal, grid_rows)
            fwd += t.fwd
            bwd_in += t.bwd_input
            bwd_w += t.bwd_weight
            core += t.core_fwd
            launches += t.launches
        times = LayerTimes(fwd, bwd_in, bwd_w, core, launches)
        self._layer_cache[key] = times
        return times

    def work_time(self, work: Work, model: ModelSpec) -> float:
        """Seconds of one Work item on one device."""
        key = (id(model), work)
        cached = self._work_cache.get(key)
        if cached is not None:
            return cached
        self._models[id(model)] = model  # keeps the id in the key from being reused
        seconds = self._price(work, model.unit(work.unit), model)
        self._work_cache[key] = seconds
        return seconds

    def outlasting(self, transfer_s: float, gemms: tuple[Work, ...], model: ModelSpec) -> float:
        """Device seconds by which a transfer split evenly beside GEMM chunks (StepCCL's pair,
        Collective.beside) outlasts them: what each share leaves after its GEMM's chunk."""
        share = transfer_s / len(gemms)
        return sum(max(0.0, share - self.work_streams(gemm, model)[0]) for gemm in gemms)

    def work_streams(self, work: Work, model: ModelSpec) -> tuple[float, float]:
        """A Work item's device seconds and its host's, each from the work's start: the
        work takes at least the longer of the two (exactly that for a single layer), however
        its layers' kernels interleave. Where the host is the device (CPU workers) the
        first is the whole time."""
        if not self.cluster.host_async:
            return self.work_time(work, model), 0.0
        serial, layers = self._streams(work, model.unit(work.unit), model)
        return serial + sum(device for device, _ in layers), serial + sum(host for _, host in layers)

    def _price(self, work: Work, unit: UnitSpec, model: ModelSpec) -> float:
        serial, layers = self._streams(work, unit, model)
        if not self.cluster.host_async:
            # CPU workers run what they issue, on the share of the cores that their
            # arithmetic gets (the host figures are one worker's alone).
            return serial + sum(device + host / self.core_share for device, host in layers)
        issued = finished = 0.0  # when the host has issued the layers so far, and the device run them
        for device, host in layers:
            # The host issues a layer's kernels at its pace, the device runs each once it is
            # issued and the kernels before it have run: a layer takes the longer of its
            # device and host times from when both are free, and nothing inside a work
            # blocks the host, so it goes ahead while the device runs a device-bound layer
            # and the host-bound layers after it start their kernels that much sooner.
            finished = max(finished + device, issued + max(device, host))
            issued += host
        return serial + finished

    def _streams(self, work: Work, unit: UnitSpec, model: ModelSpec) -> tuple[float, list[tuple[float, float]]]:
        """The device seconds that precede a work's layers (a blocking fetch, list copies),
        then each layer's device and host seconds in the order the work runs them (a
        backward last to first)."""
        start, end = work.layers
        layers = unit.layers[start:end]
        if work.phase == "optimizer":
            params = unit.trainable_params(start, end) / work.sharding.devices
            return self.optimizer_time(params, work.shard, work.grad_shard) * work.load, []
        rows = work.samples * work.fraction
        causal = not unit.arch.per_image  # a unit that reads or makes images attends both ways
        # The framework's ZeRO-3 fetches (its module hooks) run on the host before the first
        # layer, whatever the micro-batch's load; after a blocking gather nothing of the
        # work is queued yet, so a GPU waits for them (otherwise they run while earlier
        # kernels do).
        fetch = work.fetches * self.cluster.host_fetch_s + work.fetched * self.bytes_per_elem * self.cluster.host_fetch_byte_s
        # A list collective's list is built and copied entry by entry on the host: a fetch's
        # before its gather, waited for with it; a gradient's reduce-scatter's after the
        # work's kernels are issued, while they run.
        fetch += work.fetches * work.fetch_copies * self.cluster.host_list_entry_s
        scatter = work.scatters * work.scatter_copies * self.cluster.host_list_entry_s
        waited = fetch if work.fetch_blocking and self.cluster.host_async else 0.0
        serial = waited + self._fetch_copies(work) + self._scatter_copies(work)
        order = range(len(layers) - 1, -1, -1) if work.phase in BACKWARD_PHASES else range(len(layers))
        streams = []
        for position, index in enumerate(order):
            layer = layers[index]
            kernels = work.kernels if (work.kernels is not None and index == 0) else None
            # A pass priced in chunks launches its attention cores once, on all the chunks' rows.
            grid_rows = rows * work.chunks if work.chunks > 1 else None
            t = self.layer_times(layer, rows, work.sharding, work.contrastive_batch, kernels, causal, grid_rows)
            device, forward_kernels, backward_kernels, casts = self._phase(work, t, layer.forward_only, model, unit, start + index)
            if self.cluster.host_launch == "graphed":  # one graph launch per layer and pass
                forward_kernels, backward_kernels, casts = min(forward_kernels, 1), min(backward_kernels, 1), 0
            forward_rate, backward_rate = self.cluster.host_forward_kernel_s, self.cluster.host_backward_kernel_s
            host = (forward_kernels + casts) * forward_rate + backward_kernels * backward_rate
            if work.chunks > 1:
                host = self._chunk_host(work, layer, host)
            device, host = device * work.load, host * work.load + (fetch - waited if position == 0 else 0.0)
            host += scatter if position == len(layers) - 1 else 0.0
            streams.append((device, host))
        return serial, streams

    def _chunk_host(self, work: Work, layer: LayerSpec, host: float) -> float:
        """A chunk's share of a layer's host seconds (Work.chunks): the pass's kernels are
        issued once, but each GEMM paired with a TP collective launches once a chunk: one
        per collective the pass runs, two under sequence parallelism (the all-gather's and
        the reduce-scatter's GEMMs, priced as one all-reduce). A layer replayed from a CUDA
        graph is one launch, shared."""
        if self.cluster.host_launch == "graphed" or not layer.tp_allreduces:
            return host / work.chunks
        backward = work.phase in ("bwd", "bwd_input")
        pairs = layer.tp_collectives(backward, work.recompute) * (2 if work.sharding.sequence_parallel else 1)
        split = pairs * (self.cluster.host_backward_kernel_s if backward else self.cluster.host_forward_kernel_s)
        return max(host - split, 0.0) / work.chunks + split

    def _fetch_copies(self, work: Work) -> float:
        """Device seconds of fetches gathered through a list of partitions: the buffer's
        zero fill, then the collective's flat buffer copied out partition by partition
        (read and written), each copy a kernel; before the work's own kernels."""
        if not work.fetch_copies or not work.fetches:
            return 0.0
        moved = 3.0 * work.fetched * self.bytes_per_elem
        return moved / self.hbm + work.fetches * (1 + work.fetch_copies) * self.cluster.kernel_overhead_s

    def _scatter_copies(self, work: Work) -> float:
        """Device seconds of reduce-scatters through a list of partitions: each list copied
        into the collective's flat buffer partition by partition (read and written), each
        copy a kernel."""
        if not work.scatter_copies or not work.scatters:
            return 0.0
        moved = 2.0 * work.scattered * self.bytes_per_elem
        return moved / self.hbm + work.scatters * work.scatter_copies * self.cluster.kernel_overhead_s

    @staticmethod
    def _phase(
        work: Work, t: LayerTimes, forward_only: bool, model: ModelSpec, unit: UnitSpec, layer: int
    ) -> tuple[float, int, int, int]:
        """(device seconds, forward kernels, backward kernels, AMP casts) of one layer in the
        work's phase."""
        n = t.launches
        if forward_only:
            return (t.fwd, n.fwd, 0, n.cast_fwd) if work.phase in ("fwd", "interaction") else (0.0, 0, 0, 0)
        needs_input_grad = model.needs_input_grad(work.unit, layer)
        trains_weights = unit.trains(unit.layers[layer])
        bwd_input, input_kernels, input_casts = (t.bwd_input, n.bwd_input, n.cast_bwd_input) if needs_input_grad else (0.0, 0, 0)
        bwd_weight, weight_kernels, weight_casts = (t.bwd_weight, n.bwd_weight, n.cast_bwd_weight) if trains_weights else (0.0, 0, 0)
        # A layer with no backward at all (a frozen ViT under a trained projector) keeps
        # nothing to recompute.
        backward = needs_input_grad or trains_weights
        mode = unit.layers[layer].recompute_mode(work.recompute)
        recompute = t.recompute(mode) if backward else 0.0
        recompute_kernels, recompute_casts = t.recompute_launches(mode) if backward else (0, 0)
        if work.phase == "fwd":
            return t.fwd, n.fwd, 0, n.cast_fwd
        if work.phase == "bwd":
            casts = recompute_casts + input_casts + weight_casts
            return bwd_input + bwd_weight + recompute, recompute_kernels, input_kernels + weight_kernels, casts
        if work.phase == "bwd_input":
            return bwd_input + recompute, recompute_kernels, input_kernels, recompute_casts + input_casts
        if work.phase == "bwd_weight":
            return bwd_weight, 0, weight_kernels, weight_casts
        if work.phase == "interaction":
            return t.fwd + bwd_input + bwd_weight, n.fwd, input_kernels + weight_kernels, n.cast_fwd + input_casts + weight_casts
        return 0.0, 0, 0, 0
