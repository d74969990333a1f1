"""The software options a model, a cluster preset and a strategy's codebase each state (the
loss's cross entropy, the gradient accumulation): a value outside an option's modes is refused
in one line wherever it is given."""

from __future__ import annotations

import pytest

from src.cluster import cluster_from_config
from src.config import composed
from src.errors import ConfigError
from src.models.registry import build_model
from src.setup import validate

GPT = {"name": "gpt", "preset": None, "layers": 2, "hidden": 1024, "heads": 16, "vocab": 32000}


@pytest.mark.parametrize(
    ("option", "cluster_value", "model_refusal", "cluster_refusal", "strategy_refusal"),
    [
        (
            "cross_entropy",
            "bf16",
            r"model.cross_entropy='apex' is not one of: eager, fp32, fused",
            r"cluster.cross_entropy must be one of \['eager', 'fp32', 'fused'\], got 'bf16'",
            r"strategy.cross_entropy='te'; choose one of \['eager', 'fp32', 'fused'\] or null",
        ),
        (
            "grad_accumulation",
            "yes",
            r"model.grad_accumulation='apex' is not one of: hook, fused, cast",
            r"cluster.grad_accumulation must be one of \['hook', 'fused', 'cast'\], got 'yes'",
            r"strategy.grad_accumulation='te'; choose one of \['hook', 'fused', 'cast'\] or null",
        ),
    ],
)
def test_a_bad_mode_is_refused_in_one_line(
    option: str, cluster_value: str, model_refusal: str, cluster_refusal: str, strategy_refusal: str
) -> None:
    with pytest.raises(ConfigError, match=model_refusal):
        build_model({**GPT, option: "apex"}, 2048)
    with pytest.raises(ConfigError, match=cluster_refusal):
        cluster_from_config(composed(["cluster=hopper", f"cluster.{option}={cluster_value}"])["cluster"])
    with pytest.raises(ConfigError, match=strategy_refusal):
        validate(composed(["model=gpt", "strategy=deepspeed3d", f"strategy.{option}=te"]))
