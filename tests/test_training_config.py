"""backend.deepspeed and backend.contrastive: the config group's defaults typed, every value
checked at the door in one line."""

from __future__ import annotations

import pytest

from src.config import (
    ContrastiveSpec,
    DeepSpeedSpec,
    LossScaleSpec,
    OptimizerSpec,
    SchedulerSpec,
    backend_from_config,
    contrastive_from_config,
    deepspeed_from_config,
)
from src.errors import ConfigError
from tests.composing import composed


def _backend(*overrides: str):
    spec = backend_from_config(composed(["backend=torch", *overrides])["backend"])
    assert spec is not None
    return spec


def test_the_config_group_s_defaults_are_the_typed_defaults() -> None:
    backend = _backend()
    assert backend.deepspeed == DeepSpeedSpec()
    assert backend.contrastive == ContrastiveSpec()
    # OpenCLIP's defaults: logit scale at most 100, CoCa's caption loss weighed 2 : 1, padding 0.
    assert (backend.contrastive.logit_scale_max, backend.contrastive.caption_loss_weight) == (100.0, 2.0)
    assert (backend.contrastive.contrastive_loss_weight, backend.contrastive.pad_id) == (1.0, 0)
    assert backend.deepspeed.optimizer.no_decay == ("bias", "norm", "logit_scale")


def test_command_line_settings_reach_the_typed_section() -> None:
    backend = _backend(
        "backend.deepspeed.optimizer.type=SGD",
        "backend.deepspeed.optimizer.params.lr=0.1",
        "backend.deepspeed.optimizer.params.momentum=0.9",
        "backend.deepspeed.optimizer.no_decay=[bias]",
        "backend.deepspeed.scheduler.type=WarmupCosineLR",
        "backend.deepspeed.scheduler.params.warmup_num_steps=10",
        "backend.deepspeed.scheduler.params.warmup_type=linear",
        "backend.deepspeed.gradient_clipping=1.0",
        "backend.deepspeed.fp16.initial_scale_power=12",
        "backend.contrastive.pad_id=null",
    )
    assert backend.deepspeed == DeepSpeedSpec(
        optimizer=OptimizerSpec(type="SGD", lr=0.1, momentum=0.9, no_decay=("bias",)),
        scheduler=SchedulerSpec("WarmupCosineLR", {"warmup_num_steps": 10, "warmup_type": "linear"}),
        gradient_clipping=1.0,
        fp16=LossScaleSpec(initial_scale_power=12),
    )
    assert backend.contrastive.pad_id is None
    assert backend.deepspeed.optimizer.params() == {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}


@pytest.mark.parametrize(
    "section, message",
    [
        ({"optimizer": {"type": "Lamb"}}, r"optimizer.type='Lamb': the real backend builds AdamW, Adam, SGD"),
        ({"optimizer": {"params": {"lr": 0}}}, r"optimizer.params.lr must be a number > 0, got 0"),
        ({"optimizer": {"params": {"betas": [0.9]}}}, r"optimizer.params.betas must be two numbers in \[0, 1\)"),
        ({"optimizer": {"params": {"momentum": 0.9}}}, r"params.momentum=0.9: AdamW takes no momentum"),
        ({"optimizer": {"type": "SGD", "params": {"eps": 1.0}}}, r"params.eps=1.0: SGD takes no eps"),
        ({"optimizer": {"no_decay": ["embedding"]}}, r"optimizer.no_decay must be a list of \['bias', 'norm', 'logit_scale'\]"),
        ({"optimizer": {"params": {"beta": 0.9}}}, r"unknown backend.deepspeed.optimizer.params key\(s\) \['beta'\]"),
        ({"scheduler": {"type": "OneCycle"}}, r"scheduler.type='OneCycle'; choose one of DeepSpeed's"),
        ({"scheduler": {"params": {"warmup_num_steps": 5}}}, r"sets \['warmup_num_steps'\] but .*scheduler.type is null"),
        ({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}}, r"WarmupLR takes no \['cos_min_ratio'\]"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, r"warmup_num_steps must be an integer >= 1"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, r"warmup_type='cosine'; choose one of"),
        ({"gradient_clipping": -1}, r"backend.deepspeed.gradient_clipping must be a number >= 0, got -1"),
        ({"fp16": {"loss_scale_window": 0}}, r"fp16.loss_scale_window must be an integer >= 1, got 0"),
        ({"bf16": {"enabled": True}}, r"unknown backend.deepspeed key\(s\) \['bf16'\]"),
        ({"optimizer": "AdamW"}, r"backend.deepspeed.optimizer takes a mapping of settings, got 'AdamW'"),
    ],
)
def test_a_bad_deepspeed_setting_is_one_line(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        deepspeed_from_config(section)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"logit_scale_max": 0.5, "caption_loss_weight": 2, "contrastive_loss_weight": 1}, r"logit_scale_max must be a number >= 1"),
        ({"caption_loss_weight": -1, "contrastive_loss_weight": 1}, r"caption_loss_weight must be a number >= 0, got -1"),
        ({"pad_id": -1, "caption_loss_weight": 2, "contrastive_loss_weight": 1}, r"pad_id must be a token id >= 0 or null, got -1"),
    ],
)
def test_a_bad_contrastive_setting_is_one_line(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        contrastive_from_config(section)
