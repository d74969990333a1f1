"""The Par4D planner: 3D tensor x data parallelism with overlapped collectives (Singh et
al., "A Communication-Minimizing 4D Hybrid Algorithm"; public code: AxoNN).

As the paper prescribes (§V-C), the communication model ranks every valid grid
(G_x, G_y, G_z, G_data) for the device count (par4d.model, placement-aware or -agnostic),
and the best few are profiled: here the simulator prices the top `top_k` grids that fit in
memory, and the fastest is the plan. `strategy.grid` fixes the grid by hand. Per grid, the
micro-batch (the largest dividing the replica's batch by whole samples per z slice) and
the recompute mode are the least memory-saving that fit; with the `cache` overlap under
full recomputation, as many layers' gathered weights as memory allows are cached (the
paper caches 28 of GPT-20B's 32 layers on 16 GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from src.batch_layout import BatchLayout
from src.cluster import GIB, gib
from src.config import check_positive, options_from
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import element_bytes, rank_memory
from src.errors import ConfigError, PlanError
from src.program import GRID_GATHERS, GRID_OVERLAPS, RECOMPUTE_MODES, Plan, Program, UnitPlan
from src.sim.engine import simulate
from src.strategies.base import PlanRequest, check_microbatch_count, microbatch_sizes
from src.strategies.par4d.layout import Grid, LayerLayout, UnitGrid
from src.strategies.par4d.model import COMM_MODELS, RankedGrid, rank_grids, valid_grids
from src.strategies.par4d.programs import Par4DSettings, par4d_program
from src.strategies.spec import AutoVariant, StrategySpec

RANKING_SHOWN = 10


@dataclass(frozen=True)
class Par4DOptions:
    grid: tuple[int, ...] | None = None  # (G_x, G_y, G_z, G_data); null: ranked and simulated
    model: str = "aware"  # the communication model that ranks the grids
    top_k: int | None = 5  # grids simulated; null: every grid that fits
    overlap: tuple[str, ...] = field(default=GRID_OVERLAPS)
    micro_batch_size: int | None = None  # samples per replica per micro-batch; null: searched
    recompute: str | None = None  # none | selective | full; null: the least that fits
    gathers: str = "paper"  # paper | lightning: how the weights are gathered (par4d.programs)

    def __post_init__(self) -> None:
        if self.grid is not None:
            grid = list(self.grid)
            if len(grid) != 4 or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in grid):
                raise ConfigError(f"strategy.grid={grid!r} must be four positive integers [G_x, G_y, G_z, G_data]")
            object.__setattr__(self, "grid", tuple(grid))
        if self.model not in COMM_MODELS:
            raise ConfigError(f"strategy.model={self.model!r}; choose one of {list(COMM_MODELS)}")
        check_positive("strategy.top_k", self.top_k, optional=True)
        check_positive("strategy.micro_batch_size", self.micro_batch_size, optional=True)
        overlap = list(self.overlap or [])
        unknown = sorted(set(overlap) - set(GRID_OVERLAPS))
        if unknown:
            raise ConfigError(f"strategy.overlap has {unknown}; choose any of {list(GRID_OVERLAPS)}")
        object.__setattr__(self, "overlap", tuple(overlap))
        if self.recompute is not None and self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"strategy.recompute={self.recompute!r}; choose one of {list(RECOMPUTE_MODES)} or null")
        if self.gathers not in GRID_GATHERS:
            raise ConfigError(f"strategy.gathers={self.gathers!r}; choose one of {list(GRID_GATHERS)}")
        if self.gathers == "lightning" and "cache" in overlap:
            raise ConfigError(
                "strategy.gathers=lightning with cache in strategy.overlap: AxoNN's Lightning strategy caches no gathered "
                "weights; drop cache from strategy.overlap"
            )


@dataclass(frozen=True)
class _Simulated:
    """A candidate that fits: its settings, Program, unit plan, a rank's memory and the
    simulated iteration time."""

    settings: Par4DSettings
    program: Program
    unit_plan: UnitPlan
    memory: dict[str, float]
    time: float


@dataclass
class _Candidate:
    """A grid in the model's ranking: once settled, the settings that fit (or the
    problem why none does); once simulated, what it built."""

    ranked: RankedGrid
    rank: int
    settings: Par4DSettings | None = None
    problem: str | None = None
    simulated: _Simulated | None = None


class _Planner:
    def __init__(self, request: PlanRequest, opts: Par4DOptions) -> None:
        self.request, self.opts = request, opts
        self.model, self.cluster, self.train = request.model, request.cluster, request.train
        if len(self.model.units) != 1:
            raise ConfigError(
                f"par4d plans one-unit models (gpt, unet); model {self.model.name} has units {[u.name for u in self.model.units]}"
            )
        self.unit = self.model.units[0]
        self.unit_grid = UnitGrid(self.unit)
        self.usable = self.cluster.usable_memory_bytes

    # ---- one grid's settings under memory ----------------------------------------------------
    def _build(
        self, grid: Grid, layouts: list[LayerLayout], settings: Par4DSettings, microbatches: int | None = None
    ) -> tuple[Program, UnitPlan, dict[str, float]]:
        """The grid's Program (with `microbatches` micro-batches only, for a memory probe:
        a rank's peak lies within one micro-batch) and its memory."""
        batch = self.train.global_batch if microbatches is None else microbatches * settings.micro_batch * grid.dp
        program, unit_plan = par4d_program(
            self.model, self.cluster, self.train.precision, batch, grid, layouts, settings, self.unit.name
        )
        memory = rank_memory(program.classes[0], {self.unit.name: unit_plan}, self.model, self.train.precision, self.cluster.amp)
        return program, unit_plan, memory

    def _micro_batches(self, grid: Grid) -> list[int]:
        batch = BatchLayout(self.train.global_batch, grid.dp)
        mb = self.opts.micro_batch_size
        if mb is not None:
            if mb % grid.z:
                raise ConfigError(f"grid {grid.label()}: strategy.micro_batch_size={mb} must be a multiple of G_z={grid.z}")
            fixed = replace(batch, micro_batch=mb)
            check_microbatch_count(fixed.per_replica, mb, f"grid {grid.label()}: the replica's batch {fixed.per_replica}")
            return [mb]
        return microbatch_sizes(batch.per_replica, multiple_of=grid.z)

    def _settle(self, candidate: _Candidate, layouts: list[LayerLayout]) -> None:
        """The least memory-saving settings that fit (largest micro-batch, then the
        recompute ladder), then as many cached layers as fit."""
        grid = candidate.ranked.grid
        overlap = frozenset(self.opts.overlap)
        ladder = [r for r in RECOMPUTE_MODES if self.opts.recompute in (None, r)]
        closest: tuple[float, str] | None = None
        for mb in self._micro_batches(grid):
            for recompute in ladder:
                settings = Par4DSettings(mb, recompute, overlap, gathers=self.opts.gathers)
                _, unit_plan, memory = self._build(grid, layouts, settings, microbatches=1)
                if memory["total"] > self.usable:
                    short = memory["total"] - self.usable
                    if closest is None or short < closest[0]:
                        closest = (short, self._memory_problem(grid, settings, memory))
                    continue
                if recompute == "full" and "cache" in overlap:
                    settings = self._with_cache(grid, layouts, settings, memory)
                candidate.settings = settings
                return
        candidate.problem = closest[1] if closest else f"grid {grid.label()}: no micro-batch"

    def _with_cache(self, grid: Grid, layouts: list[LayerLayout], settings: Par4DSettings, memory: dict[str, float]) -> Par4DSettings:
        """Cache the gathered weights of as many recomputed layers (in order) as the memory
        left holds."""
        room = self.usable - memory["total"]
        cached = 0
        for layout in layouts:
            # Full recomputation re-runs (and re-gathers for) blocks only.
            if grid.z == 1 or not layout.params or not self.unit.layers[layout.index].block:
                continue
            room -= layout.gathered_params(grid) * element_bytes(self.train.precision)
            if room < 0:
                break
            cached += 1
        return replace(settings, cached_layers=cached)

    def _memory_problem(self, grid: Grid, settings: Par4DSettings, memory: dict[str, float]) -> str:
        parts = ", ".join(f"{k} {gib(memory[k])}" for k in ("weights", "grads", "optimizer", "gathered", "activations") if k in memory)
        return (
            f"par4d grid {grid.label()} micro-batch={settings.micro_batch} recompute={settings.recompute}: a rank "
            f"needs {gib(memory['total'])} GiB ({parts}) but a {self.cluster.device} has "
            f"{gib(self.usable)} GiB usable, short by {gib(memory['total'] - self.usable)} GiB"
        )

    # ---- the search ----------------------------------------------------------------------------
    def plan(self) -> Plan:
        fixed = Grid(*self.opts.grid) if self.opts.grid is not None else None
        devices = self.cluster.devices
        if fixed is not None and fixed.devices != devices:
            g = fixed.degrees
            raise ConfigError(
                f"strategy.grid={list(g)} holds {' x '.join(map(str, g))} = {fixed.devices} devices but "
                f"cluster {self.cluster.name} has {devices}"
            )
        valid, rejected = valid_grids(self.unit_grid, devices, self.train.global_batch, fixed)
        if not valid:
            raise ConfigError(
                rejected[0]
                if fixed is not None or len(rejected) == 1
                else f"no grid of {devices} devices suits {self.model.name} ({len(rejected)} rejected); first: {rejected[0]}"
            )
        bytes_per_elem = element_bytes(self.train.precision)
        ranked = rank_grids(self.unit_grid, valid, self.cluster, self.train.global_batch, bytes_per_elem, self.opts.model)
        candidates = [_Candidate(r, i + 1) for i, r in enumerate(ranked)]
        chosen = self._simulate_top(candidates)
        return self._plan_of(chosen, candidates, len(rejected))

    def _simulate_top(self, candidates: list[_Candidate]) -> tuple[_Candidate, _Simulated]:
        compute = ComputeModel(self.cluster, self.train.precision)
        limit = self.opts.top_k or len(candidates)
        simulated: list[tuple[_Candidate, _Simulated]] = []
        for candidate in candidates:
            if len(simulated) >= limit:
                break
            grid = candidate.ranked.grid
            try:
                layouts = self.unit_grid.layout(grid)
                self._settle(candidate, layouts)
            except ConfigError as err:
                if self.opts.grid is not None:
                    raise
                candidate.problem = str(err)
                continue
            if candidate.settings is None:
                continue
            program, unit_plan, memory = self._build(grid, layouts, candidate.settings)
            time = simulate(program, self.model, self.cluster, self.train.precision, compute).iteration_time
            candidate.simulated = _Simulated(candidate.settings, program, unit_plan, memory, time)
            simulated.append((candidate, candidate.simulated))
        if not simulated:
            problems = [c.problem for c in candidates if c.problem]
            closest = min(problems, key=lambda p: float(p.rsplit("short by ", 1)[1].split()[0]) if "short by" in p else float("inf"))
            if len(candidates) == 1:
                raise PlanError(closest)
            raise PlanError(f"no par4d grid fits memory ({len(problems)} tried); closest: {closest}")
        return min(simulated, key=lambda pair: (pair[1].time, pair[0].rank))

    def _plan_of(self, chosen: tuple[_Candidate, _Simulated], candidates: list[_Candidate], rejected: int) -> Plan:
        times = {c.rank: c.simulated.time for c in candidates if c.simulated is not None}
        fastest = sorted(times, key=times.__getitem__)[:5]
        # The model's rank of the simulator's best grid among the grids simulated (Fig. 7).
        order = sorted(times)
        ranking = []
        for c in candidates[: max(RANKING_SHOWN, max(times))]:
            fits = True if c.settings is not None else (False if c.problem else None)
            ranking.append(
                {
                    "rank": c.rank,
                    "grid": c.ranked.grid.label(),
                    "model_comm_s": c.ranked.comm.total,
                    "fits": fits,
                    "iteration_time_s": times.get(c.rank),
                }
            )
        candidate, built = chosen
        s = built.settings
        grid = candidate.ranked.grid
        details = {
            "grid": grid.label(),
            "grid_x": grid.x,
            "grid_y": grid.y,
            "grid_z": grid.z,
            "dp": grid.dp,
            "micro_batch": s.micro_batch,
            "recompute": s.recompute,
            "overlap": sorted(s.overlap),
            "cached_layers": built.unit_plan.details["cached_layers"],
            "memory_gib": round(built.memory["total"] / GIB, 3),
            "search": {
                "model": self.opts.model,
                "fixed": self.opts.grid is not None,
                "grids_valid": len(candidates),
                "grids_rejected": rejected,
                "grids_simulated": len(times),
                "rank_of_best": order.index(candidate.rank) + 1,
                "efficient_in_top5": sum(1 for r in fastest if r in order[:5]),
                "ranking": ranking,
            },
        }
        return Plan(
            strategy="par4d",
            devices=grid.devices,
            units=[built.unit_plan],
            program=built.program,
            precision=self.train.precision,
            details=details,
        )


def plan_par4d(request: PlanRequest) -> Plan:
    opts = options_from(Par4DOptions, request.options)
    return _Planner(request, opts).plan()


STRATEGY = StrategySpec(
    "par4d",
    plan_par4d,
    Par4DOptions,
    plan_fields={
        "mesh": "strategy.grid",
        "micro_batch": "strategy.micro_batch_size",
        "recompute": "strategy.recompute",
        "gathers": "strategy.gathers",
    },
    auto_variants=(AutoVariant("par4d"),),
)
