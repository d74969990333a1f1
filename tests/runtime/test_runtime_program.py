"""Without processes: how a rank sees its class's program (groups, peers), what it
places, and that the ddp planner plans in the simulator."""

from __future__ import annotations

import pytest

from src.cluster import cluster_from_config
from src.config import train_from_config
from src.errors import ConfigError
from src.models.registry import build_model
from src.program import Payload
from src.runtime.placement import placements
from src.sim.engine import simulate
from src.strategies import PlanRequest, planner_for
from tests.runtime.support import composed


def _plan(overrides: list[str]):
    config = composed(overrides)
    cluster = cluster_from_config(config["cluster"])
    train = train_from_config(config["train"], cluster)
    model = build_model(config["model"], train.seq_len)
    plan = planner_for(config["strategy"]["name"])(PlanRequest(model, cluster, train, config["strategy"]))
    return plan, model, cluster, train


GPT = [
    "model=gpt",
    "model.preset=null",
    "model.layers=4",
    "model.hidden=64",
    "model.heads=4",
    "model.vocab=128",
    "train.seq_len=16",
    "cluster=local",
    "cluster.devices_per_node=8",
    "train.global_batch=16",
]


def test_every_rank_of_a_class_maps_groups_and_peers_onto_itself():
    # tp=2 x dp=2 x pp=2: rank = t + 2·(d + 2·p); the class "stage 0" is written for rank 0.
    plan, *_ = _plan(GPT + ["strategy=megatron", "strategy.tp=2", "strategy.pp=2", "strategy.vpp=1", "strategy.micro_batch_size=2"])
    program = plan.program
    assert program.group_for("tp.s0", 3) == (2, 3)
    assert program.group_for("dp.s0", 3) == (1, 3)
    assert program.group_for("dp.s1", 6) == (4, 6)
    hop = program.route("hop.v0")
    assert [m.dst for m in hop.sends(3, Payload("llm", 3, 0))] == [7]  # t=1, d=1 of stage 1
    assert [m.src for m in hop.receives(3, Payload("llm", 3, 0, grad=True))] == [7]
    place = placements(plan, 7)["llm"]
    assert place.tp_ranks == (6, 7) and place.dp_ranks == (5, 7) and max(place.layers) == plan.unit("llm").stage_layers[1][1] - 1


def test_ddp_plans_in_the_simulator_with_zero3_gathering_every_layer():
    base = ["model=clip", "model.scale=tiny", "strategy=ddp", "cluster=local", "train.global_batch=8"]
    times = {}
    for zero, threshold in ((0, 0), (3, 0), (3, 100_000)):
        plan, model, cluster, train = _plan(
            base + [f"strategy.zero_stage={zero}", f"strategy.param_persistence_threshold={threshold}"]
        )
        gathers = [i for i in plan.program.classes[0].instructions if getattr(i, "op", None) == "all_gather" and i.kind == "dp"]
        layers = sum(u.num_layers for u in model.units if u.name != "interaction")
        # Before each layer's forward and backward; under DeepSpeed's default threshold every
        # tensor of the tiny model stays whole on every rank: nothing to gather.
        assert len(gathers) == (2 * layers if (zero, threshold) == (3, 0) else 0)
        times[zero, threshold] = simulate(plan.program, model, cluster, train.precision).iteration_time
    assert times[3, 0] > times[3, 100_000] and times[3, 0] > times[0, 0]


def test_ddp_refuses_a_batch_that_does_not_split_over_the_devices():
    with pytest.raises(ConfigError, match="global batch 6 is not divisible by dp=4"):
        _plan(["model=clip", "model.scale=tiny", "strategy=ddp", "cluster=local", "train.global_batch=6"])
