"""The DistMM planner end to end: partitioner, balancer, placement and pipelines on the
paper's models, its switches, and the errors a user gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from src.errors import ConfigError, PlanError
from src.program import Collective, Compute, Recv
from src.setup import Setup, plan_run, validate
from src.sim.engine import simulate
from src.strategies.distmm.towers import partition
from tests.composing import composed

ROOT = Path(__file__).resolve().parents[3]
# A tiny pipelined case that runs in milliseconds: both towers cut in two stages, four
# batch-sync groups of 8 samples.
TINY_PIPE = [
    "model=clip",
    "model.scale=tiny",
    "cluster=local",
    "strategy.vision.pp=2",
    "strategy.text.pp=2",
    "train.global_batch=32",
    "train.contrastive_batch=8",
]


def setup(*overrides: str) -> Setup:
    return validate(composed(["strategy=distmm", "logger=none", *overrides]))


def iteration(s: Setup, plan) -> float:
    return simulate(plan.program, s.model, s.cluster, s.train.precision).iteration_time


def towers(plan) -> dict:
    return {u.unit: u for u in plan.units if u.unit != "interaction"}


def test_partitioner_follows_the_model_size() -> None:
    s = setup("model=clip", "model.scale=single_node")
    vision, text = s.model.unit("vision"), s.model.unit("text")
    # CLIP(6.7B, 2.7B): the text tower needs TP 4 inside a node, the vision tower TP 8
    # (Figure 8: Megatron's TP 8 for both over-partitions the text tower).
    assert partition(text, s.cluster, "fp16").devices == 4
    assert (partition(vision, s.cluster, "fp16").tp, partition(vision, s.cluster, "fp16").pp) == (8, 1)
    small = setup("model=clip")
    assert partition(small.model.unit("vision"), small.cluster, "fp16").devices == 1
    big = setup("model=clip", "model.scale=multi_node")
    degrees = partition(big.model.unit("vision"), big.cluster, "fp16")
    assert (degrees.tp, degrees.pp) == (8, 2)  # beyond a node: pipeline across nodes


def test_default_plan_separates_the_towers_and_balances_them() -> None:
    s = setup("model=clip", "train.global_batch=576")
    plan = plan_run(s)
    by_unit = towers(plan)
    vision, text = by_unit["vision"], by_unit["text"]
    assert set(vision.ranks).isdisjoint(text.ranks)
    assert len(vision.ranks) + len(text.ranks) == 64  # the balancer fills the cluster
    for unit in (vision, text):
        assert unit.dp * unit.batch_per_replica == 576
        assert unit.details["placement"] == "separate"
    # Device counts that are whole nodes keep the modalities on separate nodes.
    assert not set(vision.details["nodes"].split(",")) & set(text.details["nodes"].split(","))
    # The cheaper (text) tower takes the larger per-replica batch (Figure 9).
    assert text.batch_per_replica > vision.batch_per_replica
    assert max(plan.details["memory_gib"].values()) <= s.cluster.usable_memory_bytes / 2**30


def test_balancer_beats_an_even_split() -> None:
    balanced = setup("model=clip", "train.global_batch=576")
    even = setup("model=clip", "train.global_batch=576", "strategy.balance=even")
    assert iteration(balanced, plan_run(balanced)) < iteration(even, plan_run(even))
    assert towers(plan_run(even))["vision"].dp == 32


def test_fixed_degrees_are_kept() -> None:
    s = setup("model=clip", "model.scale=single_node", "train.global_batch=192", "strategy.text.tp=8", "strategy.text.dp=2")
    text = towers(plan_run(s))["text"]
    assert (text.tp, text.dp) == (8, 2)
    with pytest.raises(ConfigError, match="heads"):
        plan_run(setup("model=clip", "strategy.text.tp=3"))
    with pytest.raises(ConfigError, match=r"unknown strategy.text option\(s\) \['vpp'\]"):
        plan_run(setup("model=clip", "+strategy.text.vpp=2"))
    with pytest.raises(ConfigError, match="strategy.text.dp must be a positive integer or null, got 0"):
        plan_run(setup("model=clip", "strategy.text.dp=0"))


def interactions(plan) -> list[Compute]:
    return [i for rp in plan.program.classes for i in rp.instructions if isinstance(i, Compute) and i.work.phase == "interaction"]


def test_separate_placement_scores_against_one_modality_and_naive_both() -> None:
    separate = plan_run(setup("model=clip", "train.global_batch=576"))
    naive = plan_run(setup("model=clip", "train.global_batch=576", "strategy.placement=naive"))
    # A scorer of separate towers reads its own rows and the OTHER modality's batch only.
    for compute in interactions(separate):
        (mine,) = [p for p in compute.inputs if p.tensor.endswith(".q")]
        (theirs,) = [p for p in compute.inputs if p.tensor.endswith(".k")]
        assert mine.tensor.split(".")[0] != theirs.tensor.split(".")[0]
    # Naive placement gathers both modalities' features on every device.
    for compute in interactions(naive):
        assert sorted(p.tensor for p in compute.inputs if p.tensor.endswith(".k")) == ["text.k", "vision.k"]
    assert naive.details["placement"] == "naive"
    assert all(len(u.ranks) == 64 for u in naive.units)
    with pytest.raises(PlanError, match="pp=2"):
        plan_run(setup("model=clip", "model.scale=multi_node", "train.global_batch=48", "strategy.placement=naive"))


def test_separate_placement_reduces_gradient_traffic() -> None:
    # §5.3.2: each node's links carry one tower's gradients instead of both towers'.
    separate = setup("model=coca", "train.global_batch=576", "strategy.balance=even")
    naive = setup("model=coca", "train.global_batch=576", "strategy.placement=naive")

    def comm_dp(s: Setup) -> float:
        plan = plan_run(s)
        return simulate(plan.program, s.model, s.cluster, s.train.precision).mean_breakdown()["comm_dp"]

    assert comm_dp(separate) < comm_dp(naive)


def test_pipeline_never_shrinks_the_contrastive_batch() -> None:
    for schedule in ("distmm_pipe", "gpipe_sync"):
        s = setup(*TINY_PIPE, f"strategy.pipeline={schedule}")
        plan = plan_run(s)
        for unit in towers(plan).values():
            assert unit.pp == 2
        computes = interactions(plan)
        assert all(c.work.contrastive_batch == 8 for c in computes)
        assert len(computes) == 2 * 4  # two towers' last stages, four groups each
        # Every key batch a scorer receives is the whole contrastive batch of its group.
        route = plan.program.route("batch_sync")
        for rp in plan.program.classes:
            for recv in (i for i in rp.instructions if isinstance(i, Recv) and i.payload.tensor.endswith(".k")):
                for rank in rp.ranks:
                    rows = sorted(m.received.rows for m in route.receives(rank, recv.payload))
                    assert rows[0][0] == 0 and rows[-1][1] == 8
                    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))


def test_distmm_pipe_removes_the_barrier_idle_time() -> None:
    # The preset's own figures, not a measured host's: where workers share cores, one idle at
    # the barrier lends its core to the others, which hides part of what the schedule saves.
    pipe = setup(*TINY_PIPE, "cluster.profile=null")
    gpipe = setup(*TINY_PIPE, "cluster.profile=null", "strategy.pipeline=gpipe_sync")
    t_pipe, t_gpipe = iteration(pipe, plan_run(pipe)), iteration(gpipe, plan_run(gpipe))
    assert t_pipe < 0.8 * t_gpipe


def test_coca_moves_image_tokens_between_towers() -> None:
    s = setup("model=coca", "train.global_batch=576")
    plan = plan_run(s)
    assert {route.kind for route in plan.program.routes.values()} == {"interaction", "broker"}
    timeline = simulate(plan.program, s.model, s.cluster, s.train.precision)
    assert timeline.mean_breakdown()["comm_broker"] > 0


@pytest.mark.parametrize("model", ["clip", "coca", "lit"])
@pytest.mark.parametrize("scale,batch", [("single_device", "512"), ("single_node", "192"), ("multi_node", "48")])
def test_every_model_plans_and_simulates(model: str, scale: str, batch: str) -> None:
    # The batches of sweeps/distmm_fig7_end_to_end.yaml (two batch-sync groups at multi-node).
    extra = ["train.contrastive_batch=24"] if scale == "multi_node" else []
    s = setup(f"model={model}", f"model.scale={scale}", f"train.global_batch={batch}", *extra)
    plan = plan_run(s)
    assert plan.devices == 64
    assert iteration(s, plan) > 0
    if scale == "multi_node":
        assert max(u.pp for u in towers(plan).values()) > 1  # beyond a node: pipelines


@pytest.mark.parametrize("model", ["clip", "coca", "lit"])
def test_tiny_plans_on_the_local_cluster(model: str) -> None:
    s = setup(f"model={model}", "model.scale=tiny", "cluster=local", "train.global_batch=16")
    assert iteration(s, plan_run(s)) > 0


def test_global_batch_must_hold_whole_contrastive_batches() -> None:
    with pytest.raises(ConfigError, match="contrastive batch 100"):
        plan_run(setup("model=clip", "train.global_batch=512", "train.contrastive_batch=100"))


@pytest.mark.slow
def test_a_tower_larger_than_the_cluster_exits_2_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "src.run",
            "model=clip",
            "model.scale=multi_node",
            "cluster=local",
            "strategy=distmm",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "tower vision" in lines[0] and "short by" in lines[0]
    assert not (tmp_path / "summary.json").exists()


def test_the_batch_sync_grows_linearly_with_the_devices() -> None:
    # Two all-to-alls over every scorer per batch-sync group (features, gradients), and
    # routes that only reach a scorer's TP peers: O(devices), not every scorer to every
    # replica of the other tower.
    sizes = {}
    for nodes in (4, 16):
        s = setup("model=clip", "cluster=dgx_a100", f"cluster.nodes={nodes}", "train.global_batch=576")
        plan = plan_run(s)
        scorers = len(plan.unit("interaction").ranks)
        messages = sum(len(plan.program.route(name).table) for name in ("batch_sync", "batch_sync.grad"))
        assert messages <= 2 * scorers  # one local copy and one gradient per scorer (tp 1, one group)
        collectives = [
            i
            for rp in plan.program.classes
            for i in rp.instructions
            if isinstance(i, Collective) and i.group == "interaction" and i.op != "all_reduce"
        ]
        assert {i.op for i in collectives} == {"all_to_all"}
        sizes[nodes] = scorers
        assert iteration(s, plan) > 0
    assert sizes[16] > 2 * sizes[4]
