"""The DistTrain planner end to end: the orchestration's relaxation and integer recovery
against brute force, the brokers (ALGORITHMS.md §1.5), the Program's routes, its switches,
and the errors a user gets."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.errors import ConfigError
from src.program import Compute, Table
from src.setup import Setup, plan_run, validate
from src.sim.engine import simulate
from src.strategies.disttrain.planner import DistTrainOptions
from src.strategies.base import divisors
from src.strategies.disttrain.orchestration import TOLERANCE, UNITS, Fixed, Orchestrator, UnitChoice, solve_relaxed
from src.strategies.disttrain.profile import Profiler

ROOT = Path(__file__).resolve().parents[2]
# One 8-GPU node, four sequences: plans in well under a second.
SMALL = ["model=mllm_9b", "cluster=a800", "cluster.nodes=1", "train.global_batch=4"]


def setup(*overrides: str) -> Setup:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["strategy=disttrain", "logger=none", *overrides])
    return validate(OmegaConf.to_container(cfg, resolve=True))


def by_unit(plan) -> dict:
    return {u.unit: u for u in plan.units}


# ---- the convex sub-problem --------------------------------------------------------------
def _brute_relaxed(a, low, high, beta, warm, k, n, steps=4000) -> float:
    """min over tau of W + sum beta_u max(low_u, a_u/tau) + k tau on a fine tau grid,
    then the best feasible continuous n on each grid point (the module's reduction)."""
    best = math.inf
    taus = np.geomspace(min(a / high) * 0.5, max(a / low) * 2.0, steps)
    for tau in taus:
        counts = np.maximum(low, a / tau)
        if counts.sum() > n + 1e-9 or np.any(counts > high + 1e-9):
            continue
        best = min(best, warm + float((beta * counts).sum()) + k * float((a / counts).max()))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_closed_form_matches_a_dense_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.uniform(1.0, 50.0, 3)
    low = rng.uniform(1.0, 6.0, 3)
    high = low + rng.uniform(0.0, 30.0, 3)
    beta = rng.uniform(0.0, 0.05, 3)
    warm, k, n = float(rng.uniform(0, 5)), float(rng.integers(1, 40)), float(rng.uniform(low.sum(), 60))
    value, tau = solve_relaxed(a[:, None], low[:, None], high[:, None], beta[:, None], np.array([warm]), k, n)
    dense = _brute_relaxed(a, low, high, beta, warm, k, n)
    assert np.isfinite(value[0])
    # The closed form is the exact optimum: never above a grid search, and the grid gets close.
    assert value[0] <= dense + 1e-9
    assert value[0] >= dense * (1 - 2e-3)


def test_infeasible_subproblem_is_infinite() -> None:
    a, low, high, beta = (np.array([[5.0], [5.0], [5.0]]) for _ in range(4))
    value, _ = solve_relaxed(a, low, high, beta, np.array([0.0]), 3.0, 14.0)  # 3 x 5 GPUs > 14
    assert not np.isfinite(value[0])


# ---- Algorithm 1 against brute force over every integer plan -----------------------------
def test_orchestration_is_within_tolerance_of_brute_force() -> None:
    s = setup(*SMALL, "strategy.data=uniform", "strategy.tp_overlap_chunks=1")
    profiler = Profiler(s.model, s.cluster, s.train.precision, 1, 1)
    batch, n = s.train.global_batch, s.cluster.devices
    orchestrator = Orchestrator(profiler, batch, n, {u: Fixed() for u in UNITS}, None, "disaggregated")
    found = orchestrator.solve()
    best = math.inf
    for dp_lm in divisors(batch):
        m = batch // dp_lm
        per_unit = []
        for unit in UNITS:
            choices = []
            for tp in profiler.tp_degrees(unit):
                for dp in [dp_lm] if unit == "llm" else divisors(dp_lm):
                    for pp in range(1, min(profiler.blocks(unit), n // (tp * dp)) + 1):
                        for recompute in orchestrator.modes:
                            choices.append(UnitChoice(unit, tp, dp, pp, recompute, dp_lm // dp))
            per_unit.append(choices)
        for picked in itertools.product(*per_unit):
            if sum(c.devices for c in picked) > n:
                continue
            t = orchestrator.exact(dict(zip(UNITS, picked)), m)
            if t is not None:
                best = min(best, t)
    assert math.isfinite(best)
    assert found.devices <= n
    assert orchestrator.exact(found.units, found.microbatches) == pytest.approx(found.estimate_s)
    assert best <= found.estimate_s <= best * (1 + TOLERANCE) + 1e-12
    assert found.relaxed_s <= found.estimate_s + 1e-12  # the relaxation is a lower bound
    assert found.search["subproblems"] > 0


def test_ratio_orchestration_is_no_better_than_algorithm_1() -> None:
    s = setup(*SMALL, "strategy.data=uniform")
    disaggregated = plan_run(s)
    ratio = plan_run(setup(*SMALL, "strategy.data=uniform", "strategy.orchestration=ratio"))
    assert disaggregated.details["estimate_s"] <= ratio.details["estimate_s"] * (1 + TOLERANCE)


# ---- the Program ---------------------------------------------------------------------------
def test_units_are_disjoint_and_brokers_are_gcd_of_the_dps() -> None:
    s = setup(
        "model=mllm_9b",
        "cluster=a800",
        "cluster.nodes=2",
        "train.global_batch=8",
        "strategy.encoder.dp=2",
        "strategy.llm.dp=4",
        "strategy.llm.tp=2",
        "strategy.generator.dp=1",
    )
    plan = plan_run(s)
    units = by_unit(plan)
    ranks = [set(units[u].mesh.ranks) for u in UNITS]
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(ranks, 2))
    assert (units["encoder"].mesh.degree("dp"), units["llm"].mesh.degree("dp"), units["generator"].mesh.degree("dp")) == (2, 4, 1)
    brokers = {b["route"]: b["count"] for b in plan.details["brokers"]}
    assert brokers == {"encoder>llm": math.gcd(2, 4), "llm>generator": math.gcd(4, 1)}
    # The micro-batch of a unit is DP_lm / DP_u sequences (§1.1).
    assert (units["encoder"].micro_batch, units["llm"].micro_batch, units["generator"].micro_batch) == (2, 1, 4)


def test_broker_routes_carry_every_sequence_once_each_way() -> None:
    s = setup(
        "model=mllm_9b",
        "cluster=a800",
        "cluster.nodes=2",
        "train.global_batch=8",
        "strategy.encoder.dp=2",
        "strategy.llm.dp=4",
        "strategy.generator.dp=1",
    )
    plan = plan_run(s)
    tables = {name: route for name, route in plan.program.routes.items() if isinstance(route, Table)}
    for flow in ("encoder>llm", "llm>generator"):
        for name in (flow, f"{flow}.grad"):
            rows = sum(m.sent.rows[1] - m.sent.rows[0] for m in tables[name].messages())
            assert rows == s.train.global_batch, name  # the step's sequences, each exactly once
    # The routes' ends are on the units' boundary stages.
    units = by_unit(plan)
    llm_first = set(units["llm"].mesh.slice(pp=0))
    assert {m.dst for m in tables["encoder>llm"].messages()} <= llm_first


def test_data_heterogeneity_and_reordering() -> None:
    base = [
        "model=mllm_9b",
        "cluster=a800",
        "cluster.nodes=2",
        "train.global_batch=16",
        "strategy.encoder.dp=2",
        "strategy.llm.dp=4",
        "strategy.generator.dp=2",
    ]
    s = setup(*base, "strategy.reorder=none")
    plan = plan_run(s)
    loads = {
        c.work.load for rp in plan.program.classes for c in rp.instructions if isinstance(c, Compute) and c.work.unit == "encoder"
    }
    assert len(loads) > 1  # sequences of different image counts load the encoder differently
    times = {}
    for reorder in ("none", "intra", "inter", "both"):
        rs = setup(*base, f"strategy.reorder={reorder}")
        times[reorder] = simulate(plan_run(rs).program, rs.model, rs.cluster, rs.train.precision).iteration_time
    assert times["both"] <= times["none"]
    uniform = setup(*base, "strategy.data=uniform")
    loads = {c.work.load for rp in plan_run(uniform).program.classes for c in rp.instructions if isinstance(c, Compute)}
    assert loads == {1.0}


def test_tp_overlap_chunks_split_the_tp_collectives() -> None:
    fixed = [
        "model=mllm_9b",
        "cluster=a800",
        "cluster.nodes=2",
        "train.global_batch=4",
        "strategy.llm.tp=4",
        "strategy.llm.dp=1",
        "strategy.data=uniform",
    ]
    plain = setup(*fixed, "strategy.tp_overlap_chunks=1")
    overlapped = setup(*fixed, "strategy.tp_overlap_chunks=4")
    times = [simulate(plan_run(x).program, x.model, x.cluster, x.train.precision).iteration_time for x in (plain, overlapped)]
    asynchronous = [
        c
        for rp in plan_run(overlapped).program.classes
        for c in rp.instructions
        if getattr(c, "kind", None) == "tp" and not c.blocking
    ]
    assert asynchronous
    assert times[1] < times[0]


def test_frozen_units_plan_and_simulate() -> None:
    s = setup(*SMALL, "model.frozen=[encoder,llm]", "model.train_projectors=true")
    plan = plan_run(s)
    assert simulate(plan.program, s.model, s.cluster, s.train.precision).iteration_time > 0


# ---- options and errors ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, match",
    [
        ({"orchestration": "magic"}, "strategy.orchestration"),
        ({"reorder": "sideways"}, "strategy.reorder"),
        ({"tp_overlap_chunks": 0}, "tp_overlap_chunks"),
    ],
)
def test_bad_options_are_named(options, match) -> None:
    with pytest.raises(ConfigError, match=match):
        DistTrainOptions(**options)


def test_unknown_unit_key_is_named() -> None:
    with pytest.raises(ConfigError, match="strategy.llm has unknown key"):
        DistTrainOptions(llm={"ep": 2}).fixed("llm")


def test_llm_dp_must_divide_the_batch() -> None:
    with pytest.raises(ConfigError, match="does not divide the global batch 4"):
        plan_run(setup(*SMALL, "strategy.llm.dp=3"))


def test_an_absurd_batch_is_refused_before_a_layout_per_sequence_is_drawn() -> None:
    # One sequence per LLM micro-batch: 10^9 sequences on 8 GPUs is at least 125M micro-batches.
    with pytest.raises(ConfigError, match=r"is 125000000 micro-batches per iteration; the planner builds at most 1024"):
        plan_run(setup("model=mllm_9b", "cluster=a800", "cluster.nodes=1", "train.global_batch=1000000000"))
    with pytest.raises(ConfigError, match=r"strategy.llm.dp=2 in micro-batches of 1 is 2048 micro-batches"):
        plan_run(setup(*SMALL[:-1], "train.global_batch=4096", "strategy.llm.dp=2"))


def test_other_models_are_refused() -> None:
    with pytest.raises(ConfigError, match="encoder -> llm -> generator"):
        plan_run(setup("model=clip", "cluster=a800", "cluster.nodes=1"))


def _run_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "src.run", "strategy=disttrain", "logger=none", f"hydra.run.dir={tmp_path}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "overrides, words",
    [
        (("model=mllm_72b", "cluster=a800", "cluster.nodes=1", "train.global_batch=4"), ("GPUs are fewer", "minimum")),
        (
            (
                "model=mllm_9b",
                "cluster=a800",
                "cluster.nodes=1",
                "train.global_batch=4",
                "strategy.llm.dp=2",
                "strategy.llm.tp=4",
                "strategy.llm.pp=1",
            ),
            ("no orchestration", "fixed degrees"),
        ),
    ],
)
@pytest.mark.slow
def test_impossible_plans_exit_2_with_one_line(tmp_path: Path, overrides, words) -> None:
    result = _run_cli(tmp_path, *overrides)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "summary.json").exists()
