"""Where a model trains: devices, nodes, links, and the cost model's per-hardware constants.

Ranks are numbered node-major: rank r lives on node r // devices_per_node. Every number
comes from a preset in conf/cluster/, which says where it comes from; nothing here has a
default for an unknown device.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from src.bounds import WHAT_IF, check_cluster
from src.errors import ConfigError, expect_mapping, reject_unknown
from src.attention_measurements import AttentionMeasurements, measured_attention
from src.gemm_measurements import GemmMeasurements, measured_gemms
from src.measured_files import measured_file, read_yaml

GIB = 1024**3
MIB = 1024**2


def gib(nbytes: float) -> str:
    """Bytes as GiB in a message: one decimal from 1 GiB up, three significant digits
    below (a tiny model's 5 MiB is 0.00488 GiB, not 0.0)."""
    value = nbytes / GIB
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.3g}"


# Measured collective tables a preset names (`collective_measurements`), one file per library and machine.
MEASURED_DIR = Path(__file__).resolve().parent.parent / "conf" / "cluster" / "measured"
# A library's size correction is indexed by log2(bytes / 64): powers of two from 64 B.
CORRECTION_BASE_BYTES = 64


# The attention kernels a run's software may have (model.attention; a preset states its era's):
# FlashAttention priced as its GEMMs on the device's curve (flash), or as a named version
# measured on the device (flash1, flash2: the preset's attention_measurements), or eager.
ATTENTION_MODES = ("flash", "flash1", "flash2", "eager")
MEASURED_ATTENTION = ("flash1", "flash2")
# How the software reduces biases' and normalisations' gradients over the tokens
# (model.param_grad_kernels; a preset states its era's): kernels of their own, or folded into
# the weight-gradient GEMM's epilogue and the normalisation's backward kernel.
PARAM_GRAD_KERNELS = ("separate", "fused")
# How the software computes the loss over the vocabulary's logits (model.cross_entropy; a preset
# states its era's): PyTorch's cross entropy, Megatron-LM's vocab-parallel one on an fp32 copy, or
# one fused kernel each way (src/models/cross_entropy.py).
CROSS_ENTROPY_MODES = ("eager", "fp32", "fused")
# How the software adds each micro-batch's weight gradients into the step's accumulated ones
# (model.grad_accumulation; a preset states its era's): a pass of its own after the weight
# gradient's GEMM, or inside that GEMM (src/models/grad_accumulation.py).
GRAD_ACCUMULATIONS = ("hook", "fused", "cast")
# How a framework issues a layer's kernels (cluster.host_launch): one by one, or a layer's
# forward and backward each replayed from a captured CUDA graph.
HOST_LAUNCHES = ("eager", "graphed")


@dataclass(frozen=True)
class Protocol:
    """One protocol of a collective algorithm (ring or tree) as the library's own tuning
    model prices it (NCCL, RCCL: src/graph/tuning.cc): a call costs `base_s`, each step
    over the node's links `intra_step_s` (at least `net_step_floor_s` once the ring spans
    nodes: the host posts every step to the network) and each step over the network
    `inter_step_s`; its data moves at `share` of the link's achieved bus bandwidth, at most
    `cap` bytes/s (`net_cap` once it spans nodes; 0: no cap), times `size_correction[log2(bytes / 64)]` where the library
    corrects its model by message size. `allreduce_plateau` multiplies the latency of a
    ring all-reduce spanning nodes (NCCL's "plateau effect of ring")."""

    base_s: float = 0.0
    intra_step_s: float = 0.0
    inter_step_s: float = 0.0
    net_step_floor_s: float = 0.0
    share: float = 1.0
    cap: float = 0.0
    net_cap: float = 0.0
    size_correction: tuple[float, ...] = ()
    allreduce_plateau: float = 1.0

    def bandwidth(self, bus: float, nbytes: float, spans_nodes: bool) -> float:
        rate = bus * self.share
        cap = self.net_cap if spans_nodes and self.net_cap > 0 else self.cap
        if cap > 0:
            rate = min(rate, cap)
        if self.size_correction:
            index = max(0, int(math.log2(max(nbytes, 1.0) / CORRECTION_BASE_BYTES)))
            if index < len(self.size_correction):
                rate *= self.size_correction[index]
        return rate


@dataclass(frozen=True)
class MeasuredCollective:
    """One collective's measured time by group size and buffer size: `seconds[i][j]` for
    `groups[i]` consecutive ranks (whole nodes of the machine) on a buffer of `sizes[j]`
    bytes (an all-gather's output, a reduce-scatter's input: what CommModel is given);
    None where the source has no usable time. `source` says which runs each came from."""

    groups: tuple[int, ...]
    sizes: tuple[float, ...]
    seconds: tuple[tuple[float | None, ...], ...]
    source: str


@dataclass(frozen=True)
class PlacementBandwidth:
    """The bus bandwidth (bytes/s) a collective reaches over `size` devices of one node
    whose ranks are `stride` apart (a grid axis inside a node, its inner axes' product
    the stride)."""

    stride: int
    size: int
    bus_bandwidth: float


@dataclass(frozen=True)
class CollectiveMeasurements:
    """A collective library's measurements on one machine (conf/cluster/measured/<name>.yaml):
    per op its times by group and buffer size, and the bus bandwidth of groups inside a node
    by placement. CommModel interpolates them and takes the library's model elsewhere."""

    name: str
    library: str
    collectives: dict[str, MeasuredCollective]
    placements: tuple[PlacementBandwidth, ...] = ()
    placement_source: str = ""


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster preset. Bandwidths are bytes/s in one direction; latencies seconds.

    intra_bandwidth: per device, over NVLink/NVSwitch/Infinity Fabric.
    inter_bandwidth: per node, the sum of its NICs.
    intra_latency, inter_latency: what one point-to-point message pays inside a node and
      across nodes (and one step of a collective, for a spec built by hand without
      protocol tables).
    ring_protocols, tree_protocols: the collective library's algorithms, each a table of
      its protocols (Protocol); a collective takes the fastest algorithm and protocol for
      its size, as NCCL does. A preset states both (an empty tree table: the library has
      no tree); a spec built by hand leaves them None: one protocol paying the link
      latencies per step, ring and tree alike.
    p2p_bandwidth: achieved bandwidth of one send/receive between two devices of a node
      (a library's point-to-point transfers use fewer channels than its collectives); 0:
      the link's. Across nodes a transfer leaves through one of the node's `nics` NICs.
    gemm_max_efficiency, gemm_half_dim: achieved fraction of peak for a GEMM is
      max_efficiency * prod_d d/(d + half_dim) over its m, n, k: large GEMMs approach the
      maximum, thin ones (small per-device batch, over-partitioned TP) fall off.
    memory_efficiency: achieved fraction of HBM bandwidth for the framework's bandwidth-bound
      kernels (elementwise, normalisation, loss, optimizer): what they reach in a training
      step, below what a plain copy streams.
    shared_memory_per_block: the on-chip memory one thread block may take without opting in
      (CUDA's and HIP's sharedMemPerBlock, bytes), which decides whether PyTorch's softmax
      keeps a row on chip or reads it from memory again (src/models/cross_entropy.py); 0:
      a CPU's, whose caches hold a row.
    copy_efficiency: achieved fraction of HBM bandwidth of a large device copy: the rate a
      GEMM streams its operands at where its traffic bounds it; 0 (a spec built by hand):
      memory_efficiency.
    intra_efficiency, inter_efficiency: achieved fraction of the link bandwidth by
      collectives and transfers inside a node and across nodes.
    kernel_overhead_s: the device's fixed cost per kernel (its gap between kernels when the
      host keeps ahead; on CPU workers, whose host is the device, 0).
    gemm_fixed_s: a GEMM kernel's fixed device time beyond that gap, whatever its size (its
      tiles' operands in flight before the first multiply, the epilogue's stores after the
      last): what keeps a small GEMM from running in proportion to its FLOPs.
    host_forward_kernel_s, host_backward_kernel_s: the framework's host time per kernel of a
      layer's forward and of its backward (module calls, dispatcher, autograd).
    host_launch: how the framework issues a layer's kernels: eager (each kernel at the
      per-kernel host times above) or graphed (a GPU framework that captures each layer's
      forward and backward in a CUDA graph, as Megatron-LM's and Transformer Engine's
      CUDA-graph options do: the host issues one launch per layer and pass, priced at one
      kernel's host time; the device's per-kernel gap is unchanged).
    host_fetch_s, host_fetch_byte_s: the framework's host time per ZeRO-3 module fetch
      (DeepSpeed's module hooks: fetch, release, gradient partitioning, their bookkeeping)
      and per byte fetched (the gathered buffers' allocation and copies), beside the
      collectives themselves; host time like the per-kernel figures.
    host_list_entry_s: the host's time per rank of the group for a collective on a list of
      tensors (ZeRO-3 before DeepSpeed 0.6.0 over PyTorch's list all_gather and
      reduce_scatter): the framework's loop building the list and c10d's copy between it
      and the collective's flat buffer, per entry.
    amp: the framework trains under PyTorch's automatic mixed precision: the model keeps
      fp32 weights, autocast casts each one to the training precision where a GEMM uses it
      (every micro-batch's forward, again in a recomputed one), and its gradient comes back
      to fp32 and is added into `.grad`; the residual stream, and an eager normalisation,
      stay fp32 (the real backend, PyTorch Lightning, Hugging Face's Trainer); false: the
      weights are kept in the training precision and the optimizer holds the fp32 master
      copy (Megatron-LM, DeepSpeed), cast once a step. Nothing under fp32.
    host_async: the host queues work ahead of the device (GPUs): each layer of a Work item
      takes the longer of its device and host times, and the host issues ahead while the
      device runs a device-bound layer; false (CPU workers): they add up.
    attention: the attention kernel of the testbed's software (flash | flash1 | flash2 |
      eager), the default of model.attention (src/models/attention.py).
    param_grad_kernels: how the testbed's software reduces biases' and normalisations'
      gradients (separate | fused), the default of model.param_grad_kernels
      (src/models/grad_kernels.py).
    cross_entropy: how the testbed's software computes the loss over the logits (eager |
      fp32 | fused), the default of model.cross_entropy (src/models/cross_entropy.py).
    grad_accumulation: how the testbed's software adds a micro-batch's weight gradients into
      the accumulated ones (hook | fused | cast), the default of model.grad_accumulation
      (src/models/grad_accumulation.py).
    collective_sm_fraction, p2p_sm_fraction: fraction of the device's SMs a collective's
      (resp. a send's or receive's) kernels hold while they run: NCCL runs one CTA per
      channel, each on an SM of its own, so compute overlapping them runs on the rest.
    reserved_memory_gib: memory a framework cannot use (context, allocator, workspace).
    collective_efficiency: the achieved fraction of the ring formula's data rate, per
      collective op, where the communication library falls short of it ({op: fraction});
      gloo's reduce-scatter is an order of magnitude slower than its all-reduce on the same
      bytes. Empty: the library achieves the formula (NCCL).
    oversubscription: a device's compute rate when k devices of a node compute at once,
      relative to one alone ({k: fraction}); for CPU workers sharing a host's cores (the
      `local` preset). Empty: devices do not share compute (GPUs). peak() applies it.
    core_handover_s: where devices share cores, how long a device must wait (blocked on a
      peer) before the others take its core over; a shorter wait keeps it (src/sim/cores.py).
      Absent (0): every wait hands the core over at once; devices that share no cores have
      none to hand over.
    sync_skew_s, sync_skew_build_s: where devices share cores, how far apart they reach a
      collective over all of a node's devices. The scheduler time-slices them, so one that
      has computed for t seconds since they last synchronized may lag the others; the lag
      is bounded (a fair scheduler gives each its share within a period), so the expected
      wait for the slowest is sync_skew_s · (1 - exp(-t / sync_skew_build_s)). The engine
      scales it to a group by the expected maximum of its members' lags
      (src/costmodel/comm.py). Absent (0): devices reach a collective when the model says.
    collective_measurements: the testbed's collective library as measured on it, by group
      size, buffer size and placement (conf/cluster/measured/); CommModel takes them over
      its model where they cover a collective, the model elsewhere. Empty: none public.
    gemm_measurements: the device's GEMM library as measured on it, by shape
      (conf/cluster/measured/gemm/): the compute model corrects the GEMM curve by them
      (src/gemm_measurements.py) at the precisions they were measured at. None: the curve.
    attention_measurements: FlashAttention's kernels as measured on the device, by version,
      mask, head dimension and sequence (conf/cluster/measured/attention/): the compute model
      prices a core of a measured version by them (src/attention_measurements.py). None: no
      version measured (model.attention=flash1|flash2 is refused).
    """

    name: str
    device: str
    nodes: int
    devices_per_node: int
    peak_flops: dict[str, float]
    memory_gib: float
    memory_bandwidth: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    gemm_max_efficiency: float
    gemm_half_dim: float
    memory_efficiency: float
    intra_efficiency: float
    inter_efficiency: float
    kernel_overhead_s: float
    reserved_memory_gib: float
    default_precision: str
    # Every preset states these (cluster_from_config); a spec built by hand takes no SMs.
    collective_sm_fraction: float = 0.0
    p2p_sm_fraction: float = 0.0
    gemm_fixed_s: float = 0.0
    copy_efficiency: float = 0.0
    shared_memory_per_block: float = 0.0
    oversubscription: dict[int, float] = field(default_factory=dict)
    core_handover_s: float = 0.0
    sync_skew_s: float = 0.0
    sync_skew_build_s: float = 0.0
    collective_efficiency: dict[str, float] = field(default_factory=dict)
    ring_protocols: dict[str, Protocol] | None = None
    tree_protocols: dict[str, Protocol] | None = None
    p2p_bandwidth: float = 0.0
    nics: int = 1
    host_forward_kernel_s: float = 0.0
    host_backward_kernel_s: float = 0.0
    host_fetch_s: float = 0.0
    host_fetch_byte_s: float = 0.0
    host_list_entry_s: float = 0.0
    host_async: bool = True
    host_launch: str = "eager"
    amp: bool = False
    attention: str = "eager"
    param_grad_kernels: str = "separate"
    cross_entropy: str = "eager"
    grad_accumulation: str = "fused"
    collective_measurements: tuple[CollectiveMeasurements, ...] = ()
    gemm_measurements: GemmMeasurements | None = None
    attention_measurements: AttentionMeasurements | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory_bytes(self) -> float:
        return (self.memory_gib - self.reserved_memory_gib) * GIB

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ConfigError(
                f"device {self.device} of cluster {self.name} has no {precision} peak; "
                f"train.precision must be one of {sorted(self.peak_flops)}"
            )
        return self.peak_flops[precision] * self.compute_share()

    def compute_share(self, computing: int | None = None) -> float:
        """Each device's share of its rate alone while `computing` devices of a node (all
        of them unless given) compute at once; past the largest measured count the cores
        split further in proportion."""
        if not self.oversubscription:
            return 1.0
        k = self.devices_per_node if computing is None else computing
        if k in self.oversubscription:
            return self.oversubscription[k]
        measured = max(self.oversubscription)
        if k > measured:
            return self.oversubscription[measured] * measured / k
        return self.oversubscription[max(c for c in self.oversubscription if c <= k)]

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        nodes = {self.node_of(r) for r in ranks}
        return len(nodes) > 1

    def nodes_spanned(self, ranks: Sequence[int]) -> int:
        """How many nodes hold a member of `ranks` (distinct ranks; ranks are node-major,
        so a contiguous block is counted without a set)."""
        low, high = min(ranks), max(ranks)
        if len(ranks) == high - low + 1:
            return self.node_of(high) - self.node_of(low) + 1
        return len({self.node_of(r) for r in ranks})

    def bandwidth(self, ranks: Sequence[int], sharing: int = 1) -> float:
        """Achieved bandwidth of a ring over `ranks`: NVLink inside a node; across nodes
        the node's NICs split among the `sharing` rings crossing them at once."""
        return self.link_bandwidth(self.spans_nodes(ranks), sharing)

    def latency(self, ranks: Sequence[int]) -> float:
        return self.link_latency(self.spans_nodes(ranks))

    def link_bandwidth(self, crosses_nodes: bool, sharing: int = 1) -> float:
        if not crosses_nodes:
            return self.intra_bandwidth * self.intra_efficiency
        per_ring = self.inter_bandwidth * self.inter_efficiency / max(1, sharing)
        return min(self.intra_bandwidth * self.intra_efficiency, per_ring)

    def p2p_link_bandwidth(self, crosses_nodes: bool, sharing: int = 1) -> float:
        """One send/receive: inside a node at the library's point-to-point rate; across
        nodes through one NIC, and no more than its share of the node's NICs when
        `sharing` transfers leave the node at once."""
        inside = self.p2p_bandwidth or self.intra_bandwidth * self.intra_efficiency
        if not crosses_nodes:
            return inside
        one_nic = self.inter_bandwidth * self.inter_efficiency / self.nics
        return min(inside, one_nic, self.inter_bandwidth * self.inter_efficiency / max(1, sharing))

    def ring_table(self) -> Mapping[str, Protocol]:
        if self.ring_protocols is None:
            return {"link": Protocol(intra_step_s=self.intra_latency, inter_step_s=self.inter_latency)}
        return self.ring_protocols

    def tree_table(self) -> Mapping[str, Protocol]:
        if self.tree_protocols is None:
            return self.ring_table()
        return self.tree_protocols

    def link_latency(self, crosses_nodes: bool) -> float:
        return self.inter_latency if crosses_nodes else self.intra_latency


FLOAT_FIELDS = (
    "memory_gib",
    "memory_bandwidth",
    "intra_bandwidth",
    "intra_latency",
    "inter_bandwidth",
    "inter_latency",
    "gemm_max_efficiency",
    "gemm_half_dim",
    "memory_efficiency",
    "copy_efficiency",
    "intra_efficiency",
    "inter_efficiency",
    "kernel_overhead_s",
    "gemm_fixed_s",
    "reserved_memory_gib",
    "collective_sm_fraction",
    "p2p_sm_fraction",
    "p2p_bandwidth",
    "host_forward_kernel_s",
    "host_backward_kernel_s",
    "host_fetch_s",
    "host_fetch_byte_s",
    "host_list_entry_s",
    "shared_memory_per_block",
)
# May be zero: a latency or overhead too small to state, or no SMs taken by communication.
MAY_BE_ZERO = (
    "intra_latency",
    "inter_latency",
    "kernel_overhead_s",
    "gemm_fixed_s",
    "reserved_memory_gib",
    "collective_sm_fraction",
    "p2p_sm_fraction",
    "p2p_bandwidth",
    "host_forward_kernel_s",
    "host_backward_kernel_s",
    "host_fetch_s",
    "host_fetch_byte_s",
    "host_list_entry_s",
    "shared_memory_per_block",
)


# The constants a preset must say where it took from: every figure of the cost model.
SOURCED = (
    "devices_per_node",
    "peak_flops",
    *FLOAT_FIELDS,
    "host_async",
    "host_launch",
    "amp",
    "attention",
    "param_grad_kernels",
    "cross_entropy",
    "grad_accumulation",
    "nics",
    "collectives",
    "collective_efficiency",
    "oversubscription",
    "core_handover_s",
    "sync_skew_s",
    "sync_skew_build_s",
    "collective_measurements",
    "gemm_measurements",
    "attention_measurements",
)


def unsourced(cfg: Mapping[str, Any]) -> list[str]:
    """The constants of a preset that no `sources` entry names (an entry's key lists the
    constants it covers, separated by commas)."""
    covered = {name.strip() for key in dict(cfg.get("sources") or {}) for name in str(key).split(",")}
    return [name for name in SOURCED if name not in covered]


def _number(value: Any, key: str, cluster: str) -> float:
    if value is None:
        raise ConfigError(f"cluster {cluster} has no {key}: every preset must state it")
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be a number, got {value!r} (cluster {cluster})")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a number, got {value!r} (cluster {cluster})") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key} must be a finite number, got {value!r} (cluster {cluster})")
    return number


def _mode(key: str, value: Any, modes: tuple[str, ...], cluster: str) -> str:
    if value not in modes:
        raise ConfigError(f"cluster.{key} must be one of {list(modes)}, got {value!r} (cluster {cluster})")
    return str(value)


def _host_launch(value: Any, host_async: bool, cluster: str) -> str:
    if value is None:
        raise ConfigError(f"cluster {cluster} has no host_launch: every preset must state it ({' or '.join(HOST_LAUNCHES)})")
    if value not in HOST_LAUNCHES:
        raise ConfigError(f"cluster.host_launch must be one of {list(HOST_LAUNCHES)}, got {value!r} (cluster {cluster})")
    if value == "graphed" and not host_async:
        raise ConfigError(
            f"cluster.host_launch=graphed replays CUDA graphs, which a host that runs its own kernels (host_async false) "
            f"has none of (cluster {cluster})"
        )
    return str(value)


def _flag(value: Any, key: str, cluster: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r} (cluster {cluster})")
    return value


def cluster_from_config(cfg: Mapping[str, Any]) -> ClusterSpec:
    """Build and validate a ClusterSpec from the `cluster` config group."""
    name = cfg.get("name", "?")
    stated = [f.name for f in dataclasses.fields(ClusterSpec) if f.name not in ("ring_protocols", "tree_protocols")]
    reject_unknown(cfg, stated + ["devices", "profile", "profile_cpu", "collectives", WHAT_IF], "cluster key(s)")
    for key, example in (("peak_flops", "peak_flops.bf16=312e12"), ("sources", "sources.memory_gib='datasheet'")):
        expect_mapping(cfg.get(key) or {}, f"cluster.{key}", f"cluster.{example}")
    cfg, profile_note = with_host_profile(cfg)
    for key in ("nodes", "devices_per_node", "nics"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"cluster.{key} must be a positive integer, got {value!r} (cluster {name})")
    for key in FLOAT_FIELDS:
        value = _number(cfg.get(key), f"cluster.{key}", name)
        if value < 0 or (value == 0 and key not in MAY_BE_ZERO):
            raise ConfigError(f"cluster.{key} must be positive, got {value} (cluster {name})")
    peaks = {str(k): _number(v, f"cluster.peak_flops.{k}", name) for k, v in dict(cfg.get("peak_flops") or {}).items()}
    if not peaks or any(v <= 0 for v in peaks.values()):
        raise ConfigError(f"cluster {name} must list positive peak_flops per precision, got {peaks}")
    devices = cfg.get("devices")
    total = cfg["nodes"] * cfg["devices_per_node"]
    if devices is not None and devices != total:
        raise ConfigError(
            f"cluster.devices={devices} but nodes x devices_per_node = {cfg['nodes']} x {cfg['devices_per_node']} = {total}"
        )
    for key in ("gemm_max_efficiency", "memory_efficiency", "copy_efficiency", "intra_efficiency", "inter_efficiency"):
        if float(cfg[key]) > 1:
            raise ConfigError(f"cluster.{key} is a fraction of peak, got {cfg[key]} (cluster {name})")
    for key in ("collective_sm_fraction", "p2p_sm_fraction"):
        if float(cfg[key]) >= 1:
            raise ConfigError(
                f"cluster.{key} is the fraction of a device's SMs that communication holds, below 1; got {cfg[key]} (cluster {name})"
            )
    if cfg.get("default_precision") not in peaks:
        raise ConfigError(f"cluster {name}: default_precision {cfg.get('default_precision')!r} has no peak in {sorted(peaks)}")
    if float(cfg["reserved_memory_gib"]) >= float(cfg["memory_gib"]):
        raise ConfigError(f"cluster {name}: reserved_memory_gib {cfg['reserved_memory_gib']} >= memory_gib {cfg['memory_gib']}")
    ring, tree = _collectives(cfg.get("collectives"), name)
    sources = {str(k): str(v) for k, v in dict(cfg.get("sources") or {}).items()}
    if profile_note:
        sources["profile"] = profile_note
    spec = ClusterSpec(
        name=str(name),
        device=str(cfg.get("device")),
        nodes=int(cfg["nodes"]),
        devices_per_node=int(cfg["devices_per_node"]),
        peak_flops=peaks,
        default_precision=str(cfg["default_precision"]),
        sources=sources,
        oversubscription=_oversubscription(cfg.get("oversubscription"), name),
        core_handover_s=_at_least_zero(cfg.get("core_handover_s"), "core_handover_s", "a wait in seconds", name),
        sync_skew_s=_at_least_zero(cfg.get("sync_skew_s"), "sync_skew_s", "a wait in seconds", name),
        sync_skew_build_s=_at_least_zero(cfg.get("sync_skew_build_s"), "sync_skew_build_s", "a time in seconds", name),
        collective_efficiency=_collective_efficiency(cfg.get("collective_efficiency"), name),
        ring_protocols=ring,
        tree_protocols=tree,
        nics=int(cfg["nics"]),
        host_async=_flag(cfg.get("host_async"), "cluster.host_async", name),
        host_launch=_host_launch(cfg.get("host_launch"), bool(cfg.get("host_async")), name),
        amp=_flag(cfg.get("amp", False), "cluster.amp", name),
        attention=_mode("attention", cfg.get("attention"), ATTENTION_MODES, name),
        param_grad_kernels=_mode("param_grad_kernels", cfg.get("param_grad_kernels"), PARAM_GRAD_KERNELS, name),
        cross_entropy=_mode("cross_entropy", cfg.get("cross_entropy"), CROSS_ENTROPY_MODES, name),
        grad_accumulation=_mode("grad_accumulation", cfg.get("grad_accumulation"), GRAD_ACCUMULATIONS, name),
        collective_measurements=tuple(measured_collectives(str(m), name) for m in _names(cfg.get("collective_measurements"), name)),
        gemm_measurements=_gemm_measurements(cfg.get("gemm_measurements"), name),
        attention_measurements=_attention_measurements(cfg.get("attention_measurements"), name),
        **{key: float(cfg[key]) for key in FLOAT_FIELDS},
    )
    check_cluster(spec, cfg.get(WHAT_IF, False))
    return spec


def _oversubscription(table: Any, cluster: str) -> dict[int, float]:
    if table is None:
        return {}
    if not isinstance(table, Mapping):
        raise ConfigError(
            f"cluster.oversubscription maps a count of devices computing at once to their rate "
            f"relative to one alone, got {table!r} (cluster {cluster})"
        )
    out = {}
    for k, v in table.items():
        count, share = int(k), _number(v, f"cluster.oversubscription.{k}", cluster)
        if count <= 0 or not 0 < share <= 1:
            raise ConfigError(f"cluster.oversubscription.{k}={v}: counts are positive and rates in (0, 1] (cluster {cluster})")
        out[count] = share
    return out


def _at_least_zero(value: Any, key: str, meaning: str, cluster: str) -> float:
    """An optional figure (absent: 0) that may not be negative."""
    if value is None:
        return 0.0
    number = _number(value, f"cluster.{key}", cluster)
    if number < 0:
        raise ConfigError(f"cluster.{key} is {meaning}, at least 0, got {value!r} (cluster {cluster})")
    return number


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
PROTOCOL_FIELDS = {f.name for f in dataclasses.fields(Protocol)}


def _collectives(table: Any, cluster: str) -> tuple[dict[str, Protocol], dict[str, Protocol]]:
    """The `collectives` block: {ring: {protocol: {...}}, tree: {protocol: {...}}}, each
    protocol's fields those of Protocol. Every preset states both; the ring at least one
    protocol."""
    if not isinstance(table, Mapping) or set(table) != {"ring", "tree"}:
        raise ConfigError(
            f"cluster.collectives must map ring and tree to their protocols ({sorted(PROTOCOL_FIELDS)}), "
            f"got {table!r} (cluster {cluster})"
        )
    out = []
    for algorithm in ("ring", "tree"):
        protocols = table[algorithm] or {}
        if not isinstance(protocols, Mapping) or (algorithm == "ring" and not protocols):
            raise ConfigError(
                f"cluster.collectives.{algorithm} must map protocol names to their figures, got {protocols!r} (cluster {cluster})"
            )
        out.append(
            {str(name): _protocol(spec, f"cluster.collectives.{algorithm}.{name}", cluster) for name, spec in protocols.items()}
        )
    return out[0], out[1]


def _protocol(spec: Any, key: str, cluster: str) -> Protocol:
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{key} must map {sorted(PROTOCOL_FIELDS)} to numbers, got {spec!r} (cluster {cluster})")
    reject_unknown(spec, sorted(PROTOCOL_FIELDS), f"{key} key(s)")
    values: dict[str, Any] = {}
    for field_name, value in spec.items():
        if field_name == "size_correction":
            if not isinstance(value, (list, tuple)) or not value:
                raise ConfigError(f"{key}.size_correction lists bandwidth factors by message size, got {value!r} (cluster {cluster})")
            factors = tuple(_number(v, f"{key}.size_correction", cluster) for v in value)
            if any(not 0 < f <= 1 for f in factors):
                raise ConfigError(f"{key}.size_correction: factors in (0, 1], got {list(factors)} (cluster {cluster})")
            values[field_name] = factors
            continue
        number = _number(value, f"{key}.{field_name}", cluster)
        if number < 0 or not math.isfinite(number):
            raise ConfigError(f"{key}.{field_name} must be a finite number >= 0, got {value!r} (cluster {cluster})")
        values[field_name] = number
    if values.get("share", 1.0) <= 0 or values.get("share", 1.0) > 1:
        raise ConfigError(f"{key}.share is a fraction of the bus bandwidth in (0, 1], got {values['share']} (cluster {cluster})")
    if values.get("allreduce_plateau", 1.0) < 1:
        raise ConfigError(
            f"{key}.allreduce_plateau multiplies a latency, at least 1, got {values['allreduce_plateau']} (cluster {cluster})"
        )
    return Protocol(**values)


def _names(value: Any, cluster: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(
            f"cluster.collective_measurements lists measured tables of conf/cluster/measured/ by name, "
            f"got {value!r} (cluster {cluster})"
        )
    return list(value)


def _one_table(value: Any, key: str, what: str, cluster: str) -> str | None:
    """The name of the one measured table cluster.<key> may name (a list of at most one)."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 1 or not isinstance(value[0], str) or not value[0]:
        raise ConfigError(f"cluster.{key} names at most one table of {what}, got {value!r} (cluster {cluster})")
    return value[0]


def _gemm_measurements(value: Any, cluster: str) -> GemmMeasurements | None:
    name = _one_table(value, "gemm_measurements", "conf/cluster/measured/gemm/ (the device's library)", cluster)
    return None if name is None else measured_gemms(name, cluster)


def _attention_measurements(value: Any, cluster: str) -> AttentionMeasurements | None:
    what = "conf/cluster/measured/attention/ (the device's FlashAttention kernels)"
    name = _one_table(value, "attention_measurements", what, cluster)
    return None if name is None else measured_attention(name, cluster)


def measured_collectives(name: str, cluster: str = "?") -> CollectiveMeasurements:
    """The measured tables of conf/cluster/measured/<name>.yaml, checked."""
    path = measured_file(MEASURED_DIR, "conf/cluster/measured", name, "collective measurements", cluster)
    return _read_measurements(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_measurements(path: Path, mtime_ns: int) -> CollectiveMeasurements:
    """A measured file, read once per version (every run validates its cluster)."""
    name = path.stem
    data = read_yaml(path)
    where = f"conf/cluster/measured/{name}.yaml"
    if not isinstance(data, Mapping) or not isinstance(data.get("collectives"), Mapping):
        raise ConfigError(f"{where} must map `collectives` to measured tables")
    reject_unknown(data, ["name", "library", "source", "collectives", "placement"], f"key(s) of {where}")
    for key in ("library", "source"):
        if not str(data.get(key) or "").strip():
            raise ConfigError(f"{where} must say its {key}")
    tables = {}
    for op, table in data["collectives"].items():
        if op not in COLLECTIVE_OPS:
            raise ConfigError(f"{where}: {op!r} is not a collective; one of {list(COLLECTIVE_OPS)}")
        tables[str(op)] = _measured_table(table, f"{where} {op}")
    placement = data.get("placement") or {}
    return CollectiveMeasurements(
        name=name,
        library=str(data["library"]),
        collectives=tables,
        placements=_placements(placement.get("bus_gbps") or [], where),
        placement_source=str(placement.get("source") or ""),
    )


def _measured_table(table: Any, where: str) -> MeasuredCollective:
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: a table maps sizes_mib, ms (group size -> a time per size) and source, got {table!r}")
    reject_unknown(table, ["sizes_mib", "ms", "source"], f"key(s) of {where}")
    sizes = [_number(v, "sizes_mib", where) for v in table.get("sizes_mib") or []]
    if not sizes or any(b <= a for a, b in zip(sizes, sizes[1:])) or sizes[0] <= 0:
        raise ConfigError(f"{where}: sizes_mib must be positive and ascending, got {sizes}")
    rows = table.get("ms")
    if not isinstance(rows, Mapping) or not rows:
        raise ConfigError(f"{where}: ms maps group sizes to one time per size, got {rows!r}")
    groups = sorted(int(g) for g in rows)
    if groups[0] < 2:
        raise ConfigError(f"{where}: groups have 2 ranks or more, got {groups}")
    seconds = []
    for g in groups:
        row = rows[g]
        if not isinstance(row, (list, tuple)) or len(row) != len(sizes):
            raise ConfigError(f"{where}: group {g} gives {row!r}, one time (ms, or null) per size of {len(sizes)}")
        times = [None if v is None else _number(v, f"ms[{g}]", where) / 1e3 for v in row]
        if any(t is not None and t <= 0 for t in times):
            raise ConfigError(f"{where}: group {g} has a time that is not positive: {row}")
        seconds.append(tuple(times))
    if not str(table.get("source") or "").strip():
        raise ConfigError(f"{where}: every table says where its times come from (source)")
    return MeasuredCollective(tuple(groups), tuple(s * MIB for s in sizes), tuple(seconds), str(table["source"]))


def _placements(rows: Any, where: str) -> tuple[PlacementBandwidth, ...]:
    if not isinstance(rows, (list, tuple)):
        raise ConfigError(f"{where}: placement.bus_gbps lists {{stride, size, gbps}} entries, got {rows!r}")
    out = []
    for row in rows:
        if not isinstance(row, Mapping) or set(row) != {"stride", "size", "gbps"}:
            raise ConfigError(f"{where}: a placement entry is {{stride, size, gbps}}, got {row!r}")
        stride, size, gbps = int(row["stride"]), int(row["size"]), _number(row["gbps"], "gbps", where)
        if stride < 1 or size < 2 or gbps <= 0:
            raise ConfigError(f"{where}: placement stride >= 1, size >= 2, gbps > 0, got {dict(row)}")
        out.append(PlacementBandwidth(stride, size, gbps * 1e9))
    return tuple(out)


def _collective_efficiency(table: Any, cluster: str) -> dict[str, float]:
    if table is None:
        return {}
    if not isinstance(table, Mapping) or set(table) - set(COLLECTIVE_OPS):
        raise ConfigError(
            f"cluster.collective_efficiency maps collective ops {list(COLLECTIVE_OPS)} to the fraction "
            f"of the ring formula's rate they achieve, got {table!r} (cluster {cluster})"
        )
    out = {}
    for op, v in table.items():
        share = _number(v, f"cluster.collective_efficiency.{op}", cluster)
        if not 0 < share <= 1:
            raise ConfigError(f"cluster.collective_efficiency.{op}={v}: a fraction in (0, 1] (cluster {cluster})")
        out[str(op)] = share
    return out


def with_host_profile(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """A preset with `profile: <name>` takes the figures `python -m src.calibrate` measured
    on this host's CPU model (or on the one `profile_cpu` names: pricing what another host
    measured), if a profile has them; the note says which were used. The
    links were measured with as many workers running as the node has (`by_workers`: each
    count's figures; workers sharing cores wait on each other at every step), so a node
    of k workers takes the figures of the largest count measured up to k. A figure the run
    sets otherwise than the preset's file (a command-line override) stays the run's."""
    from src.cluster_profile import host_cpu_model, host_profile, preset_file, profile_path, profiled_cpu_models

    name, cpu = cfg.get("profile"), cfg.get("profile_cpu")
    if cpu is not None and (not isinstance(cpu, str) or not cpu.strip()):
        raise ConfigError(f"cluster.profile_cpu must be a CPU model as a profile names it, got {cpu!r}")
    if name is None:
        if cpu is not None:
            raise ConfigError(
                f"cluster.profile_cpu={cpu!r} names a host profile, but cluster {cfg.get('name')} takes none (profile: null)"
            )
        return cfg, ""
    measured = host_profile(str(name), cpu)
    if measured is None:
        if cpu is not None:
            raise ConfigError(
                f"cluster.profile_cpu={cpu!r}: no profile conf/cluster/profiles/{profile_path(str(name), cpu).name}; "
                f"{name}'s profiles were measured on {profiled_cpu_models(str(name)) or 'no CPU'}"
            )
        return cfg, (
            f"no profile for this host's CPU ({host_cpu_model()}): the preset's own figures; "
            f"`python -m src.calibrate` writes {profile_path(str(name)).name}"
        )
    where = "this CPU model" if cpu is None else f"{cpu} (cluster.profile_cpu; this host: {host_cpu_model()})"
    note = f"measured on {where}: conf/cluster/profiles/{profile_path(str(name), cpu).name}"
    by_workers = {int(k): v for k, v in dict(measured.get("by_workers") or {}).items()}
    figures = {k: v for k, v in measured.items() if k != "by_workers"}
    workers = cfg.get("devices_per_node")
    if by_workers and isinstance(workers, int):
        count = max((k for k in by_workers if k <= workers), default=min(by_workers))
        figures.update(by_workers[count])
        note += f" (links measured with {count} workers running)"
    preset = preset_file(str(cfg.get("name")))
    overrides = _set_otherwise(cfg, preset) if preset is not None else {}
    kept = sorted(k for k in overrides if k in figures)
    if kept:
        note += f"; the run's own {', '.join(kept)}"
    return _merged({**cfg, **figures}, overrides), note


def _set_otherwise(cfg: Mapping[str, Any], preset: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `cfg` whose values differ from `preset`'s, nested mappings entry by entry."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        stated = preset.get(key)
        if isinstance(value, Mapping) and isinstance(stated, Mapping):
            inner = _set_otherwise(value, stated)
            if inner:
                out[key] = inner
        elif key not in preset or value != stated:
            out[key] = value
    return out


def _merged(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `top`'s entries over it, nested mappings entry by entry."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        out[key] = _merged(below, value) if isinstance(value, Mapping) and isinstance(below, Mapping) else value
    return out


def family_sharing(cluster: ClusterSpec, groups: Sequence[Sequence[int]]) -> int:
    """How many groups of one family cross the busiest node's links at once.

    A ring that leaves a node uses its NICs once however many of its members the node
    holds, so the count is the number of node-spanning groups with a member there (this is
    Par4D eq. 10's min(G_node, prod G_j) for grid groups).
    """
    per_node: dict[int, int] = {}
    for group in groups:
        nodes = {cluster.node_of(r) for r in group}
        if len(nodes) < 2:
            continue
        for node in nodes:
            per_node[node] = per_node.get(node, 0) + 1
    return max(per_node.values(), default=1)
