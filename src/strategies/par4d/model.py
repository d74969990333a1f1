"""Par4D's communication model (§V, eqs. 1-10): rank every grid by its predicted
communication time, so that only the best few are profiled (here: simulated).

Ring collectives without latency (eqs. 1-3); per FC layer with I (m x k), W (k x n):
  (4) t_AG,z   = (G_z-1)            · k·n/(G_x·G_y·G_z) / β_z
  (5) t_RS,z   = (G_z-1)/G_z        · k·n/(G_x·G_y)     / β_z
  (6) t_AR,y   = 2(G_y-1)/G_y       · m·n/(G_z·G_x)     / β_y
  (7) t_AR,x   = 2(G_x-1)/G_x       · m·k/(G_z·G_y)     / β_x
  (8) t_AR,data= 2(G_data-1)/G_data · k·n/(G_x·G_y·G_z) / β_data
summed (9) over every FC layer of the model, with G_x <-> G_y and β_x <-> β_y swapped for
transposed layers. m is the rows of I that one data-parallel replica processes in an
iteration; element counts are multiplied by the precision's bytes per element.

Bandwidths. placement-agnostic: every β = 1. placement-aware (eq. 10), X innermost, then
Y, Z, data, G_node GPUs per node: a group inside a node (prod_{j<=i} G_j <= G_node) gets
β_intra; otherwise β_inter / min(G_node, prod_{j<i} G_j), the node's links shared by the
rings of the inner axes. β_intra and β_inter are the cluster preset's achieved NVLink
bandwidth per device and network bandwidth per node, the numbers the simulator uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from src.cluster import ClusterSpec
from src.errors import ConfigError
from src.strategies.par4d.layout import FC, Grid, UnitGrid, grids

COMM_MODELS = ("aware", "agnostic")
Betas = tuple[float, float, float, float]  # (β_x, β_y, β_z, β_data)


@dataclass(frozen=True)
class CommTerms:
    """The five terms of eq. 9 for one FC layer (or a sum of them)."""

    ag_z: float = 0.0
    rs_z: float = 0.0
    ar_y: float = 0.0
    ar_x: float = 0.0
    ar_data: float = 0.0

    @property
    def total(self) -> float:
        return self.ag_z + self.rs_z + self.ar_y + self.ar_x + self.ar_data

    def __add__(self, other: CommTerms) -> CommTerms:
        return CommTerms(
            self.ag_z + other.ag_z,
            self.rs_z + other.rs_z,
            self.ar_y + other.ar_y,
            self.ar_x + other.ar_x,
            self.ar_data + other.ar_data,
        )

    def scaled(self, factor: float) -> CommTerms:
        return CommTerms(self.ag_z * factor, self.rs_z * factor, self.ar_y * factor, self.ar_x * factor, self.ar_data * factor)


def fc_comm(m: float, k: float, n: float, grid: Grid, betas: Betas, transposed: bool = False) -> CommTerms:
    """Eqs. 4-8 for one FC layer; `betas` = (β_x, β_y, β_z, β_data)."""
    gx, gy, gz, gd = grid.degrees
    bx, by, bz, bd = betas
    if transposed:
        gx, gy, bx, by = gy, gx, by, bx
    return CommTerms(
        ag_z=(gz - 1) * k * n / (gx * gy * gz) / bz,
        rs_z=(gz - 1) / gz * k * n / (gx * gy) / bz,
        ar_y=2 * (gy - 1) / gy * m * n / (gz * gx) / by,
        ar_x=2 * (gx - 1) / gx * m * k / (gz * gy) / bx,
        ar_data=2 * (gd - 1) / gd * k * n / (gx * gy * gz) / bd,
    )


def placement_bandwidths(grid: Grid, devices_per_node: int, intra: float, inter: float) -> Betas:
    """Eq. 10: (β_x, β_y, β_z, β_data) for the hierarchy X, Y, Z, data."""
    out = []
    inner = 1
    for degree in grid.degrees:
        if inner * degree <= devices_per_node:
            out.append(intra)
        else:
            out.append(inter / min(devices_per_node, inner))
        inner *= degree
    bx, by, bz, bd = out
    return bx, by, bz, bd


def model_bandwidths(kind: str, grid: Grid, cluster: ClusterSpec) -> Betas:
    if kind == "agnostic":
        return (1.0, 1.0, 1.0, 1.0)
    if kind != "aware":
        raise ConfigError(f"strategy.model={kind!r}; choose one of {list(COMM_MODELS)}")
    return placement_bandwidths(
        grid,
        cluster.devices_per_node,
        cluster.intra_bandwidth * cluster.intra_efficiency,
        cluster.inter_bandwidth * cluster.inter_efficiency,
    )


def units_comm(counts: dict[FC, int], grid: Grid, rows_per_sample_scale: float, betas: Betas, bytes_per_elem: float) -> CommTerms:
    """Eq. 9 summed over the FC layers (`counts`: how many of each shape): m = each FC's
    rows per sample x the samples one replica processes in an iteration."""
    total = CommTerms()
    for fc, count in counts.items():
        terms = fc_comm(fc.m * rows_per_sample_scale, fc.k, fc.n, grid, betas, fc.transposed)
        total = total + terms.scaled(count * bytes_per_elem)
    return total


@dataclass(frozen=True)
class RankedGrid:
    grid: Grid
    comm: CommTerms


def valid_grids(unit: UnitGrid, devices: int, global_batch: int, only: Grid | None = None) -> tuple[list[Grid], list[str]]:
    """Every grid of `devices` (or just `only`) that the model and batch allow; and why
    the others are not."""
    valid, rejected = [], []
    for grid in [only] if only is not None else grids(devices):
        if global_batch % (grid.dp * grid.z):
            rejected.append(
                f"grid {grid.label()}: global batch {global_batch} is not divisible by "
                f"G_data x G_z = {grid.dp} x {grid.z} = {grid.dp * grid.z} (rows split by sample)"
            )
            continue
        try:
            unit.check(grid)
        except ConfigError as err:
            rejected.append(str(err))
            continue
        valid.append(grid)
    return valid, rejected


def rank_grids(
    unit: UnitGrid, candidates: list[Grid], cluster: ClusterSpec, global_batch: int, bytes_per_elem: float, kind: str
) -> list[RankedGrid]:
    """The candidates ordered by eq. 9's predicted communication time (ties broken by
    the grid's degrees, so the order is deterministic)."""
    out = []
    for grid in candidates:
        betas = model_bandwidths(kind, grid, cluster)
        out.append(RankedGrid(grid, units_comm(unit.fc_counts(grid), grid, global_batch / grid.dp, betas, bytes_per_elem)))
    out.sort(key=lambda r: (r.comm.total, r.grid.degrees))
    return out
