"""Megatron-LM with a unit replicated over its stage's TP group (strategy.replicate;
DistTrain §2.1 and §8.1: the encoder and generator whole on each GPU of the TP group, each on
different images, "whereas TP itself is not used"): its Program runs no TP collective for the
unit and reduces its gradients over TP x DP ranks, the memory model holds its whole
parameters per GPU, the estimator agrees with the built Program, and the option's
refusals name the unit."""

from __future__ import annotations

import itertools

import pytest

from src.cluster import GIB
from src.costmodel.memory import rank_memory
from src.errors import ConfigError
from src.program import Collective, Compute, Plan, RankProgram, Send
from src.sim.engine import simulate
from src.strategies import planner_for
from src.strategies.base import Degrees
from src.strategies.builders.stages import replicated_rows
from src.strategies.megatron.options import MegatronOptions
from src.strategies.megatron.programs import MegatronSettings, pipeline_program
from src.strategies.megatron.search import MegatronSearch
from src.strategies.megatron.space import Shape
from tests.strategies.megatron.test_megatron import GPT_SMALL, request

REPLICATE = ["encoder", "generator"]
FIXED = {"tp": 8, "pp": 4, "micro_batch_size": 2, "vpp": 1, "recompute": "selective", "zero_stage": 1}


def plan_9b(images: int = 1, **options) -> Plan:
    """MLLM-9B on 64 A800s, batch 32: encoder | LLM | LLM | generator, tp 8, dp 2."""
    return planner_for("megatron")(request({"name": "mllm_9b", "images_per_sequence": images}, "a800", 8, 32, **{**FIXED, **options}))


def stage(plan: Plan, unit: str) -> RankProgram:
    return next(rp for rp in plan.program.classes if rp.units == (unit,))


def collectives(plan: Plan, rank_program: RankProgram, kind: str) -> list[Collective]:
    return [i for i in rank_program.instructions if isinstance(i, Collective) and i.kind == kind]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_replicated_unit_runs_whole_on_its_rows_share_and_reduces_over_tp_and_dp(sequence_parallel) -> None:
    tp_plan = plan_9b(sequence_parallel=sequence_parallel)
    plan = plan_9b(sequence_parallel=sequence_parallel, replicate=REPLICATE)
    for name in REPLICATE:
        unit = plan.unit(name)
        assert unit.mesh.axes == (("rows", 8), ("dp", 2), ("pp", 1)) and (unit.tp, unit.data_replicas) == (1, 16)
        assert unit.ranks == tp_plan.unit(name).ranks and not unit.sequence_parallel
        ranks = stage(plan, name)
        assert collectives(tp_plan, stage(tp_plan, name), "tp") and not collectives(plan, ranks, "tp")
        works = [i.work for i in ranks.instructions if isinstance(i, Compute) and i.work.phase != "optimizer"]
        # Micro-batches of 2 sequences of one image over 8 ranks: the busiest rank runs one.
        assert {(w.sharding.devices, w.samples, w.fraction) for w in works} == {(1, 1, 1.0)}
        reductions = collectives(plan, ranks, "dp")
        assert [c.op for c in reductions] == ["reduce_scatter", "all_gather"]
        assert {plan.program.groups[c.group].ranks for c in reductions} == {unit.ranks}  # all 16 of the stage
        assert not [c for c in collectives(plan, ranks, "pp")]  # it gathers nothing: it runs its own rows
    # The LLM's stages keep TP and all-gather what crosses their boundary with a replicated
    # stage: the encoder's rows and the generator's gradients as they arrive, and under
    # sequence parallelism (holding their tokens of every row) what they send it; between
    # each other, the scattered transfer's gathers without sequence parallelism, none with.
    llm = plan.unit("llm")
    assert llm.mesh.axes == (("tp", 8), ("dp", 2), ("pp", 2))
    for rank_program in (rp for rp in plan.program.classes if rp.units == ("llm",)):
        assert len(collectives(plan, rank_program, "pp")) == 2 * llm.num_microbatches
        for send in (i for i in rank_program.instructions if isinstance(i, Send)):
            assert plan.program.route(send.route).scatter or sequence_parallel  # each TP rank sends its rows


def test_the_simulator_prices_the_busiest_rank_s_share_of_a_micro_batch_s_images() -> None:
    # 10 images per sequence: micro-batches of 2 hold 20 images, 3 on the busiest of 8 ranks.
    plan = plan_9b(images=10, replicate=REPLICATE)
    works = {i.work for i in stage(plan, "encoder").instructions if isinstance(i, Compute) and i.work.phase == "fwd"}
    ((samples, fraction),) = {(w.samples, w.fraction) for w in works}
    assert samples == 2 and fraction == pytest.approx(3 / 20)
    encoder = request({"name": "mllm_9b", "images_per_sequence": 10}, "a800", 8, 32).model.unit("encoder")
    assert replicated_rows(encoder, 2, 8) == pytest.approx(3 / 20)
    assert replicated_rows(encoder, 4, 8) == 5 / 40  # divides evenly: 5 images each
    single = request({"name": "mllm_9b"}, "a800", 8, 32).model.unit("encoder")
    assert replicated_rows(single, 1, 8) == 1.0  # fewer rows than ranks: one runs it all, the others idle
    hop = plan.program.route("hop.v0")  # each encoder rank hands on its share: 3 of 20 images' tokens
    whole = 10 * 256 * 4096 * 2 * 2
    assert hop.bytes == pytest.approx(whole * 3 / 20)


def test_a_replicated_stage_spends_nothing_on_tp_communication() -> None:
    # TP 8 on SD-2.1's narrow U-Net runs tiny GEMMs and all-reduces every block's output.
    tp_plan, plan = plan_9b(images=10), plan_9b(images=10, replicate=REPLICATE)
    cluster = request({"name": "mllm_9b"}, "a800", 8, 32).cluster
    model = request({"name": "mllm_9b", "images_per_sequence": 10}, "a800", 8, 32).model
    tp_time = simulate(tp_plan.program, model, cluster, "bf16")
    time = simulate(plan.program, model, cluster, "bf16")
    generator = [r for r in time.ranks if r.ranks == stage(plan, "generator").ranks][0]
    tp_generator = [r for r in tp_time.ranks if r.ranks == stage(tp_plan, "generator").ranks][0]
    assert generator.breakdown["comm_tp"] == 0 < tp_generator.breakdown["comm_tp"]
    assert time.iteration_time < tp_time.iteration_time


def test_the_memory_model_holds_a_replicated_unit_s_parameters_whole_on_every_gpu() -> None:
    model = request({"name": "mllm_9b"}, "a800", 8, 32).model
    for zero_stage, shards in ((0, 1), (1, 16)):
        tp_plan = plan_9b(zero_stage=zero_stage)
        plan = plan_9b(zero_stage=zero_stage, replicate=REPLICATE)
        units = {u.unit: u for u in plan.units}
        for name in REPLICATE:
            params = model.unit(name).params
            trainable = model.unit(name).trainable_params(0, model.unit(name).num_layers)
            memory = rank_memory(stage(plan, name), units, model, "bf16")
            tp_memory = rank_memory(stage(tp_plan, name), {u.unit: u for u in tp_plan.units}, model, "bf16")
            assert memory["weights"] == pytest.approx(2 * params) == pytest.approx(8 * tp_memory["weights"])
            assert memory["grads"] == pytest.approx(4 * trainable)
            assert memory["optimizer"] == pytest.approx(12 * trainable / shards)
        encoder = rank_memory(stage(plan, "encoder"), units, model, "bf16")["total"]
        assert plan.details["memory_gib"]["stage 0"] == pytest.approx(encoder / GIB, abs=1e-3)


SETTINGS = list(itertools.product((1, 10), (False, True), (("none", 0), ("selective", 1), ("full", 1)), (False, True)))


# The 24 settings build and simulate 24 Programs (3.5 s): the quick tier takes every fifth,
# which still sets each of images, sequence parallelism, memory and overlap both ways.
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["every_fifth", "every_setting"])
def test_estimated_memory_and_bounds_agree_with_the_built_program_of_replicated_stages(every: bool) -> None:
    checked = 0
    for images, sp, (recompute, zero), overlap in SETTINGS if every else SETTINGS[::5]:
        req = request({"name": "mllm_9b", "images_per_sequence": images}, "a800", 8, 16)
        opts = MegatronOptions(overlap_grad_reduce=overlap, replicate=tuple(REPLICATE))
        search = MegatronSearch(req, opts, contrastive=False, searched=True)
        shape = Shape(Degrees(8, 4, 2, 1, 1), sp, "1f1b")
        cfg = MegatronSettings("1f1b", recompute, sp, zero, overlap, "extra", False, True, tuple(REPLICATE))
        virtual = search.virtual_stages(shape, cfg)
        program, units = pipeline_program(req.model, req.cluster, 16, req.train.precision, shape.degrees, cfg, virtual)
        by_unit = {u.unit: u for u in units}
        built = [rank_memory(rp, by_unit, req.model, req.train.precision) for rp in program.classes]
        for want, got in zip(built, search.estimator.memory(shape.degrees, cfg, virtual)):
            assert got == pytest.approx(want, rel=1e-9), (images, sp, recompute, zero, overlap)
        passes = search.estimator.passes(shape.degrees, cfg, virtual)
        time = simulate(program, req.model, req.cluster, req.train.precision).iteration_time
        stages = search.estimator.quick_bound(shape.degrees, cfg, passes)
        path = search.estimator.path_bound(shape.degrees, cfg, passes)
        assert stages <= path * (1 + 1e-9) and path <= time, (images, sp, recompute, zero, overlap)
        checked += 1
    assert checked == (24 if every else 5)


def test_without_replicate_the_plan_is_unchanged() -> None:
    assert plan_9b(replicate=[]).program == plan_9b().program
    assert plan_9b(tp=1, pp=4, replicate=REPLICATE, micro_batch_size=1).program == plan_9b(tp=1, pp=4, micro_batch_size=1).program


@pytest.mark.parametrize(
    "options, message",
    [
        ({"replicate": ["vision"]}, r"replicate=\['vision'\]: mllm_9b has no unit 'vision' \(its units: encoder, llm, generator\)"),
        ({"replicate": ["llm"]}, r"llm is cut into the pipeline's stages; only a unit on a stage of its own.* \(encoder, generator\)"),
        (
            {"replicate": ["encoder"], "modality_stages": "merged", "pp": 2},
            r"which strategy.modality_stages=merged does not give them \(it needs strategy.modality_stages=extra\)",
        ),
        ({"replicate": ["encoder", "encoder"]}, r"takes unit names, each once, got \['encoder', 'encoder'\]"),
    ],
)
def test_replicate_refuses_what_is_no_stage_of_its_own_in_one_line(options, message) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        plan_9b(**options)
    assert "\n" not in str(refused.value)


def test_replicate_refuses_contrastive_models_and_the_balanced_cut() -> None:
    with pytest.raises(ConfigError, match=r"contrastive models \(clip\) has no pipeline stages"):
        planner_for("megatron")(request({"name": "clip"}, "p3_16xlarge", 8, 512, replicate=["vision"]))
    with pytest.raises(ConfigError, match=r"strategy.balance=true does not give them"):
        planner_for("megatron")(request(GPT_SMALL, "perlmutter", 1, 8, replicate=["llm"], balance=True))
