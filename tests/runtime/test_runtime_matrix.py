"""Every model x strategy pair the docs list (docs/strategies.md's table) runs on the real
backend as typed: `backend=torch cluster=local model=M model.scale=tiny strategy=S` (GPT
and U-Net, which have no tiny scale: the docs' smallest), no knob added to dodge a
refusal. One step each, all in ONE launch of the local cluster's four workers (a plan two
pairs share, strategy=auto's pick of another strategy's, runs once)."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import pytest

from src.errors import ConfigError, PlanError
from src.plan_io import read_plan
from src.runtime.driver import launch
from tests.runtime.support import GPT, UNET, build_deepspeed_ops, prepare_run_dir, summary_of

pytestmark = pytest.mark.slow  # starts worker processes

WORKERS = 4  # cluster=local's devices
TINY = ["model.scale=tiny"]
MODELS = {
    "clip": TINY,
    "coca": TINY,
    "lit": TINY,
    "gpt": GPT[1:],
    "unet": UNET[1:],
    "mllm_9b": TINY,
    "mllm_15b": TINY,
    "mllm_72b": TINY,
    "optimus": TINY,
}
CONTRASTIVE, MLLMS = ("clip", "coca", "lit"), ("mllm_9b", "mllm_15b", "mllm_72b")
# docs/strategies.md: which models each strategy plans.
PLANS = {
    "megatron": tuple(MODELS),
    "deepspeed3d": tuple(m for m in MODELS if m not in CONTRASTIVE),
    "ddp": tuple(MODELS),
    "distmm": CONTRASTIVE,
    "disttrain": MLLMS,
    "optimus": ("optimus",),
    "par4d": ("gpt", "unet"),
    "auto": tuple(MODELS),
}
PAIRS = [(model, strategy) for strategy, models in PLANS.items() for model in models]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Each pair's run directory, prepared as the front door prepares it (a refusal is
    recorded, its line), all run in one launch; a pair whose plan is one an earlier pair
    runs (strategy=auto picks another strategy's plan) is not run twice: it maps to that
    pair's run directory."""
    root = tmp_path_factory.mktemp("matrix")
    build_deepspeed_ops()
    dirs: dict[tuple[str, str], Path] = {}
    refused: dict[tuple[str, str], str] = {}
    plans: dict[tuple, Path] = {}
    start = time.monotonic()
    for model, strategy in PAIRS:
        run_dir = root / f"{model}-{strategy}"
        overrides = ["backend=torch", "cluster=local", "logger=none", f"model={model}", *MODELS[model], f"strategy={strategy}"]
        try:
            backend = prepare_run_dir(run_dir, overrides)
        except (ConfigError, PlanError) as refusal:
            refused[(model, strategy)] = str(refusal)
            continue
        dirs[(model, strategy)] = plans.setdefault(_what_runs(run_dir), run_dir)
    planned = time.monotonic()
    assert refused == {}
    distinct = sorted(set(dirs.values()))
    launch(distinct, WORKERS, backend)
    ran = time.monotonic() - planned
    print(f"{len(dirs)} pairs planned in {planned - start:.1f} s; their {len(distinct)} plans run in {ran:.1f} s")
    return dirs


def _what_runs(run_dir: Path) -> tuple:
    """What the workers run of a written plan: its Program, units (their display details
    aside), precision and training settings."""
    planned = read_plan(run_dir)
    plan = planned.plan
    units = tuple(replace(u, details={}) for u in plan.units)
    return (repr(plan.program), repr(units), plan.precision, plan.sample_order, plan.sample_content, repr(planned.train))


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{m}-{s}" for m, s in PAIRS])
def test_the_plain_command_trains(runs, pair):
    summary = summary_of(runs[pair])
    assert summary["backend"] == "torch" and summary["devices"] == WORKERS
    assert summary["model"] == pair[0]
    (loss,) = summary["measured"]["loss"]
    assert math.isfinite(loss) and loss > 0
