"""Optimus: the model planner, the bubble scheduler's invariants, the Program it emits and
the errors a user gets."""

from __future__ import annotations

import math
from dataclasses import replace

from pathlib import Path

import pytest

from src.costmodel.comm import CommModel
from src.costmodel.compute import ComputeModel
from src.costmodel.memory import rank_memory
from src.errors import ConfigError, PlanError
from src.program import Compute, RankProgram
from src.schedules.pipeline import interleaved, one_f_one_b, warmup_counts
from src.setup import Setup, plan_run, validate
from src.sim.engine import simulate
from src.strategies.base import PlanRequest
from src.strategies.megatron.planner import MegatronOptions, choose_megatron, plan_megatron
from src.strategies.megatron.programs import MegatronSettings
from src.strategies.base import Degrees
from src.strategies.optimus import parallel, timeline
from src.strategies.optimus import planner as optimus_planner
from src.strategies.optimus.llm import LLMPipelines
from src.strategies.optimus.planner import OptimusOptions, _llm_and_encoders, _RungJobs
from src.strategies.optimus.encoder import EncoderPlan, Layout
from src.strategies.optimus.scheduler import BubbleScheduler, partitions, spread
from src.strategies.optimus.timeline import EPS, makespan
from src.config import options_from
from tests.composing import composed

# 64 H100s, GPT-11B + ViT-3B, the LLM's plan by hand (Table 11's model A shape): 32
# micro-batches per pipeline, eight encoder pipelines (PP_enc 4, TP_enc 1) per LLM pipeline.
SMALL = [
    "cluster=hopper",
    "cluster.nodes=8",
    "model.llm=gpt_11b",
    "model.encoders=[vit_3b]",
    "strategy.llm.tp=8",
    "strategy.llm.pp=4",
    "strategy.llm.dp=2",
    "strategy.llm.micro_batch_size=2",
    "train.global_batch=128",
]

# Fig. 17's model A (ViT-11B + LLaMA-70B) on 64 H100s, Table 11's plan: 8 micro-batches per
# pipeline; most encoder plans' schedules end at the bound no schedule beats.
MODEL_A = [
    "cluster=hopper",
    "cluster.nodes=8",
    "model.llm=llama_70b",
    "model.encoders=[vit_11b]",
    "strategy.llm.tp=8",
    "strategy.llm.pp=4",
    "strategy.llm.micro_batch_size=2",
    "train.global_batch=32",
]


def setup(*overrides: str) -> Setup:
    return validate(composed(["model=optimus", "strategy=optimus", "logger=none", *overrides]))


def candidate(s: Setup, pp: int, tp: int, zero_stage: int = 0):
    """The scheduler's best schedule for one encoder plan, with everything it read."""
    request = PlanRequest(s.model, s.cluster, s.train, s.config["strategy"])
    opts = options_from(OptimusOptions, s.config["strategy"])
    compute, comm = ComputeModel(s.cluster, s.train.precision), CommModel(s.cluster)
    llm, encoders = _llm_and_encoders(s.model)
    base = LLMPipelines(request, llm, encoders, opts.llm.options("strategy.llm"), opts.defer_warmup, compute, comm).base(
        "none", zero_stage
    )
    layout = Layout(base.plan.mesh, EncoderPlan(pp, tp))
    jobs = _RungJobs(request, opts, base, encoders, compute, comm)
    return base, jobs.schedule(layout, jobs.scheduler(layout))


@pytest.fixture(scope="module")
def small() -> tuple[Setup, object]:
    s = setup(*SMALL)
    return s, plan_run(s)


def test_plan_reports_both_plans_and_efficiencies(small) -> None:
    s, plan = small
    d = plan.details
    assert (d["llm"]["tp"], d["llm"]["pp"], d["llm"]["dp"]) == (8, 4, 2)
    assert d["llm"]["pp"] % d["encoder"]["pp"] == 0 and d["llm"]["tp"] % d["encoder"]["tp"] == 0
    assert d["encoder"]["dp"] == 64 // (d["encoder"]["pp"] * d["encoder"]["tp"])
    assert sum(d["partition"]) == d["llm"]["microbatches"] and len(d["partition"]) == d["encoder"]["pipelines"]
    assert 0.0 <= d["eff_coarse"] <= d["eff_fine"] + EPS <= 1.0 + EPS
    # The fine stage moved encoder work into the LLM's bubbles, and it is compute there.
    assert d["kernels_in_bubbles"] > 0 and d["eff_fine"] > d["eff_coarse"]


def test_simulator_prices_the_schedule_the_scheduler_estimated(small) -> None:
    s, plan = small
    simulated = simulate(plan.program, s.model, s.cluster, s.train.precision).iteration_time
    assert simulated == pytest.approx(plan.details["estimated_iteration_s"], rel=0.02)


def test_encoder_kernels_sit_between_llm_operations(small) -> None:
    """Encoder compute placed in bubbles appears in the rank's list between LLM computes."""
    _, plan = small
    program: RankProgram = plan.program.classes[0]
    units = [i.work.unit for i in program.instructions if isinstance(i, Compute)]
    first_llm, last_llm = units.index("llm"), len(units) - 1 - units[::-1].index("llm")
    assert "encoder" in units[first_llm:last_llm]


def test_scheduler_invariants() -> None:
    s = setup(*SMALL)
    base, best = candidate(s, 4, 1)
    schedule, timeline = best.schedule, base.timeline
    assert schedule.placed
    for p in schedule.placed:
        slots = timeline.slots[best.layout.position(p.klass)[0]]
        if p.item.is_comm:
            # Encoder all-reduces overlap an LLM compute, never a TP bin.
            assert p.kind == "issue" and p.item.seconds <= slots.issue_capacity[p.op] + EPS
            continue
        assert p.kind in ("gap", "tp")
        index = next(
            n
            for n, (k, o) in enumerate(zip(slots.kind, slots.op))
            if k == p.kind
            and o == p.op
            and slots.start[n] <= p.start + EPS
            and p.start + p.item.seconds <= slots.start[n] + slots.length[n] + EPS
        )
        assert p.item.seconds <= slots.length[index] + EPS  # no kernel in a bubble shorter than it
    mapping = schedule.mapping
    for p in schedule.placed:
        i = mapping[(p.pipeline, p.local)]
        if p.phase == "fwd":  # the encoder output is ready before the LLM reads it
            assert p.start + p.item.seconds <= timeline.forward_points[i] + schedule.delta + EPS
        else:  # the encoder backward starts after the LLM's gradient
            assert p.start >= timeline.backward_points[i] - EPS
    assert 0.0 <= best.eff_coarse <= 1.0 and 0.0 <= best.eff_fine <= 1.0


def test_frozen_encoder_has_no_backward() -> None:
    s = setup(*SMALL, "model.frozen=[encoder]")
    plan = plan_run(s)
    phases = {
        i.work.phase for c in plan.program.classes for i in c.instructions if isinstance(i, Compute) and i.work.unit == "encoder"
    }
    assert phases == {"fwd"}
    assert plan.details["fine_backward_microbatches"] == 0


def test_two_encoders_share_one_plan() -> None:
    # SMALL on 16 GPUs (an LLM of two stages, one replica): a plan of two encoders needs no more.
    s = setup(
        *SMALL, "model.encoders=[vit_3b,vit_3b]", "cluster.nodes=2", "strategy.llm.pp=2", "strategy.llm.dp=1", "train.global_batch=32"
    )
    plan = plan_run(s)
    encoders = [u for u in plan.units if u.unit != "llm"]
    assert [u.unit for u in encoders] == ["encoder0", "encoder1"]
    assert encoders[0].mesh == encoders[1].mesh
    units = {i.work.unit for c in plan.program.classes for i in c.instructions if isinstance(i, Compute)}
    assert units == {"encoder0", "encoder1", "llm"}


def test_partitions_by_hand() -> None:
    # Two blocks of one column: every split of 4 micro-batches, each pipeline at least one.
    assert sorted(partitions(4, 2, 1, 100)) == [[1, 3], [2, 2], [3, 1]]
    # Two columns per block share its micro-batches evenly.
    assert spread([5, 3], 2) == [3, 2, 2, 1]
    assert partitions(40, 8, 1, 10) is None  # too many: the local search takes over


def test_deferred_warmups_in_the_schedule() -> None:
    assert warmup_counts(one_f_one_b(4, 8)) == [3, 2, 1, 0]
    orders = interleaved(4, 8, 1, [1, 1, 1, 0])
    assert warmup_counts(orders) == [1, 1, 1, 0]
    with pytest.raises(ConfigError):
        interleaved(4, 8, 2, [1, 6, 5, 4])  # stage 0 needs 4 forwards before its last chunk


@pytest.mark.slow  # long, not a process: planning the configuration that crashed the planner (3 s)
def test_deferring_warmups_skips_trials_that_would_deadlock() -> None:
    # 8 H100s, batch 16: an interleaved LLM pipeline whose warm-ups nearly fill it. Taking
    # one forward off the first stage alone stalls the next (it crashed the planner).
    plan = plan_run(
        setup("cluster=hopper", "cluster.nodes=1", "model.llm=gpt_11b", "model.encoders=[vit_3b]", "train.global_batch=16")
    )
    warmups = plan.details["llm"]["warmups"]
    assert all(a >= b for a, b in zip(warmups, warmups[1:]))


@pytest.mark.slow  # long, not a process: SMALL planned twice, each trial cut short timed in full (7 s)
def test_trials_cut_short_keep_the_deferred_warmups(monkeypatch) -> None:
    s = setup(*SMALL)
    overruns = []
    timed = timeline.time_pipeline

    def timed_through(orders, costs, deadline=math.inf):
        try:
            return timed(orders, costs, deadline)
        except timeline.Overrun:
            overruns.append((makespan(timed(orders, costs)), deadline))
            raise

    monkeypatch.setattr(timeline, "time_pipeline", timed_through)
    cut_short = plan_run(s).details["llm"]["warmups"]
    # Each trial cut short would have ended after its deadline, and is not kept either way.
    assert overruns and all(length > deadline for length, deadline in overruns)
    monkeypatch.setattr(timeline, "time_pipeline", lambda orders, costs, deadline=math.inf: timed(orders, costs))
    assert plan_run(s).details["llm"]["warmups"] == cut_short


@pytest.mark.parametrize(
    "override, needle",
    [
        ("strategy.encoder.tp=3", "does not divide the LLM's tp=8"),
        ("strategy.encoder.pp=3", "does not divide the LLM's pp=4"),
    ],
)
def test_encoder_plan_not_dividing_the_llm_is_refused(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        plan_run(setup(*SMALL, override))


def test_no_encoder_plan_fits_memory() -> None:
    with pytest.raises(PlanError, match="short by"):
        # FlashAttention (the Hopper default) keeps no s x s scores: 12 GiB, not 24, is short.
        plan_run(setup(*SMALL, "cluster.memory_gib=12", "strategy.llm.recompute=none"))


def test_an_emitted_schedule_over_memory_is_rejected_and_the_next_one_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pruning counts each encoder plan's memory before any schedule is emitted; where it
    # counts short (here: no encoder activations at all), the emitted schedule's own memory
    # is the check: its emission stops at the first class over, and the plan kept fits.
    monkeypatch.setattr(optimus_planner, "_encoder_activation_bytes", lambda *args, **kwargs: 0.0)
    s = setup(*SMALL, "cluster.memory_gib=16", "strategy.llm.recompute=none")
    plan = plan_run(s)
    over = [r for r in plan.details["rejected"] if ", partition [" in r]
    assert over and all("short by" in r for r in over)
    units = {u.unit: u for u in plan.units}
    need = max(rank_memory(c, units, s.model, s.train.precision)["total"] for c in plan.program.classes)
    assert need <= s.cluster.usable_memory_bytes


@pytest.mark.slow
def test_cli_bad_input_is_one_line_exit_2(cli, tmp_path: Path) -> None:
    result = cli("model=optimus", "strategy=optimus", "logger=none", f"hydra.run.dir={tmp_path}", *SMALL, "strategy.encoder.tp=3")
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "strategy.encoder.tp=3" in result.stderr
    assert not (tmp_path / "summary.json").exists()


def test_interleaved_llm_schedule_is_priced_as_estimated() -> None:
    s = setup(*SMALL, "strategy.llm.schedule=interleaved", "strategy.llm.vpp=2")
    plan = plan_run(s)
    assert plan.details["llm"]["vpp"] == 2 and plan.details["kernels_in_bubbles"] > 0
    simulated = simulate(plan.program, s.model, s.cluster, s.train.precision).iteration_time
    assert simulated == pytest.approx(plan.details["estimated_iteration_s"], rel=0.02)


# ---- the LLM's memory ladder and the typed Megatron-LM API ---------------------------------
def test_the_fastest_rung_of_the_memory_ladder_that_fits_is_picked(small) -> None:
    _, plan = small
    d = plan.details
    rungs = d["rungs"]
    # Every rung of the ladder was considered, the distributed optimizer's included.
    assert [(r["recompute"], r["zero_stage"]) for r in rungs] == [(r, z) for r in ("none", "selective", "full") for z in (0, 1)]
    scheduled = [r for r in rungs if "best_s" in r]
    assert scheduled and d["estimated_iteration_s"] == pytest.approx(min(r["best_s"] for r in scheduled))
    # A rung is skipped only when its LLM alone (a bound on any schedule there) cannot win.
    for rung in rungs:
        if rung["outcome"].startswith("the LLM alone is no faster"):
            assert rung["llm_alone_s"] >= d["estimated_iteration_s"]
    picked = next(r for r in scheduled if r["best_s"] == pytest.approx(d["estimated_iteration_s"]))
    assert (d["llm"]["recompute"], d["llm"]["zero_stage"]) == (picked["recompute"], picked["zero_stage"])


def test_the_llm_plan_comes_through_megatron_lm_s_typed_api() -> None:
    s = setup(*SMALL)
    llm = s.model.unit("llm")
    alone = PlanRequest(replace(s.model, units=(llm,), flows=()), s.cluster, s.train, {})
    opts = MegatronOptions(tp=8, pp=4, dp=2, micro_batch_size=2, recompute="none", zero_stage=1)
    choice = choose_megatron(alone, opts)
    assert isinstance(choice.degrees, Degrees) and isinstance(choice.settings, MegatronSettings)
    assert (choice.degrees.tp, choice.degrees.pp, choice.degrees.dp, choice.degrees.micro_batch) == (8, 4, 2, 2)
    assert (choice.settings.recompute, choice.settings.zero_stage) == ("none", 1)
    # The same search as the Megatron-LM planner's, which builds the Program besides.
    plan = plan_megatron(replace(alone, options={"name": "megatron", **vars(opts)}))
    assert [plan.details[k] for k in ("tp", "pp", "dp", "vpp", "micro_batch")] == list(vars(choice.degrees).values())
    assert len(choice.virtual) == choice.degrees.pp * choice.degrees.vpp


def _chosen(plan) -> tuple:
    """What a plan is: its units, Program and details, but for what says how it was found
    (the rungs tried, the rejections met on the way, the planners' times)."""
    details = {k: v for k, v in plan.details.items() if k not in ("rungs", "rejected", "scheduler_s")}
    details["llm"] = {k: v for k, v in details["llm"].items() if k != "search"}
    return plan.units, plan.program, details


@pytest.mark.slow  # long, not a process: model A planned in both orders (2.5 s)
def test_trying_the_fastest_rung_first_keeps_the_plan_of_ladder_order(monkeypatch) -> None:
    s = setup(*MODEL_A)
    fastest_first = plan_run(s)
    monkeypatch.setattr(optimus_planner, "_trial_order", lambda ladder: [index for _, index in ladder])
    ladder_order = plan_run(s)
    # Ladder order scheduled a rung whose LLM alone the plan found first rules out.
    ruled_out = [
        (a["recompute"], a["zero_stage"])
        for a, b in zip(fastest_first.details["rungs"], ladder_order.details["rungs"])
        if "best_s" in b and a["outcome"] == "the LLM alone is no faster than the best plan"
    ]
    assert ruled_out == [("none", 0)]
    assert _chosen(fastest_first) == _chosen(ladder_order)


@pytest.mark.slow
@pytest.mark.parametrize("planner_takes_some", [True, False])
def test_encoder_plans_scheduled_in_parallel_equal_the_serial_ones(monkeypatch, small, planner_takes_some: bool) -> None:
    _, serial = small  # conftest: MMDIST_PLAN_WORKERS=1
    monkeypatch.setattr(parallel, "workers", lambda jobs: 1 if jobs < 2 else 2)
    if not planner_takes_some:  # every plan after the first from the worker: one emitted is scheduled again here
        monkeypatch.setattr(parallel, "_take", lambda future: False)
    forked = plan_run(setup(*SMALL))
    assert len(serial.details["candidates"]) > 2  # plans scheduled ahead were asked for
    assert forked.details["candidates"] == serial.details["candidates"]
    assert _chosen(forked) == _chosen(serial)


@pytest.mark.slow  # long, not a process: model A planned twice (3 s)
def test_the_encoder_plans_left_unscheduled_could_not_have_been_chosen(monkeypatch) -> None:
    pruned = plan_run(setup(*MODEL_A))
    left = pruned.details["not_scheduled"]
    assert left, "model A's plans mostly end at their floor: the first found rules out the rest"
    # With every floor at zero, no plan is ruled out: every one is scheduled.
    built = BubbleScheduler.__init__

    def no_floor(self, *args) -> None:
        built(self, *args)
        self.floor = 0.0

    monkeypatch.setattr(BubbleScheduler, "__init__", no_floor)
    every = plan_run(setup(*MODEL_A))
    assert not every.details["not_scheduled"]
    (units, program, details), (every_units, every_program, every_details) = _chosen(pruned), _chosen(every)
    assert (units, program) == (every_units, every_program)
    listed = ("candidates", "not_scheduled")  # which plans were scheduled: the difference
    assert {k: v for k, v in details.items() if k not in listed} == {k: v for k, v in every_details.items() if k not in listed}
    latency = {(c["pp"], c["tp"]): c["estimated_iteration_s"] for c in every.details["candidates"]}
    chosen = pruned.details["estimated_iteration_s"]
    for plan in left:  # each floor bounds its plan's schedule, and none is faster than the plan chosen
        assert chosen <= plan["floor_s"] <= latency[(plan["pp"], plan["tp"])]


@pytest.mark.parametrize("value, workers", [("1", 1), ("3", 2), ("", 2)])
def test_the_planners_processes_are_capped_by_the_environment(monkeypatch, value: str, workers: int) -> None:
    monkeypatch.setenv(parallel.CAP_ENV, value)
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert parallel.workers(8) == workers


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_cap_on_the_planners_processes_is_one_line(monkeypatch, value: str) -> None:
    monkeypatch.setenv(parallel.CAP_ENV, value)
    with pytest.raises(ConfigError, match=f"MMDIST_PLAN_WORKERS='{value}'"):
        parallel.workers(8)
