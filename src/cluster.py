"""Where a model trains: devices, nodes, links, and the cost model's per-hardware constants.

Ranks are numbered node-major: rank r lives on node r // devices_per_node. Every number
comes from a preset in conf/cluster/, which says where it comes from; nothing here has a
default for an unknown device.
"""

from __future__ import annotations

import dataclasses
import math

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from src.errors import ConfigError, reject_unknown

GIB = 1024**3


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster preset. Bandwidths are bytes/s in one direction; latencies seconds.

    intra_bandwidth: per device, over NVLink/NVSwitch/Infinity Fabric.
    inter_bandwidth: per node, the sum of its NICs.
    intra_latency, inter_latency: what one step of a ring (or one message) pays over
      NVLink and over the network (NCCL's per-hop latencies, src/graph/tuning.cc).
    gemm_max_efficiency, gemm_half_dim: achieved fraction of peak for a GEMM is
      max_efficiency * prod_d d/(d + half_dim) over its m, n, k: large GEMMs approach the
      maximum, thin ones (small per-device batch, over-partitioned TP) fall off.
    memory_efficiency: achieved fraction of HBM bandwidth for bandwidth-bound kernels.
    intra_efficiency, inter_efficiency: achieved fraction of the link bandwidth by
      collectives and transfers inside a node and across nodes.
    kernel_overhead_s: fixed cost per kernel launch.
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
    oversubscription: dict[int, float] = field(default_factory=dict)
    collective_efficiency: dict[str, float] = field(default_factory=dict)
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

    def compute_share(self) -> float:
        """Each device's share of its rate alone while all devices of a node compute; past
        the largest measured count the cores split further in proportion."""
        if not self.oversubscription:
            return 1.0
        k = self.devices_per_node
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
    "intra_efficiency",
    "inter_efficiency",
    "kernel_overhead_s",
    "reserved_memory_gib",
    "collective_sm_fraction",
    "p2p_sm_fraction",
)
# May be zero: a latency or overhead too small to state, or no SMs taken by communication.
MAY_BE_ZERO = (
    "intra_latency",
    "inter_latency",
    "kernel_overhead_s",
    "reserved_memory_gib",
    "collective_sm_fraction",
    "p2p_sm_fraction",
)


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


def cluster_from_config(cfg: Mapping[str, Any]) -> ClusterSpec:
    """Build and validate a ClusterSpec from the `cluster` config group."""
    name = cfg.get("name", "?")
    reject_unknown(cfg, [f.name for f in dataclasses.fields(ClusterSpec)] + ["devices", "profile"], "cluster key(s)")
    cfg, profile_note = with_host_profile(cfg)
    for key in ("nodes", "devices_per_node"):
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
    for key in ("gemm_max_efficiency", "memory_efficiency", "intra_efficiency", "inter_efficiency"):
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
    sources = {str(k): str(v) for k, v in dict(cfg.get("sources") or {}).items()}
    if profile_note:
        sources["profile"] = profile_note
    return ClusterSpec(
        name=str(name),
        device=str(cfg.get("device")),
        nodes=int(cfg["nodes"]),
        devices_per_node=int(cfg["devices_per_node"]),
        peak_flops=peaks,
        default_precision=str(cfg["default_precision"]),
        sources=sources,
        oversubscription=_oversubscription(cfg.get("oversubscription"), name),
        collective_efficiency=_collective_efficiency(cfg.get("collective_efficiency"), name),
        **{key: float(cfg[key]) for key in FLOAT_FIELDS},
    )


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


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


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
    on this host's CPU model, if a profile has them; the note says which were used."""
    from src.cluster_profile import host_cpu_model, host_profile, profile_path

    name = cfg.get("profile")
    if name is None:
        return cfg, ""
    measured = host_profile(str(name))
    if measured is None:
        return cfg, (
            f"no profile for this host's CPU ({host_cpu_model()}): the preset's own figures; "
            f"`python -m src.calibrate` writes {profile_path(str(name)).name}"
        )
    return {**cfg, **measured}, f"measured on this CPU model: conf/cluster/profiles/{profile_path(str(name)).name}"


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
