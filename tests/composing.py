"""The tests' way to compose the project's config (no tests here): what `src.config.composed`
returns, at a fraction of its cost.

Hydra composes a config in two steps: the group choices (model=clip, strategy=ddp, ...) pick
the files it merges, then the value overrides (model.scale=tiny, ...) are applied to the
merged config, in struct mode, by Hydra's own `_apply_overrides_to_config`. The first step
reads and merges a dozen YAML files (a third of a second on CI's cores) and most tests share
their group choices; so it is done once per group choice (the defaults' config with each
chosen group's node swapped in) or, for choices of another kind (`+experiment=`, Hydra's
own), once per distinct set, and each call applies its value overrides, with Hydra's own
function, to a copy. tests/test_configs.py checks the result equals `src.config.composed`
on override lists of every kind."""

from __future__ import annotations

import copy
import functools
from typing import Any, Iterable

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig

from src.config import plain_config
from tests.conftest import CONF_DIR


@functools.lru_cache(maxsize=1)
def _parser() -> OverridesParser:
    return OverridesParser.create()


# conf/config.yaml's groups: each file fills its own node only (no `@package`) and refers to
# no other node, so a set of choices composes group by group.
OWN_PACKAGES = ("model", "strategy", "cluster", "backend", "logger")


def _is_group(override: Override) -> bool:
    """Whether Hydra reads `override` as a group choice (a folder of conf/, or one of Hydra's own)."""
    key = override.key_or_group
    return key.startswith("hydra/") or (CONF_DIR / key).is_dir()


def _compose(config_name: str, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


@functools.lru_cache(maxsize=None)
def _choices_composed(config_name: str, choices: tuple[str, ...]) -> DictConfig:
    groups = [choice.partition("=")[0] for choice in choices]
    if config_name != "config" or len(choices) < 2 or not set(groups) <= set(OWN_PACKAGES) or len(set(groups)) < len(groups):
        return _compose(config_name, list(choices))
    # Each choice replaces its group's node of the defaults' config (none reaches another's).
    config = copy.deepcopy(_choices_composed(config_name, ()))
    for group, choice in zip(groups, choices):
        config[group] = copy.deepcopy(_choices_composed(config_name, (choice,))[group])
    return config


def composed(overrides: Iterable[str], config_name: str = "config") -> dict[str, Any]:
    """`src.config.composed(overrides)` (or conf/<config_name>.yaml composed with them):
    the same plain, resolved config, the same errors; a fresh copy each call."""
    return copy.deepcopy(_composed(tuple(overrides), config_name))


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...], config_name: str) -> dict[str, Any]:
    parsed = _parser().parse_overrides(list(overrides))
    if any(o.key_or_group.startswith("hydra") for o in parsed):
        return plain_config(_compose(config_name, list(overrides)))  # the hydra node is dropped after its overrides apply
    choices = tuple(o.input_line for o in parsed if _is_group(o))
    config = copy.deepcopy(_choices_composed(config_name, choices))
    ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if not _is_group(o)], config)
    return plain_config(config)
