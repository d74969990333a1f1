"""Bounds from physics and size, checked when a config is validated.

Physical bounds: a cluster's figures (peak FLOP/s, memory and its bandwidth, link
bandwidths and latencies, per-kernel and per-fetch host costs) must lie within what a real
device, link or host can be, from a slow CPU core to well past today's fastest accelerator.
A figure outside them is a typo or a unit slip (FLOP/s given as TFLOP/s, seconds as
microseconds) far more often than a study, and it prices a plan at 1e43 s or at "MFU 57 %"
without a word. A what-if study of a machine that cannot be built lifts them:
`+cluster.what_if=true` (the figures must still be positive and finite).

Size bounds: every layer is planned and simulated one by one, and every count is multiplied
into kernels' shapes; counts beyond these are refused before anything is built, whatever
`what_if` says (10^9 layers fill the machine's memory with their list alone, and 10^20 does
not fit an index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from src.errors import ConfigError

WHAT_IF = "what_if"  # the cluster key that lifts the physical bounds


@dataclass(frozen=True)
class Bound:
    low: float
    high: float
    unit: str  # with its leading space, or empty
    why: str  # what lies at the ends, for the refusal

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high


FLOPS = Bound(1e8, 1e17, " FLOP/s", "from a 1990s CPU core to 10x the fastest accelerator's dense peak")
MEMORY_BANDWIDTH = Bound(1e8, 1e14, " B/s", "from a slow DRAM channel to 10x HBM3e")
LINK_BANDWIDTH = Bound(1e6, 1e13, " B/s", "from a 10 Mb/s network to 10x NVLink 5")
LATENCY = Bound(0.0, 0.1, " s", "a message between devices, up to a wide-area round trip")
HOST_COST = Bound(0.0, 1.0, " s", "a host's cost or wait per kernel, module fetch or collective")
HOST_BYTE_COST = Bound(0.0, 1e-6, " s/B", "a host's work per byte fetched, down to 1 MB/s")
MEMORY_GIB = Bound(0.0, 16384.0, " GiB", "a device's memory, up to 16 TiB")
GEMM_HALF_DIM = Bound(0.0, 1e5, "", "the GEMM dimension at which a device reaches half its peak")

# Each physical figure of a cluster preset (ClusterSpec's field names) and its bound.
PHYSICAL: dict[str, Bound] = {
    "memory_gib": MEMORY_GIB,
    "memory_bandwidth": MEMORY_BANDWIDTH,
    "intra_bandwidth": LINK_BANDWIDTH,
    "inter_bandwidth": LINK_BANDWIDTH,
    "intra_latency": LATENCY,
    "inter_latency": LATENCY,
    "kernel_overhead_s": HOST_COST,
    "gemm_fixed_s": HOST_COST,
    "host_forward_kernel_s": HOST_COST,
    "host_backward_kernel_s": HOST_COST,
    "host_fetch_s": HOST_COST,
    "host_fetch_byte_s": HOST_BYTE_COST,
    "host_list_entry_s": HOST_COST,
    "core_handover_s": HOST_COST,
    "sync_skew_s": HOST_COST,
    "sync_skew_build_s": HOST_COST,
    "gemm_half_dim": GEMM_HALF_DIM,
}
# A collective protocol's figures (src.cluster.Protocol): its latencies and its caps (0: none).
PROTOCOL: dict[str, Bound] = {
    "base_s": LATENCY,
    "intra_step_s": LATENCY,
    "inter_step_s": LATENCY,
    "net_step_floor_s": LATENCY,
    "cap": LINK_BANDWIDTH,
    "net_cap": LINK_BANDWIDTH,
}
MAY_BE_UNSET = ("p2p_bandwidth", "cap", "net_cap")  # 0 says "none": the link's rate, no cap

MAX_DEVICES = 2**20  # a cluster's devices: 5x the largest training clusters built
MAX_DEVICES_PER_NODE = 4096
MAX_NICS = 64
MAX_LAYERS = 100_000  # a unit's layers: the deepest presets have 126
MAX_SIZE = 10**7  # any other count of a model (width, heads, vocabulary, image side, tokens, images)


def check_cluster(spec: Any, what_if: Any) -> None:
    """Refuse a cluster (a src.cluster.ClusterSpec, its figures already positive and finite)
    whose devices could not exist, or that is too big to plan, in one line naming the
    figure, its bound and how to lift it."""
    name = spec.name
    if spec.devices > MAX_DEVICES or spec.devices_per_node > MAX_DEVICES_PER_NODE or spec.nics > MAX_NICS:
        raise ConfigError(
            f"cluster {name}: {spec.nodes} nodes x {spec.devices_per_node} devices, {spec.nics} NICs a node: at most "
            f"{MAX_DEVICES} devices, {MAX_DEVICES_PER_NODE} a node and {MAX_NICS} NICs a node are planned"
        )
    if not isinstance(what_if, bool):
        raise ConfigError(f"cluster.{WHAT_IF} must be true or false, got {what_if!r} (cluster {name})")
    if what_if:
        return
    figures = [(f"peak_flops.{precision}", value, FLOPS) for precision, value in spec.peak_flops.items()]
    figures += [(key, getattr(spec, key), bound) for key, bound in PHYSICAL.items()]
    if spec.p2p_bandwidth:
        figures.append(("p2p_bandwidth", spec.p2p_bandwidth, LINK_BANDWIDTH))
    for algorithm, table in (("ring", spec.ring_protocols), ("tree", spec.tree_protocols)):
        for protocol_name, protocol in (table or {}).items():
            for key, bound in PROTOCOL.items():
                value = getattr(protocol, key)
                if value or key not in MAY_BE_UNSET:
                    figures.append((f"collectives.{algorithm}.{protocol_name}.{key}", value, bound))
    for key, value, bound in figures:
        if not bound.holds(value):
            raise ConfigError(
                f"cluster.{key}={value:g}{bound.unit} is outside {bound.low:g} to {bound.high:g}{bound.unit} "
                f"({bound.why}; cluster {name}); a what-if study of such a device: +cluster.{WHAT_IF}=true"
            )


def check_count(key: str, value: int, maximum: int = MAX_SIZE) -> None:
    """A model's count (`key`=`value`, already a positive integer) within its size bound."""
    if value > maximum:
        raise ConfigError(
            f"{key}={value}: at most {maximum} (a model is planned and simulated layer by layer, and its sizes "
            f"multiply into every kernel's shape)"
        )
