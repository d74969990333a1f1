"""docs/adding_a_strategy.md as written: its package (planner, options, descriptor) and its
config group, copied out of the page into a directory outside src/strategies, plan a tiny
GPT that the simulator prices as it prices strategy=ddp's same instructions, and train it
on two workers (slow) to the single process's losses. The config group states the
descriptor's options at their defaults; a backend's refusal names the option the
descriptor maps its plan field to. The registry's public calls and their refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.errors import ConfigError, PlanRefused
from src.setup import options_named, plan_run, validate
from src.sim.engine import simulate
from src.strategies import STRATEGIES, planner_for, register, strategy_for
from tests.conftest import CONF_DIR, REPO_ROOT, cli_env
from tests.test_configs import check_yaml_defaults

PAGE = REPO_ROOT / "docs" / "adding_a_strategy.md"
# A fenced block whose first line names the file it is: "# my_strategies/toy.py".
FILE_BLOCK = re.compile(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", re.S)
TINY_GPT = [
    "cluster=local",
    "cluster.devices_per_node=2",
    "model=gpt",
    "model.preset=null",
    "model.layers=2",
    "model.hidden=64",
    "model.heads=4",
    "model.vocab=128",
    "train.seq_len=16",
    "train.global_batch=8",
    "logger=none",
]
TOY = ["strategy=toy", "strategy.microbatches=2"]
DESCRIPTOR = "my_strategies.toy:STRATEGY"  # the config group's name


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page's files, written where a user keeps their own code."""
    root = tmp_path_factory.mktemp("outside")
    blocks = FILE_BLOCK.findall(PAGE.read_text())
    assert sorted(path for path, _ in blocks) == ["my_conf/strategy/toy.yaml", "my_strategies/toy.py"]
    for path, text in blocks:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def _config(outside: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"hydra.searchpath=[file://{outside / 'my_conf'}]", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_the_page_s_strategy_is_priced_as_the_same_instructions_of_ddp(outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(outside))
    setup = validate(_config(outside, *TOY, *TINY_GPT))
    toy = plan_run(setup)
    assert toy.strategy == "toy" and toy.devices == 2
    assert [(u.unit, u.dp, u.micro_batch, u.num_microbatches) for u in toy.units] == [("llm", 2, 2, 2)]
    ddp = plan_run(validate(_config(outside, "strategy=ddp", "strategy.micro_batch_size=2", "strategy.recompute=none", *TINY_GPT)))
    priced = [simulate(p.program, setup.model, setup.cluster, setup.train.precision) for p in (toy, ddp)]
    assert priced[0].iteration_time == priced[1].iteration_time > 0
    assert priced[0].mean_breakdown() == priced[1].mean_breakdown()


def test_the_page_s_strategy_refuses_a_batch_it_cannot_split(outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(outside))
    setup = validate(_config(outside, *TOY, *TINY_GPT, "train.global_batch=6"))
    with pytest.raises(ConfigError, match="global batch 6 does not split into 2 devices x 2 micro-batches"):
        plan_run(setup)


def test_the_page_s_config_group_names_its_descriptor_and_states_its_options_defaults(
    outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(outside))
    from my_strategies.toy import STRATEGY, ToyOptions, plan_toy

    assert _config(outside, "strategy=toy")["strategy"]["name"] == DESCRIPTOR
    assert strategy_for(DESCRIPTOR) is STRATEGY and planner_for(DESCRIPTOR) is plan_toy
    assert STRATEGY.options is ToyOptions
    check_yaml_defaults(outside / "my_conf" / "strategy" / "toy.yaml", ToyOptions)


def test_a_refusal_of_the_page_s_plan_names_the_option_its_descriptor_maps(outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(outside))
    with pytest.raises(ConfigError, match=rf"^no such micro-batch \[{DESCRIPTOR}: strategy.microbatches, train.precision\]$"):
        with options_named(DESCRIPTOR):
            raise PlanRefused("no such micro-batch", ("micro_batch", "precision"))
    # A planner alone maps no plan field to an option: the refusal names the fields alone.
    with pytest.raises(ConfigError, match=r"^no such micro-batch$"):
        with options_named("my_strategies.toy:plan_toy"):
            raise PlanRefused("no such micro-batch", ("micro_batch",))


def test_a_registered_name_plans_with_its_descriptor_or_a_planner_alone(outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(outside))
    from my_strategies.toy import STRATEGY, plan_toy

    monkeypatch.setattr("src.strategies.STRATEGIES", dict(STRATEGIES))  # this test's registrations end with it
    register("toy", STRATEGY)
    register("toy", STRATEGY)  # the same descriptor again: nothing changes
    assert strategy_for("toy") is STRATEGY and planner_for("toy") is plan_toy
    with pytest.raises(ValueError, match="strategy 'toy' is already registered"):
        register("toy", plan_toy)  # the planner alone is another description
    register("toy_alone", plan_toy)
    assert planner_for("toy_alone") is plan_toy is planner_for("my_strategies.toy:plan_toy")
    assert strategy_for("toy_alone").plan_fields == {}
    with pytest.raises(ValueError, match="strategy 'ddp' is already registered"):
        register("ddp", plan_toy)
    with pytest.raises(ValueError, match="has no ':'"):
        register("my:toy", plan_toy)


@pytest.mark.parametrize(
    "name, message",
    [
        ("toi", r"strategy 'toi' is not registered; available: \['auto', "),
        ("my_strategies.nothing:plan", "strategy 'my_strategies.nothing:plan': cannot import its descriptor or planner"),
        ("my_strategies.toy:plan_nothing", "cannot import its descriptor or planner .*has no attribute 'plan_nothing'"),
        ("my_strategies.toy:__doc__", "__doc__ in my_strategies.toy is a str, not a StrategySpec or a planner"),
    ],
)
def test_a_strategy_name_that_names_no_planner_is_one_line(
    outside: Path, monkeypatch: pytest.MonkeyPatch, name: str, message: str
) -> None:
    monkeypatch.syspath_prepend(str(outside))
    with pytest.raises(ConfigError, match=message):
        planner_for(name)


@pytest.mark.slow
@pytest.mark.torch
def test_the_page_s_strategy_trains_for_real_like_one_process(outside: Path, tmp_path: Path) -> None:
    from src.models.registry import build_model
    from src.runtime.reference import reference_losses
    from tests.runtime.support import sensitive, sensitive_optimizer

    steps = 3
    overrides = [*TOY, *TINY_GPT, "backend=torch", "backend.workers=2", f"train.steps={steps}"]
    # Large updates make any difference in the gradients show in the next losses.
    overrides += sensitive()
    env = {**cli_env(), "PYTHONPATH": str(outside)}
    searchpath = f"hydra.searchpath=[file://{outside / 'my_conf'}]"
    command = [sys.executable, "-m", "src.run", searchpath, *overrides, f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["type"] == "step"]
    gpt = build_model({"name": "gpt", "preset": None, "layers": 2, "hidden": 64, "heads": 4, "vocab": 128}, 16)
    assert losses == pytest.approx(reference_losses(gpt, 0, 8, steps, sensitive_optimizer()), rel=1e-4)
