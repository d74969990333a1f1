"""Par4D's tiny ADM U-Net on the real backend (runtime.modules.unet3d): its convolutions
and FCs 3D-parallel (channels as k and n, samples over z) on 8 workers, as grids
(2,2,2,1) and (2,2,1,2) with every overlap on and off, with and without full
recomputation, and two grids that place its ends otherwise: (4,2,1,1) runs the output
conv replicated (its input all-gathered), (2,1,2,2) runs the stem as an FC. The first 3
losses equal the single-process reference within 1e-4 relative. All in ONE launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from src.models.registry import build_model
from src.runtime.reference import reference_losses
from tests.runtime.test_runtime_par4d import EIGHT_WORKERS, NO_OVERLAP, SENSITIVE, STEPS
from tests.runtime.support import TINY_UNET, UNET, launch_cases, sensitive_optimizer

pytestmark = pytest.mark.slow  # starts worker processes

PAR4D = ["strategy=par4d", "strategy.micro_batch_size=2"]
CASES = {
    "z2_overlaps": ["strategy.grid=[2,2,2,1]", "strategy.recompute=none"],
    "data2_no_overlap_full_recompute": ["strategy.grid=[2,2,1,2]", "strategy.recompute=full", NO_OVERLAP],
    "replicated_output_conv": ["strategy.grid=[4,2,1,1]", "strategy.recompute=selective"],
    "stem_on_the_grid": ["strategy.grid=[2,1,2,2]", "strategy.recompute=none", NO_OVERLAP],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    steps = [f"train.steps={STEPS}"]
    cases = {name: EIGHT_WORKERS + UNET + PAR4D + overrides + steps + SENSITIVE for name, overrides in CASES.items()}
    return launch_cases(tmp_path_factory.mktemp("par4d_unet"), cases, 8)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    unet = build_model({"name": "unet", "preset": None, **TINY_UNET}, None)
    return reference_losses(unet, 0, 8, STEPS, sensitive_optimizer())


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, reference, case):
    lines = [json.loads(line) for line in (runs[case] / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines if r["type"] == "step"] == pytest.approx(reference, rel=1e-4)


def test_the_plan_places_the_ends_as_the_grid_requires(runs):
    for name, grid in (("replicated_output_conv", "(4,2,1,1)"), ("stem_on_the_grid", "(2,1,2,2)")):
        assert json.loads((runs[name] / "summary.json").read_text())["plan"]["grid"] == grid
