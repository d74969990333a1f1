"""Planners plan within what the backend they plan for runs (PlanRequest.limits): the real
backend runs a U-Net whole on each rank, so with its limits the Megatron-LM search (and
DeepSpeed-3D's, which is the same search) keeps every U-Net on tp=1 and one pipeline
stage, an MLLM's extra modality stages give way to merged ones where no extra-stage layout
is left, DistTrain keeps its generator whole, and a degree given by hand beyond that is one
line; the simulator's plans still cut them."""

from __future__ import annotations

import pytest

from src.errors import ConfigError, PlanError
from src.setup import LIMITS, validate
from src.strategies import PlanRequest, planner_for
from tests.composing import composed

pytestmark = pytest.mark.slow  # a dozen searches: 15-30 s

TINY_UNET = [
    "model=unet",
    "model.preset=null",
    "model.channels=32",
    "model.image_size=8",
    "model.channel_mult=[1,2]",
    "model.res_blocks=1",
    "model.attention_resolutions=[4]",
    "model.heads=2",
    "train.global_batch=8",
    "strategy.micro_batch_size=2",  # a smaller search
]
TINY_MLLM = ["model=mllm_9b", "model.scale=tiny", "model.image_size_spread=0"]


def _plan(overrides: list[str], backend: str):
    setup = validate(composed(["cluster=local", "logger=none", *overrides]))
    strategy = setup.config["strategy"]
    return planner_for(strategy["name"])(PlanRequest(setup.model, setup.cluster, setup.train, strategy, limits=LIMITS[backend]))


def test_a_unet_stays_whole_for_the_real_backend_and_is_cut_for_the_simulator():
    # Where no device holds it whole (5.5 MiB each; whole it needs about 7), the
    # simulator's plan cuts it and the real backend's limits leave no plan: whatever this
    # host's figures (cluster=local takes them from its CPU model's profile), memory decides.
    small = [*TINY_UNET, "strategy=megatron", "cluster.reserved_memory_gib=0", "cluster.memory_gib=0.0055"]
    simulated = _plan(small, "sim").unit("unet")
    assert simulated.pp * simulated.tp > 1
    # A tiny model's need is given to three significant digits, not as 0.0 GiB.
    with pytest.raises(PlanError, match=r"no Megatron-LM plan fits memory .* needs 0\.00[1-9]\d* GiB"):
        _plan(small, "torch")
    for strategy in ("megatron", "deepspeed3d"):
        real = _plan([*TINY_UNET, f"strategy={strategy}"], "torch").unit("unet")
        assert (real.tp, real.pp, real.dp) == (1, 1, 4)


def test_an_mllm_s_generator_stays_on_one_stage_merged_where_extra_stages_leave_none():
    # Encoder, LLM and a whole generator are 3 extra-style stages, which 2 devices do not take.
    real = _plan([*TINY_MLLM, "strategy=megatron", "cluster.devices_per_node=2"], "torch")
    assert real.details["search"]["modality_stages"] == "merged (backend=torch runs no extra-stage layout)"
    assert all((real.unit(u).tp, real.unit(u).pp) == (1, 1) for u in ("encoder", "llm", "generator"))
    # 4 devices take them (the LLM, the backbone, cut in two): the limit leaves the fastest plan as it is.
    simulated, real = (_plan([*TINY_MLLM, "strategy=megatron"], backend) for backend in ("sim", "torch"))
    assert [(u.unit, u.tp, u.pp) for u in real.units] == [(u.unit, u.tp, u.pp) for u in simulated.units]
    assert (real.unit("generator").pp, real.unit("llm").pp) == (1, 2) and "modality_stages" not in real.details["search"]


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            [*TINY_UNET, "strategy=megatron", "strategy.tp=1", "strategy.pp=2"],
            "unit unet is a U-Net cut over 2 pipeline stages (its skip connections do not cross stages there): "
            "backend=torch runs a U-Net whole on each rank (it needs tp=1 and one pipeline stage, pp=1)",
        ),
        (
            [*TINY_UNET, "strategy=megatron", "strategy.tp=2", "strategy.pp=1"],
            "unit unet is a U-Net on tp=2 (its convolutions have no TP there): backend=torch runs a U-Net whole "
            "on each rank (it needs tp=1 and one pipeline stage, pp=1)",
        ),
        (
            [*TINY_MLLM, "strategy=disttrain", "strategy.generator.pp=2"],
            "unit generator is a U-Net cut over 2 pipeline stages (its skip connections do not cross stages there): "
            "backend=torch runs a U-Net whole on each rank (it needs tp=1 and one pipeline stage, pp=1)",
        ),
    ],
)
def test_a_unet_split_by_hand_is_one_line_for_the_real_backend(overrides, line):
    with pytest.raises(ConfigError) as refused:
        _plan(overrides, "torch")
    assert str(refused.value) == line
