"""The Megatron-LM baseline planner: fixed and searched plans, memory, multimodal stages."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import yaml

from src.cluster import GIB, cluster_from_config
from src import progress
from src.config import train_from_config
from src.costmodel.memory import memory_ladder, rank_memory
from src.errors import ConfigError, PlanError
from src.metrics import layer_flops
from src.models.registry import build_model
from src.program import Collective, Compute, Recv, Send
from src.schedules.pipeline import build_schedule
from src.sim.engine import simulate
from src.strategies import PlanRequest, planner_for
from src.strategies.megatron.options import MegatronOptions
from src.strategies.megatron.estimate import live_counts, steady_microbatches
from src.strategies.megatron.programs import MegatronSettings, pipeline_program
from src.strategies.base import MAX_MICROBATCHES, Degrees
from src.strategies.megatron.search import MegatronSearch
from src.strategies.megatron.space import Shape, enumerate_space
from src.strategies.builders.stages import balanced_cuts, linear_chain, pipeline_segments

CONF = Path(__file__).resolve().parents[3] / "conf"


def request(model: dict, cluster: str, nodes: int, batch: int, **options) -> PlanRequest:
    cluster_spec = cluster_from_config({**yaml.safe_load((CONF / "cluster" / f"{cluster}.yaml").read_text()), "nodes": nodes})
    train = train_from_config({"global_batch": batch, "steps": 1}, cluster_spec)
    return PlanRequest(build_model(model), cluster_spec, train, {"name": "megatron", **options})


GPT_SMALL = {"name": "gpt", "preset": None, "layers": 8, "hidden": 1024, "heads": 16, "vocab": 32000}


def test_fixed_degrees_are_respected_and_the_program_is_a_pipeline() -> None:
    plan = planner_for("megatron")(
        request(
            GPT_SMALL,
            "perlmutter",
            4,
            64,
            tp=2,
            pp=2,
            vpp=1,
            micro_batch_size=2,
            recompute="none",
            zero_stage=0,
            sequence_parallel=False,
        )
    )
    llm = plan.unit("llm")
    assert (llm.tp, llm.pp, llm.dp, llm.micro_batch, llm.num_microbatches) == (2, 2, 4, 2, 8)
    assert llm.stage_layers == ((0, 5), (5, 10))  # embedding + 4 blocks | 4 blocks + head
    stage0, stage1 = plan.program.classes
    assert stage0.ranks == tuple(range(8)) and stage1.ranks == tuple(range(8, 16))
    sends = [i for i in stage0.instructions if isinstance(i, Send)]
    recvs = [i for i in stage1.instructions if isinstance(i, Recv)]
    assert len(sends) == len(recvs) == 8 and {s.payload for s in sends} == {r.payload for r in recvs}
    assert {s.route for s in sends} == {"hop.v0"}
    tp_ops = [i for i in stage0.instructions if isinstance(i, Collective) and i.kind == "tp"]
    # Two all-reduces per block each way, 4 blocks, 8 micro-batches, forward and backward.
    assert sum(op.count for op in tp_ops) == 2 * 4 * 8 * 2
    dp_ops = [i for i in stage0.instructions if isinstance(i, Collective) and i.kind == "dp"]
    assert [op.op for op in dp_ops] == ["all_reduce"]


def test_search_returns_the_fastest_plan_that_fits_and_records_the_search() -> None:
    plan = planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64))
    search = plan.details["search"]
    assert search["searched"] and search["fitting"] >= 2
    assert search["space"] == search["shapes"] * 6  # every shape under each (recompute, zero) of the ladder
    assert search["priced_analytically"] == search["fitting"] and 1 <= search["simulated"] <= search["fitting"]
    assert search["built"] == search["simulated"] and search["wall_time_s"] >= 0
    times = [c["iteration_time_s"] for c in search["ranking"]]
    assert len(times) == 5 and times == sorted(times) and search["ranking"][0]["simulated"]
    best = search["ranking"][0]
    assert (
        plan.details["tp"],
        plan.details["pp"],
        plan.details["vpp"],
        plan.details["micro_batch"],
        plan.details["sequence_parallel"],
    ) == (best["tp"], best["pp"], best["vpp"], best["micro_batch"], best["sequence_parallel"])
    assert max(plan.details["memory_gib"].values()) <= 40 - 1.5


def test_memory_follows_the_schedule_and_the_memory_options() -> None:
    def peak(**options) -> float:
        return max(
            planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64, tp=1, pp=4, micro_batch_size=1, **options))
            .details["memory_gib"]
            .values()
        )

    one_f_one_b = peak(recompute="none", zero_stage=0, schedule="1f1b")
    gpipe = peak(recompute="none", zero_stage=0, schedule="gpipe")
    assert gpipe > one_f_one_b  # GPipe holds all 16 micro-batches, 1F1B at most 4
    assert (
        peak(recompute="full", zero_stage=0, schedule="1f1b")
        < peak(recompute="selective", zero_stage=0, schedule="1f1b")
        < one_f_one_b
    )
    assert peak(recompute="none", zero_stage=1, schedule="1f1b") < one_f_one_b
    # Two more warm-up forwards: stage 0 holds 6 micro-batches' activations, not 4.
    assert one_f_one_b < peak(recompute="none", zero_stage=0, schedule="1f1b", extra_warmup=2) < gpipe


@pytest.mark.parametrize(
    "options, message",
    [
        ({"extra_warmup": -1}, r"^strategy.extra_warmup must be an integer of 0 or more, got -1$"),
        ({"extra_warmup": True}, r"^strategy.extra_warmup must be an integer of 0 or more, got True$"),
        ({"extra_warmup": 2, "schedule": "gpipe"}, r"^strategy.extra_warmup=2 deepens 1F1B's warm-up: GPipe runs every forward"),
        ({"extra_warmup": 2, "vpp": 2, "schedule": "interleaved"}, r"^strategy.extra_warmup=2 .* set strategy.vpp=1$"),
        (
            {"extra_warmup": 1, "p2p": "deepspeed", "schedule": "1f1b"},
            r"^strategy.extra_warmup=1 deepens .*\(strategy.p2p=deepspeed\), which a deeper warm-up would wait on forever$",
        ),
    ],
)
def test_a_bad_extra_warmup_is_one_line(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MegatronOptions(**options)


def test_mllm_encoder_and_generator_are_extra_stages_or_merged() -> None:
    model = {"name": "mllm_9b"}
    extra = planner_for("megatron")(request(model, "a800", 8, 64, tp=8, pp=4, micro_batch_size=1, recompute="selective", zero_stage=1))
    assert extra.unit("encoder").details["pipeline_stages"] == [0]
    assert extra.unit("llm").details["pipeline_stages"] == [1, 2]
    assert extra.unit("generator").details["pipeline_stages"] == [3]
    merged = planner_for("megatron")(
        request(model, "a800", 8, 64, tp=8, pp=2, micro_batch_size=1, recompute="selective", zero_stage=1, modality_stages="merged")
    )
    assert merged.unit("encoder").details["pipeline_stages"] == [0]
    assert merged.unit("llm").details["pipeline_stages"] == [0, 1]
    assert merged.unit("generator").details["pipeline_stages"] == [1]
    timeline = simulate(merged.program, build_model(model), request(model, "a800", 8, 64).cluster, "bf16")
    assert timeline.iteration_time > 0
    # Extra stages that leave the devices no whole pipeline: the refusal says what pp counts and the way out.
    line = r"^tp x pp = 8 x 3 = 24 does not divide the cluster's 64 devices \(pp includes 2 stages of the modality units under "
    with pytest.raises(ConfigError, match=line + r"strategy.modality_stages=extra; merged puts them on the LLM's stages\)$"):
        planner_for("megatron")(request(model, "a800", 8, 64, tp=8, pp=3, micro_batch_size=1))


def test_contrastive_models_are_colocated_without_pipelining() -> None:
    plan = planner_for("megatron")(request({"name": "clip"}, "p3_16xlarge", 8, 512))
    assert {u.unit for u in plan.units} == {"vision", "text", "interaction"}
    assert not any(u.sequence_parallel for u in plan.units)  # as DistMM's baseline ran it
    assert len({u.ranks for u in plan.units}) == 1 and len({u.tp for u in plan.units}) == 1
    (everyone,) = plan.program.classes
    gathers = [i for i in everyone.instructions if isinstance(i, Collective) and i.kind == "interaction"]
    assert gathers  # the reduce-scatter of feature gradients; the gather sits in the BatchSync
    with pytest.raises(ConfigError, match="only TP and DP"):
        planner_for("megatron")(request({"name": "clip"}, "p3_16xlarge", 8, 512, pp=2))


def test_lit_runs_no_backward_through_its_locked_tower() -> None:
    plan = planner_for("megatron")(request({"name": "lit"}, "p3_16xlarge", 8, 512))
    (everyone,) = plan.program.classes
    phases = {(i.work.unit, i.work.phase) for i in everyone.instructions if isinstance(i, Compute)}
    assert ("vision", "fwd") in phases and ("vision", "bwd") not in phases and ("vision", "optimizer") not in phases
    assert ("text", "bwd") in phases


def test_errors_name_the_constraint_and_numbers() -> None:
    with pytest.raises(ConfigError, match="tp=3 does not divide the 16 attention heads"):
        planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64, tp=3, pp=1))
    with pytest.raises(ConfigError, match="pp=3 does not divide the 8 blocks"):
        planner_for("megatron")(request(GPT_SMALL, "perlmutter", 3, 64, tp=1, pp=3))
    with pytest.raises(ConfigError, match=r"dp x micro-batch = 16 x 3 = 48"):
        planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64, tp=1, pp=1, micro_batch_size=3))
    with pytest.raises(PlanError, match="short by"):
        planner_for("megatron")(
            request(
                {"name": "gpt", "preset": "gpt_80b"},
                "perlmutter",
                4,
                64,
                tp=4,
                pp=2,
                micro_batch_size=1,
                recompute="full",
                zero_stage=1,
            )
        )
    with pytest.raises(ConfigError, match="unknown strategy option"):
        planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64, tensor_parallel=2))


def test_uneven_stages_differ_by_at_most_one_block() -> None:
    plan = planner_for("megatron")(
        request(GPT_SMALL, "perlmutter", 3, 48, tp=1, pp=3, micro_batch_size=1, uneven_pp=True, recompute="none", zero_stage=0)
    )
    blocks = [end - start for start, end in plan.unit("llm").stage_layers]
    assert sum(blocks) == 10  # 8 blocks + embedding + head
    assert blocks == [3, 4, 3]  # the middle stage takes the extra block; ends carry embedding/head
    assert GIB > 0


# --------------------------------------------------------------------------- the search's space


def test_vpp_and_sequence_parallelism_are_searched_and_kept_when_set() -> None:
    searched = planner_for("megatron")(request(GPT_WIDE, "perlmutter", 2, 16, **SHORT))
    assert searched.details["vpp"] == 4
    assert searched.details["schedule"] == "interleaved" and searched.unit("llm").vpp == 4
    # The best plan splitting the layers over TP ranks runs them sequence-parallel.
    split = [r for r in searched.details["search"]["ranking"] if r["tp"] > 1]
    assert split and split[0]["sequence_parallel"]
    fixed = planner_for("megatron")(request(GPT_WIDE, "perlmutter", 2, 16, vpp=1, sequence_parallel=False, **SHORT))
    assert (fixed.details["vpp"], fixed.details["sequence_parallel"], fixed.details["schedule"]) == (1, False, "1f1b")
    assert not fixed.unit("llm").sequence_parallel
    assert fixed.details["search"]["ranking"][0]["iteration_time_s"] > searched.details["search"]["ranking"][0]["iteration_time_s"]
    with pytest.raises(ConfigError, match="vpp=2 needs the interleaved schedule"):
        planner_for("megatron")(request(GPT_WIDE, "perlmutter", 2, 16, vpp=2, schedule="1f1b"))


# A GPT whose plans compete: on 8 A100-40GB, interleaving and sequence parallelism pay off.
GPT_WIDE = {"name": "gpt", "preset": None, "layers": 8, "hidden": 4096, "heads": 32, "vocab": 32000}
SHORT: dict = {}
# And one on 4 GPUs that needs recomputation to fit.
GPT_TIGHT = {"name": "gpt", "preset": None, "layers": 8, "hidden": 8192, "heads": 64, "vocab": 32000}


def _wide_request(model: dict, nodes: int, batch: int, seq: int, **options) -> PlanRequest:
    cluster_spec = cluster_from_config({**yaml.safe_load((CONF / "cluster" / "perlmutter.yaml").read_text()), "nodes": nodes})
    train = train_from_config({"global_batch": batch, "steps": 1, "seq_len": seq}, cluster_spec)
    return PlanRequest(build_model(model, seq), cluster_spec, train, {"name": "megatron", **options})


@pytest.mark.parametrize(
    "model,nodes,batch,seq",
    # The interleaved space simulates every fitting candidate of 8 GPUs (7 s): the quick tier
    # keeps the 4-GPU space, whose best needs recomputation.
    [pytest.param(GPT_WIDE, 2, 16, 2048, marks=pytest.mark.slow), (GPT_TIGHT, 1, 8, 4096)],
    ids=["interleaved", "recompute"],
)
def test_pruned_search_finds_what_simulating_every_fitting_candidate_finds(model, nodes, batch, seq) -> None:
    req = _wide_request(model, nodes, batch, seq)
    plan = planner_for("megatron")(req)
    opts = MegatronOptions()
    helper = MegatronSearch(req, opts, contrastive=False, searched=True)
    best, simulated = None, 0
    for shape in enumerate_space(req, opts, False, False, True).shapes:
        for step, (recompute, zero) in enumerate(memory_ladder()):
            cfg = MegatronSettings(shape.schedule, recompute, shape.sequence_parallel, zero, False, "extra", False)
            program, units = pipeline_program(
                req.model, req.cluster, batch, req.train.precision, shape.degrees, cfg, helper.virtual_stages(shape, cfg)
            )
            by_unit = {u.unit: u for u in units}
            if (
                max(rank_memory(rp, by_unit, req.model, req.train.precision)["total"] for rp in program.classes)
                > req.cluster.usable_memory_bytes
            ):
                continue
            time = simulate(program, req.model, req.cluster, req.train.precision).iteration_time
            d = shape.degrees
            key = (time, d.tp, d.pp, d.vpp, d.micro_batch, shape.sequence_parallel, step)
            if best is None or key < best[0]:
                best = (key, shape, recompute, zero)
            simulated += 1
    (time, *_), shape, recompute, zero = best
    d = shape.degrees
    assert (
        plan.details["tp"],
        plan.details["pp"],
        plan.details["vpp"],
        plan.details["micro_batch"],
        plan.details["sequence_parallel"],
        plan.details["recompute"],
        plan.details["zero_stage"],
    ) == (d.tp, d.pp, d.vpp, d.micro_batch, shape.sequence_parallel, recompute, zero)
    assert plan.details["search"]["ranking"][0]["iteration_time_s"] == pytest.approx(time, rel=1e-12)
    assert plan.details["search"]["simulated"] < simulated / 5  # the bounds spared most simulations


def _sample_candidates(every: bool):
    """Candidates of every shape the estimator reads: schedules, interleaving, sequence
    parallelism, uneven stages, MLLM stages extra and merged, a balanced cut; under every
    memory setting (a few for the larger models), with and without overlapped gradient
    reduction (`every`), or under one of them per shape, each in turn."""
    all_settings = list(itertools.product(memory_ladder(), (False, True)))
    some = [(("full", 1), True), (("selective", 0), False), (("none", 1), True)]
    gpt = request(GPT_SMALL, "perlmutter", 4, 64)
    mllm = request({"name": "mllm_9b"}, "a800", 8, 16)
    cases = [
        (
            gpt,
            {},
            all_settings,
            [(2, 2, 4, 1, 2, "1f1b"), (2, 2, 4, 2, 1, "interleaved"), (1, 4, 4, 2, 1, "interleaved"), (2, 2, 4, 1, 2, "gpipe")],
        ),
        (request(GPT_SMALL, "perlmutter", 3, 48), {"uneven_pp": True}, all_settings, [(1, 3, 4, 1, 1, "1f1b")]),
        (mllm, {}, some, [(8, 4, 2, 1, 1, "1f1b")]),
        (mllm, {"modality_stages": "merged"}, some, [(8, 2, 4, 2, 1, "interleaved")]),
        (mllm, {"extra_warmup": 2}, some, [(8, 4, 2, 1, 1, "1f1b")]),
        (request(OPTIMUS_SMALL, "hopper", 1, 8), {"balance": True}, some, [(2, 2, 2, 3, 1, "interleaved")]),
    ]
    turn = itertools.count()
    for req, extra, settings, shapes in cases:
        for tp, pp, dp, vpp, mb, schedule in shapes:
            for sp in sorted({False, tp > 1}):
                for (recompute, zero), overlap in settings if every else [settings[next(turn) % len(settings)]]:
                    opts = MegatronOptions(overlap_grad_reduce=overlap, **extra)
                    shape = Shape(Degrees(tp, pp, dp, vpp, mb), sp, schedule)
                    cfg = MegatronSettings(
                        schedule, recompute, sp, zero, overlap, opts.modality_stages, opts.uneven_pp, extra_warmup=opts.extra_warmup
                    )
                    yield req, MegatronSearch(req, opts, contrastive=False, searched=True), shape, cfg


OPTIMUS_SMALL = {"name": "optimus", "encoders": ["vit_3b"], "llm": "gpt_11b"}


# Every memory setting of every shape builds and simulates 114 Programs (4 s): the quick tier
# takes each shape once.
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["each_shape", "every_setting"])
def test_estimated_memory_and_bounds_agree_with_the_built_program(every: bool) -> None:
    checked = 0
    for req, search, shape, cfg in _sample_candidates(every):
        deg = shape.degrees
        virtual = search.virtual_stages(shape, cfg)
        program, units = pipeline_program(req.model, req.cluster, req.train.global_batch, req.train.precision, deg, cfg, virtual)
        by_unit = {u.unit: u for u in units}
        built = [rank_memory(rp, by_unit, req.model, req.train.precision) for rp in program.classes]
        estimated = search.estimator.memory(deg, cfg, virtual)
        for want, got in zip(built, estimated):
            assert got == pytest.approx(want, rel=1e-9), (shape, cfg)
        passes = search.estimator.passes(deg, cfg, virtual)
        time = simulate(program, req.model, req.cluster, req.train.precision).iteration_time
        work = search.estimator.work_bound(deg, cfg)
        stages = search.estimator.quick_bound(deg, cfg, passes)
        path = search.estimator.path_bound(deg, cfg, passes)
        assert work <= stages * (1 + 1e-9) and stages <= path * (1 + 1e-9) and path <= time, (shape, cfg)
        checked += 1
    assert checked == (8 * 12 + 8 * 3 if every else 8 + 8)


@pytest.mark.parametrize("extra", [0, 3])
def test_long_schedules_hold_the_in_flight_counts_of_their_first_rounds(extra) -> None:
    for pp, vpp in [(2, 1), (4, 1), (8, 1), (3, 2), (4, 3), (8, 2)]:
        if extra and vpp > 1:
            continue  # extra warm-up forwards are 1F1B's only (schedules.pipeline)
        schedule = "interleaved" if vpp > 1 else "1f1b"
        for microbatches in range(pp, 12 * pp + 1, pp):
            steady = steady_microbatches(schedule, pp, microbatches, vpp, extra)
            assert steady <= microbatches
            longer = build_schedule(schedule, pp, microbatches, vpp, extra)
            for long, short in zip(longer, build_schedule(schedule, pp, steady, vpp, extra)):
                a, b = live_counts(long, vpp), live_counts(short, vpp)
                assert (set(a.after_forward), set(a.before_backward)) == (set(b.after_forward), set(b.before_backward))


def test_long_searches_report_progress_on_stderr(monkeypatch, capsys) -> None:
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    monkeypatch.setattr(progress, "FIRST_CPU_S", 0.0)  # a task's first line: at once here
    monkeypatch.setattr(progress, "CHECK_EVERY_S", 0.0)
    planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatron search [")]
    assert len(lines) > 2
    assert lines[-1].split(": ", 1)[1].startswith("done: ") and "best tp=" in lines[-1]


# --------------------------------------------------------------------------- Megatron-LM balanced


def _bottleneck(times: list[float], ranges: list[tuple[int, int]]) -> float:
    return max(sum(times[a:b]) for a, b in ranges)


def test_balanced_cut_meets_the_spec_vectors_and_brute_force() -> None:
    assert _bottleneck(list(range(1, 7)), balanced_cuts(list(range(1, 7)), 3)) == 9
    assert _bottleneck(list(range(1, 7)), balanced_cuts(list(range(1, 7)), 2)) == 11
    assert balanced_cuts([5, 1, 1, 1, 1, 5], 3) == [(0, 1), (1, 5), (5, 6)]
    rng = random.Random(7)
    for draw in range(400):
        # Sums of these are exact; of random floats, equal up to rounding.
        exact = draw % 2 == 0
        times = [rng.choice([0.5, 1.0, 2.0, 3.0, 7.0]) if exact else rng.random() for _ in range(rng.randint(1, 9))]
        parts = rng.randint(1, len(times))
        ranges = balanced_cuts(times, parts)
        assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == len(times)
        assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
        best = min(
            _bottleneck(times, list(zip((0,) + cuts, cuts + (len(times),))))
            for cuts in itertools.combinations(range(1, len(times)), parts - 1)
        )
        assert _bottleneck(times, ranges) == (best if exact else pytest.approx(best, rel=1e-12))


def test_balanced_plan_cuts_encoder_and_llm_no_slower_than_the_even_cut() -> None:
    req = request(OPTIMUS_SMALL, "hopper", 1, 8, tp=2, pp=2, vpp=4, micro_batch_size=1, balance=True, balance_by="time")
    plan = planner_for("megatron")(req)
    assert plan.details["balance"] and plan.details["schedule"] == "interleaved"
    encoder, llm = plan.unit("encoder"), plan.unit("llm")
    assert encoder.stage_layers[0][0] == 0 and llm.stage_layers[-1][1] == req.model.unit("llm").num_layers
    for unit in (encoder, llm):  # in model order, the ranges cover the unit once (empty where a stage has none)
        assert len(unit.stage_layers) == unit.pp * unit.vpp
        assert all(a[1] == b[0] for a, b in zip(unit.stage_layers, unit.stage_layers[1:]))
        assert unit.stage_layers[-1][1] == req.model.unit(unit.unit).num_layers
    # The balanced cut moves LLM layers off the stage that also runs the encoder.
    even = pipeline_segments(req.model, 2, 4, "merged", False)
    cfg = MegatronSettings(
        "interleaved", plan.details["recompute"], plan.details["sequence_parallel"], plan.details["zero_stage"], False, "merged", False
    )
    search = MegatronSearch(req, MegatronOptions(balance=True, balance_by="time"), contrastive=False, searched=False)
    deg = Degrees(2, 2, 2, 4, 1)
    times = search.estimator.layer_times(linear_chain(req.model), deg, cfg)
    offsets = {"encoder": 0, "llm": req.model.unit("encoder").num_layers}

    def ranges(virtual) -> list[tuple[int, int]]:
        return [(offsets[v[0].unit] + v[0].layers[0], offsets[v[-1].unit] + v[-1].layers[1]) for v in virtual]

    balanced = ranges(search.virtual_stages(Shape(deg, cfg.sequence_parallel, "interleaved"), cfg))
    assert _bottleneck(times, balanced) < _bottleneck(times, ranges(even))
    # Equal layers are priced equal to the bit, so the cut's ties are the rule's, not rounding's.
    llm = req.model.unit("llm")
    blocks = [t for t, layer in zip(times[offsets["llm"] :], llm.layers) if layer.block]
    assert len(blocks) > 1 and len(set(blocks)) == 1
    assert simulate(plan.program, req.model, req.cluster, req.train.precision).iteration_time > 0


def _chain_ranges(plan, model) -> list[tuple[int, int]]:
    """Each virtual stage's layers along the encoder-then-LLM chain."""
    offset = model.unit("encoder").num_layers
    encoder = list(plan.unit("encoder").stage_layers)
    encoder += [(offset, offset)] * (len(plan.unit("llm").stage_layers) - len(encoder))
    return [(a if b > a else offset + c, offset + d if d > c else b) for (a, b), (c, d) in zip(encoder, plan.unit("llm").stage_layers)]


def test_the_balanced_cut_equalises_layer_flops_as_appendix_b_estimates_them() -> None:
    # Optimus Appendix B: "t_i denotes the execution time of the i-th layer (estimated based on
    # FLOPs)". ViT-3B's layers at 256 tokens are host-bound on TP 2: against a GPT-11B layer a
    # block costs 12x as much in simulated time as in FLOPs, so the two costs cut the chain apart.
    options = dict(tp=2, pp=2, vpp=4, micro_batch_size=1, balance=True)
    by_flops = planner_for("megatron")(request(OPTIMUS_SMALL, "hopper", 1, 8, **options))
    by_time = planner_for("megatron")(request(OPTIMUS_SMALL, "hopper", 1, 8, **options, balance_by="time"))
    model = build_model(OPTIMUS_SMALL)
    assert by_flops.details["balance_by"] == "flops" and by_time.details["balance_by"] == "time"
    recompute = by_flops.details["recompute"]
    flops = [
        layer_flops(model, unit, index).hardware(recompute, model.needs_backward(unit.name))
        for unit in linear_chain(model)
        for index in range(unit.num_layers)
    ]
    assert _chain_ranges(by_flops, model) == balanced_cuts(flops, 8)
    assert _chain_ranges(by_flops, model)[0] == (0, model.unit("encoder").num_layers + 8)  # the whole ViT and 8 LLM layers
    assert _chain_ranges(by_time, model) != _chain_ranges(by_flops, model)


def test_an_unknown_balance_cost_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"strategy.balance_by='seconds'; choose one of \['flops', 'time'\]"):
        planner_for("megatron")(request(OPTIMUS_SMALL, "hopper", 1, 8, balance=True, balance_by="seconds"))
    # A cost for a cut that is not made would be ignored without a word: refused.
    with pytest.raises(ConfigError, match=r"balance_by=time prices the balanced cut.s layers, which only strategy.balance=true"):
        planner_for("megatron")(request(OPTIMUS_SMALL, "hopper", 1, 8, balance_by="time"))


def test_the_balanced_cut_keeps_the_prefix_that_is_fastest_then_most_even_as_alpa_s_dp_does() -> None:
    # Eight light layers and two heavy ones in four ranges: the slowest range is a heavy layer
    # (1) whichever way the light ones split; Alpa's DP takes the most even counts of them.
    assert balanced_cuts([0.1] * 8 + [1, 1], 4) == [(0, 4), (4, 8), (8, 9), (9, 10)]
    # Its prefixes are fastest first: forty light layers and twelve heavy ones in eleven ranges
    # (the slowest two heavy ones together) keep the light ones in one range but the three that
    # join the first heavy one (1.11 and 1.09 against 1.2 and 1), and pair heavy ones only at
    # the end, where a prefix cannot avoid it.
    cuts = balanced_cuts([0.03] * 40 + [1.0] * 12, 11)
    assert [b - a for a, b in cuts] == [37, 4] + [1] * 7 + [2, 2]


def _alpa_recurrence(times: list[float], parts: int) -> list[tuple[int, int]]:
    """Alpa's layer-clustering recurrence, state by state: for the first l layers in s
    ranges the least slowest range, then the least sum of squared counts, the first j."""
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    best: dict[tuple[int, int], tuple[float, float, int]] = {(0, 0): (0.0, 0.0, 0)}
    for s in range(1, parts + 1):
        for end in range(s, len(times) + 1):
            options = [
                (max(best[j, s - 1][0], prefix[end] - prefix[j]), best[j, s - 1][1] + (end - j) ** 2, j)
                for j in range(s - 1, end)
                if (j, s - 1) in best
            ]
            if options:
                best[end, s] = min(options)
    cuts, end = [], len(times)
    for s in range(parts, 0, -1):
        cuts.append((best[end, s][2], end))
        end = cuts[-1][0]
    return cuts[::-1]


def test_the_balanced_cut_is_alpa_s_recurrence_on_random_layers() -> None:
    rng = random.Random(7)
    for _ in range(300):
        times = [rng.choice([0.0, 0.03, 0.5, 1.0, 2.0]) if rng.random() < 0.7 else rng.random() for _ in range(rng.randint(1, 24))]
        parts = rng.randint(1, len(times))
        assert balanced_cuts(times, parts) == _alpa_recurrence(times, parts), (times, parts)


def test_balance_needs_a_linear_chain_of_units() -> None:
    dual = {"name": "optimus", "encoders": ["vit_3b", "vit_5b"], "llm": "gpt_11b"}
    with pytest.raises(ConfigError, match=r"takes a single encoder, but optimus has 2 encoders feeding llm \(encoder0, encoder1\)"):
        planner_for("megatron")(request(dual, "hopper", 2, 16, balance=True))
    with pytest.raises(ConfigError, match="does not pipeline"):
        planner_for("megatron")(request({"name": "clip"}, "p3_16xlarge", 8, 512, balance=True))


def test_an_absurd_batch_is_refused_without_building_its_micro_batches() -> None:
    with pytest.raises(ConfigError, match=rf"is 262144 micro-batches per iteration; the planner builds at most {MAX_MICROBATCHES}"):
        planner_for("megatron")(request(GPT_SMALL, "perlmutter", 1, 2**20, tp=1, pp=1, micro_batch_size=1))
    with pytest.raises(PlanError, match=rf"micro-batches of \d+: the planner builds at most {MAX_MICROBATCHES} per iteration"):
        planner_for("megatron")(request(GPT_SMALL, "perlmutter", 1, 10**9))
