"""Each strategy's table from the plan fields a backend's refusal names to the options that
set them (its descriptor, src/strategies/spec.py): every option it names is one of its config group's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from src.strategies import STRATEGIES, option_keys

CONF = Path(__file__).resolve().parents[2] / "conf" / "strategy"
UNITS = {"distmm": ("vision", "text"), "disttrain": ("encoder", "llm", "generator")}  # a {unit} option's units


def _option_keys(strategy: str) -> set[str]:
    def flat(prefix: str, node: dict) -> set[str]:
        out: set[str] = set()
        for key, value in node.items():
            out |= flat(f"{prefix}{key}.", value) if isinstance(value, dict) else {f"{prefix}{key}"}
        return out

    return flat("strategy.", yaml.safe_load((CONF / f"{strategy}.yaml").read_text()))


@pytest.mark.parametrize("strategy", sorted(name for name, spec in STRATEGIES.items() if spec.plan_fields))
def test_every_option_a_table_names_is_one_of_the_strategy_s(strategy):
    options = _option_keys(strategy)
    for field, key in STRATEGIES[strategy].plan_fields.items():
        for unit in UNITS.get(strategy, ("llm",)) if "{unit}" in key else (None,):
            assert key.format(unit=unit) in options, f"{strategy}: plan field {field} -> {key}"


def test_a_refusal_s_fields_become_the_options_of_its_units():
    assert option_keys("disttrain", ("tp", "pp"), ("generator",)) == ["strategy.generator.tp", "strategy.generator.pp"]
    assert option_keys("optimus", ("zero_stage",), ("encoder", "llm")) == ["strategy.encoder_zero_stage", "strategy.llm.zero_stage"]
    assert option_keys("megatron", ("zero_stage", "precision")) == ["strategy.zero_stage", "train.precision"]
    assert option_keys("distmm", ("tp",)) == []  # a per-unit option, and no unit named
