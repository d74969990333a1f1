"""Optimus on the real backend: a tiny MLLM (ViT encoders + the projector, a GPT LLM) with
the encoders and the LLM colocated on every worker under separate plans, the encoders'
work run where the bubble scheduler places it (before, after and between the LLM's
pipeline operations, layer kernels in its bubbles), trains exactly like one process: with
one encoder, two encoders and a frozen encoder, with four LLM replicas under the distributed
optimizer and two under ZeRO-0, fine-grained with the LLM on TP 2 (encoder kernels in its TP
bins), coarse-grained with TP and an interleaved schedule, and on interleaved data (sequences of none to several images, their
sides spread) placed by the `cost` policy, where its Megatron-LM and ZeRO-3 baselines train
on the same data like one process too. All runs share ONE launch of four workers.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from src.models.registry import build_model
from src.plan_io import read_plan
from src.program import Collective, Compute, RankProgram
from src.runtime.reference import reference_losses
from src.runtime.tp_bins import find_bins
from tests.runtime.support import launch_cases, sensitive, sensitive_optimizer, summary_of, trace_events

pytestmark = pytest.mark.slow  # starts worker processes

STEPS = 3  # two updates: each step's loss follows from the update before it
BATCH = 8
WORKERS = 4
BASE = [
    "backend=torch",
    "cluster=local",
    f"cluster.devices_per_node={WORKERS}",
    "logger=none",
    "model=optimus",
    "model.scale=tiny",
    "strategy=optimus",
    f"train.global_batch={BATCH}",
    f"train.steps={STEPS}",
    *sensitive(),
]
# The LLM's four layers on four pipeline stages: its bubbles hold encoder kernels.
PIPELINE = ["strategy.llm.pp=4", "strategy.llm.dp=1", "strategy.llm.tp=1", "strategy.llm.micro_batch_size=1"]
TWO_ENCODERS = ["vit_3b", "vit_5b"]
# Skewed data: two images a sequence on average, their sides spread, placed by the cost policy.
INTERLEAVED = ["model.images_per_sample=2", "train.data=interleaved", "train.balance=cost"]
_MODEL = build_model({"name": "optimus", "scale": "tiny", "encoders": TWO_ENCODERS})
# (model options, strategy overrides)
CASES: dict[str, tuple[dict, list[str]]] = {
    "one_encoder": ({}, PIPELINE + ["strategy.refine=1"]),
    "two_encoders": (
        {"encoders": TWO_ENCODERS},
        PIPELINE
        + [
            f"model.encoders=[{','.join(TWO_ENCODERS)}]",
            # Selective: under the cost model's full recompute the scheduler puts no encoder
            # forward in the bubbles kernel by kernel; this plan holds what the executor must
            # run, encoder forwards in bubbles and their backward as one stage pass.
            "strategy.llm.recompute=selective",
            "strategy.encoder_zero_stage=0",
            "strategy.max_partitions=2",
        ],
    ),
    "frozen_encoder": (
        {"frozen": ["encoder"]},
        PIPELINE
        + [
            "model.frozen=[encoder]",
            "strategy.llm.micro_batch_size=2",
            "strategy.llm.zero_stage=1",
            "strategy.encoder.pp=1",
            "strategy.defer_warmup=false",
        ],
    ),
    # Four LLM replicas under the distributed optimizer, its gradient reduce-scatter under
    # the encoders' backward, its parameter all-gather under the next step's encoder
    # forwards (runtime.dist_optimizer): the plan as typed where this host's figures make
    # ZeRO-1 the faster rung, pinned so that every host runs it (the as-typed plan of every
    # model and strategy runs in test_runtime_matrix).
    "distributed_optimizer": ({}, ["strategy.llm.zero_stage=1"]),
    # Two LLM replicas under ZeRO-0: their gradient all-reduce runs asynchronously under the
    # encoders' backward; the encoders (ZeRO-1) and the LLM share DP groups, not engines.
    "llm_dp2": (
        {},
        [
            "strategy.llm.pp=2",
            "strategy.llm.dp=2",
            "strategy.llm.tp=1",
            "strategy.llm.micro_batch_size=1",
            "strategy.llm.recompute=full",
            "strategy.llm.zero_stage=0",
        ],
    ),
    # Interleaved data: each LLM replica's micro-batches hold their own sequences' images
    # (two a sequence on average), placed by the cost policy; the loss of a micro-batch is its
    # share of the step's, whatever tokens its images leave to score.
    "interleaved_cost": (
        {"images_per_sample": 2, "content": "interleaved"},
        [
            *INTERLEAVED,
            "strategy.llm.pp=2",
            "strategy.llm.dp=2",
            "strategy.llm.tp=1",
            "strategy.llm.micro_batch_size=1",
        ],
    ),
    # Its baselines on the same skewed data and policy: Megatron-LM with the encoder in the
    # first of two stages (two replicas), and ZeRO-3 over the four workers.
    "megatron_interleaved": (
        {"images_per_sample": 2, "content": "interleaved"},
        [
            *INTERLEAVED,
            "strategy=megatron",
            "strategy.modality_stages=merged",
            "strategy.tp=1",
            "strategy.pp=2",
            "strategy.micro_batch_size=1",
        ],
    ),
    "zero3_interleaved": ({"images_per_sample": 2, "content": "interleaved"}, [*INTERLEAVED, "strategy=ddp", "strategy.zero_stage=3"]),
    # Fine-grained with the LLM on tp2 (sequence parallelism, full recomputation): encoder
    # kernels in the TP bins of LLM operations run while each pass's last TP collective travels.
    "fine_grained_tp2": (
        {"encoders": TWO_ENCODERS},
        [
            f"model.encoders=[{','.join(TWO_ENCODERS)}]",
            "strategy.llm.pp=2",
            "strategy.llm.dp=1",
            "strategy.llm.tp=2",
            "strategy.llm.micro_batch_size=1",
            "strategy.llm.recompute=full",
        ],
    ),
    # Coarse-grained: the encoders before and after the LLM, LLM tp2 with sequence
    # parallelism, interleaved.
    "coarse_tp2_interleaved": (
        {},
        [
            "strategy.llm.pp=2",
            "strategy.llm.dp=1",
            "strategy.llm.tp=2",
            "strategy.llm.vpp=2",
            "strategy.llm.schedule=interleaved",
            "strategy.llm.micro_batch_size=1",
            "strategy.llm.sequence_parallel=true",
            "strategy.encoder.tp=2",
            "strategy.fine_grained=false",
        ],
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    cases = {name: BASE + overrides for name, (_, overrides) in CASES.items()}
    return launch_cases(tmp_path_factory.mktemp("optimus"), cases, WORKERS)


@functools.cache
def _reference(encoders: tuple[str, ...] = (), frozen: tuple[str, ...] = (), images: int = 1, content: str = "uniform") -> list[float]:
    options = {
        "name": "optimus",
        "scale": "tiny",
        "frozen": list(frozen),
        "images_per_sample": images,
        **({"encoders": list(encoders)} if encoders else {}),
    }
    return reference_losses(build_model(options), 0, BATCH, STEPS, sensitive_optimizer(), content=content)


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, case):
    model = CASES[case][0]
    frozen = tuple(model.get("frozen", ()))
    expected = _reference(tuple(model.get("encoders", ())), frozen, model.get("images_per_sample", 1), model.get("content", "uniform"))
    losses = summary_of(runs[case])["measured"]["loss"]
    assert losses == pytest.approx(expected, rel=1e-4)
    assert expected[-1] != pytest.approx(expected[0], rel=1e-3)  # it trains, so equality says something
    if frozen:  # and freezing changes what it trains
        assert expected != pytest.approx(_reference(), rel=1e-6)
    if "content" in model:  # and the data is not uniform data's
        assert expected != pytest.approx(_reference(), rel=1e-6)


def test_four_llm_replicas_overlap_their_distributed_optimizer_s_collectives(runs):
    """What the distributed_optimizer losses say something about: the LLM's ZeRO-1
    reduce-scatter and all-gather, asynchronous, each naming the LLM's layers, on every rank."""
    plan = read_plan(runs["distributed_optimizer"]).plan
    assert plan.unit("llm").zero_stage == 1 and plan.unit("llm").dp == WORKERS
    for rank_program in plan.program.classes:
        own = {
            i.op
            for i in rank_program.instructions
            if isinstance(i, Collective) and i.grads_of is not None and i.grads_of[0] == "llm" and not i.blocking
        }
        assert own == {"reduce_scatter", "all_gather"}


def test_interleaved_data_runs_each_replica_s_own_images_in_the_policy_s_order(runs):
    """What the interleaved_cost losses say something about: the replicas' encoder work
    carries their micro-batches' loads, and the cost policy moved the sequences."""
    plan = read_plan(runs["interleaved_cost"]).plan
    assert plan.details["balance_policy"] == "cost" and list(plan.sample_order) != list(range(BATCH))
    loads = {i.work.load for c in plan.program.classes for i in c.instructions if isinstance(i, Compute) and i.work.unit == "encoder"}
    assert len(loads) > 2 and len(plan.program.classes) == 2 * 2  # two LLM stages of one column, split by the two replicas


def test_encoder_kernels_in_the_llm_s_tp_bins_run_while_its_collectives_travel(runs):
    """What the fine_grained_tp2 losses say something about: its plan places encoder work
    in the TP bins of LLM operations, forward and backward, and the run says how it ran them."""
    run_dir = runs["fine_grained_tp2"]
    plan = read_plan(run_dir).plan
    binned = [(c, b) for c in plan.program.classes for b in find_bins(c.instructions).values()]
    phases = {c.instructions[b.compute].work.phase for c, b in binned}  # type: ignore[union-attr]
    assert phases == {"fwd", "bwd"}
    assert any("TP bins" in note for note in summary_of(run_dir)["measured_notes"])


def test_encoders_and_llm_share_every_worker_under_separate_plans(runs):
    units = summary_of(runs["two_encoders"])["plan"]["units"]
    assert units["encoder0"]["ranks"] == units["encoder1"]["ranks"] == units["llm"]["ranks"] == "0-3"
    assert (units["encoder0"]["dp"], units["encoder0"]["pp"]) != (units["llm"]["dp"], units["llm"]["pp"])


def _ran(rank_program: RankProgram) -> list[tuple[str, str, int, int, int]]:
    """The Computes a rank class runs, in order, as its trace names them: a layer split into
    kernel ranges at its last range (runtime.executor._kernel_pass)."""
    out, covered = [], {}
    for instruction in rank_program.instructions:
        if not isinstance(instruction, Compute):
            continue
        work = instruction.work
        if work.kernels is not None:
            key = (work.unit, work.phase, work.layers, instruction.microbatch)
            covered[key] = covered.get(key, 0) + work.kernels[1] - work.kernels[0]
            if covered[key] < len(_MODEL.unit(work.unit).layers[work.layers[0]].kernels):
                continue
            del covered[key]
        out.append((work.phase, work.unit, *work.layers, instruction.microbatch))
    return out


def test_encoder_kernels_run_inside_the_llm_pipeline_where_the_plan_places_them(runs):
    run_dir = runs["two_encoders"]
    plan = read_plan(run_dir).plan  # the plan the workers ran
    assert plan.details["kernels_in_bubbles"] > 0
    assert any("kernel ranges" in note for note in summary_of(run_dir)["measured_notes"])  # where their time is charged
    events = trace_events(run_dir)
    pids = {e["args"]["name"].split(" (ranks")[0]: e["pid"] for e in events if e.get("name") == "process_name"}
    interleaved = 0
    for rank_program in plan.program.classes:
        spans = sorted(
            (e for e in events if e.get("pid") == pids[rank_program.label] and e.get("ph") == "X" and e.get("cat") == "compute"),
            key=lambda e: e["ts"],
        )
        ran = [(*e["name"].split(" ")[:2], e["args"]["microbatch"]) for e in spans]
        planned = _ran(rank_program)
        assert ran == [(phase, unit, microbatch) for phase, unit, _, _, microbatch in planned]
        assert [e["name"].split(" ")[2] for e in spans] == [f"L{a}-{b}" for _, _, a, b, _ in planned]
        # Encoder layers between the LLM's operations, not only before and after them.
        llm = [i for i, (_, unit, _) in enumerate(ran) if unit == "llm" and ran[i][0] != "optimizer"]
        interleaved += sum(1 for i, (_, unit, _) in enumerate(ran) if unit != "llm" and llm[0] < i < llm[-1])
    assert interleaved > 0
    # Some micro-batch ran its encoder layers forward one by one (in bubbles) and backward
    # as one stage pass (the executor runs that backward over its forwards, last first).
    computes = [c for k in plan.program.classes for c in k.instructions if isinstance(c, Compute) and c.work.unit != "llm"]
    fine_forward = {(c.work.unit, c.microbatch) for c in computes if c.work.phase == "fwd" and c.work.kernels}
    stage_backward = {
        (c.work.unit, c.microbatch) for c in computes if c.work.phase == "bwd" and c.work.layers[1] - c.work.layers[0] > 1
    }
    assert fine_forward & stage_backward
