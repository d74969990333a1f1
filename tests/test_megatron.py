"""The Megatron-LM baseline planner: fixed and searched plans, memory, multimodal stages."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from src.cluster import GIB, cluster_from_config
from src.config import train_from_config
from src.errors import ConfigError, PlanError
from src.models.registry import build_model
from src.program import Collective, Compute, Recv, Send
from src.sim.engine import simulate
from src.strategies import PlanRequest, planner_for

CONF = Path(__file__).resolve().parent.parent / "conf"


def request(model: dict, cluster: str, nodes: int, batch: int, **options) -> PlanRequest:
    cluster_spec = cluster_from_config({**yaml.safe_load((CONF / "cluster" / f"{cluster}.yaml").read_text()),
                                        "nodes": nodes})
    train = train_from_config({"global_batch": batch, "steps": 1}, cluster_spec)
    return PlanRequest(build_model(model), cluster_spec, train, {"name": "megatron", **options})


GPT_SMALL = {"name": "gpt", "preset": None, "layers": 8, "hidden": 1024, "heads": 16, "vocab": 32000}


def test_fixed_degrees_are_respected_and_the_program_is_a_pipeline() -> None:
    plan = planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64, tp=2, pp=2, vpp=1, micro_batch_size=2,
                                           recompute="none", zero_stage=0, sequence_parallel=False))
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


def test_search_returns_the_fastest_plan_that_fits() -> None:
    plan = planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64))
    search = plan.details["search"]
    assert search["searched"] and search["fitting"] >= 2
    times = [c["iteration_time_s"] for c in search["ranking"]]
    assert times == sorted(times)
    best = search["ranking"][0]
    assert (plan.details["tp"], plan.details["pp"], plan.details["micro_batch"]) == (best["tp"], best["pp"],
                                                                                    best["micro_batch"])
    assert max(plan.details["memory_gib"].values()) <= 40 - 1.5


def test_memory_follows_the_schedule_and_the_memory_options() -> None:
    def peak(**options) -> float:
        return max(planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64, tp=1, pp=4, micro_batch_size=1,
                                                   **options)).details["memory_gib"].values())
    one_f_one_b = peak(recompute="none", zero_stage=0, schedule="1f1b")
    gpipe = peak(recompute="none", zero_stage=0, schedule="gpipe")
    assert gpipe > one_f_one_b  # GPipe holds all 16 micro-batches, 1F1B at most 4
    assert peak(recompute="full", zero_stage=0, schedule="1f1b") < \
        peak(recompute="selective", zero_stage=0, schedule="1f1b") < one_f_one_b
    assert peak(recompute="none", zero_stage=1, schedule="1f1b") < one_f_one_b


def test_mllm_encoder_and_generator_are_extra_stages_or_merged() -> None:
    model = {"name": "mllm_9b"}
    extra = planner_for("megatron")(request(model, "a800", 8, 64, tp=8, pp=4, micro_batch_size=1,
                                            recompute="selective", zero_stage=1))
    assert extra.unit("encoder").details["pipeline_stages"] == [0]
    assert extra.unit("llm").details["pipeline_stages"] == [1, 2]
    assert extra.unit("generator").details["pipeline_stages"] == [3]
    merged = planner_for("megatron")(request(model, "a800", 8, 64, tp=8, pp=2, micro_batch_size=1,
                                             recompute="selective", zero_stage=1, modality_stages="merged"))
    assert merged.unit("encoder").details["pipeline_stages"] == [0]
    assert merged.unit("llm").details["pipeline_stages"] == [0, 1]
    assert merged.unit("generator").details["pipeline_stages"] == [1]
    timeline = simulate(merged.program, build_model(model), request(model, "a800", 8, 64).cluster, "bf16")
    assert timeline.iteration_time > 0


def test_contrastive_models_are_colocated_without_pipelining() -> None:
    plan = planner_for("megatron")(request({"name": "clip"}, "p3_16xlarge", 8, 512))
    assert {u.unit for u in plan.units} == {"vision", "text", "interaction"}
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
        planner_for("megatron")(request({"name": "gpt", "preset": "gpt_80b"}, "perlmutter", 4, 64, tp=4, pp=2,
                                        micro_batch_size=1, recompute="full", zero_stage=1))
    with pytest.raises(ConfigError, match="unknown strategy option"):
        planner_for("megatron")(request(GPT_SMALL, "perlmutter", 4, 64, tensor_parallel=2))


def test_uneven_stages_differ_by_at_most_one_block() -> None:
    plan = planner_for("megatron")(request(GPT_SMALL, "perlmutter", 3, 48, tp=1, pp=3, micro_batch_size=1,
                                           uneven_pp=True, recompute="none", zero_stage=0))
    blocks = [end - start for start, end in plan.unit("llm").stage_layers]
    assert sum(blocks) == 10  # 8 blocks + embedding + head
    assert blocks == [3, 4, 3]  # the middle stage takes the extra block; ends carry embedding/head
    assert GIB > 0
