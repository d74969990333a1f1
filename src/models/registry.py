"""From a model config to a ModelSpec: a registry of builders keyed by `model.name`.

Every builder takes the config's Options and the training sequence length (train.seq_len,
None = the model's default; only models with an LLM unit accept one). The registry then
applies `model.frozen`, which works for every model, and rejects keys nobody read.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from src.errors import ConfigError
from src.models.contrastive import build_clip, build_coca, build_lit
from src.models.gpt import build_gpt
from src.models.mllm import MLLM_BUILDERS
from src.models.optimus import build_optimus
from src.models.options import Options
from src.models.spec import ModelSpec
from src.models.unet import build_unet

Builder = Callable[[Options, int | None], ModelSpec]

MODEL_BUILDERS: dict[str, Builder] = {
    "clip": build_clip,
    "coca": build_coca,
    "lit": build_lit,
    **MLLM_BUILDERS,
    "optimus": build_optimus,
    "gpt": build_gpt,
    "unet": build_unet,
}
MODEL_NAMES: tuple[str, ...] = tuple(MODEL_BUILDERS)


def build_model(model_cfg: Mapping[str, Any], seq_len: int | None = None) -> ModelSpec:
    """Build the ModelSpec the Hydra `model` group describes (as a plain dict)."""
    opts = Options(model_cfg)
    name = opts.choice("name", MODEL_NAMES)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0):
        raise ConfigError(f"train.seq_len={seq_len!r} must be a positive integer or null")
    spec = MODEL_BUILDERS[name](opts, seq_len)
    frozen = opts.names("frozen")
    opts.finish(name)
    return spec if frozen is None else _freeze(spec, frozen)


def _freeze(spec: ModelSpec, frozen: list[str]) -> ModelSpec:
    """Freeze exactly the listed units (an explicit list replaces the family default)."""
    units = [unit.name for unit in spec.units]
    for name in frozen:
        if name not in units:
            raise ConfigError(f"model.frozen contains {name!r}, not a unit of {spec.name}: {', '.join(units)}")
    return replace(spec, units=tuple(replace(unit, frozen=unit.name in frozen) for unit in spec.units))
