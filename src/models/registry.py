"""From a model config to a ModelSpec: a registry of builders keyed by `model.name`.

Every builder takes the config's Options and the training sequence length (train.seq_len,
None = the model's default; only models with an LLM unit accept one). The registry then
applies `model.attention`, `model.param_grad_kernels`, `model.cross_entropy`,
`model.grad_accumulation`, `model.unfused`, `model.attention_copies` and `model.frozen`, which
work for every model (an unfused operation or a copy only where its blocks run the step), and
rejects keys nobody read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from src.errors import ConfigError
from src.models.activation_bytes import with_activation_bytes
from src.models.attention import ATTENTION_MODES, with_attention
from src.models.attention_copies import with_attention_copies
from src.models.contrastive import build_clip, build_coca, build_lit
from src.models.cross_entropy import CROSS_ENTROPY_MODES, with_cross_entropy
from src.models.elementwise import with_unfused
from src.models.gpt import build_gpt
from src.models.layers import ACT_BYTES
from src.models.grad_accumulation import GRAD_ACCUMULATIONS, with_grad_accumulation
from src.models.grad_kernels import PARAM_GRAD_KERNELS, with_param_grad_kernels
from src.models.mllm import MLLM_BUILDERS
from src.models.optimus import build_optimus
from src.models.options import Options
from src.models.spec import LayerSpec, ModelSpec, UnitSpec
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


def build_model(
    model_cfg: Mapping[str, Any],
    seq_len: int | None = None,
    attention: str = "eager",
    param_grad_kernels: str = "separate",
    cross_entropy: str = "eager",
    grad_accumulation: str = "fused",
    unfused: tuple[str, ...] = (),
    activation_bytes: int = ACT_BYTES,
) -> ModelSpec:
    """Build the ModelSpec the Hydra `model` group describes (as a plain dict); `attention`,
    `param_grad_kernels`, `cross_entropy` and `grad_accumulation` (the cluster preset's) are
    the defaults of model.attention, model.param_grad_kernels, model.cross_entropy and
    model.grad_accumulation, and `unfused` (a codebase's: those of its operations the model
    runs) of model.unfused; `activation_bytes`: the training precision's element size."""
    opts = Options(model_cfg)
    name = opts.choice("name", MODEL_NAMES)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0):
        raise ConfigError(f"train.seq_len={seq_len!r} must be a positive integer or null")
    spec = MODEL_BUILDERS[name](opts, seq_len)
    mode = opts.choice("attention", ATTENTION_MODES, attention)
    grad_kernels = opts.choice("param_grad_kernels", PARAM_GRAD_KERNELS, param_grad_kernels)
    loss = opts.choice("cross_entropy", CROSS_ENTROPY_MODES, cross_entropy)
    accumulation = opts.choice("grad_accumulation", GRAD_ACCUMULATIONS, grad_accumulation)
    named = opts.names("unfused")
    copies = opts.names("attention_copies") or []
    frozen = opts.names("frozen")
    opts.finish(name)
    spec = with_cross_entropy(with_param_grad_kernels(with_attention(spec, mode), grad_kernels), loss)
    ops, software = (list(unfused), True) if named is None else (named, False)
    spec = with_attention_copies(with_unfused(with_grad_accumulation(spec, accumulation), ops, software), copies)
    spec = with_activation_bytes(spec, activation_bytes)
    return spec if frozen is None else _freeze(spec, frozen)


def _freeze(spec: ModelSpec, frozen: list[str]) -> ModelSpec:
    """Freeze exactly the listed units (an explicit list replaces the family default).
    A unit whose family keeps some layers trained when it is frozen
    (extras["trained_when_frozen"]: unit -> layer names, e.g. an MLLM's projectors)
    has every other layer frozen instead."""
    units = [unit.name for unit in spec.units]
    for name in frozen:
        if name not in units:
            raise ConfigError(f"model.frozen contains {name!r}, not a unit of {spec.name}: {', '.join(units)}")
    kept = spec.extras.get("trained_when_frozen", {})
    return replace(
        spec,
        units=tuple(
            _frozen_unit(unit, kept.get(unit.name)) if unit.name in frozen else replace(unit, frozen=False) for unit in spec.units
        ),
    )


def _frozen_unit(unit: UnitSpec, kept: tuple[str, ...] | None) -> UnitSpec:
    if not kept:
        return replace(unit, frozen=True)
    made: dict[int, LayerSpec] = {}  # repeated layers stay one object (the cost model caches by identity)
    layers = tuple(layer if layer.name in kept else made.setdefault(id(layer), replace(layer, frozen=True)) for layer in unit.layers)
    return replace(unit, layers=layers, frozen=False)
