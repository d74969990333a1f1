"""Stored results of the simulator (benchmarks/results/) carry the presets they were priced on
(src.cluster_inputs.priced_on), so that a preset's changed constants show them stale, as the
scorecard's figures and the balancing studies carry their fingerprints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from src.cluster_inputs import PRICED_ON, presets_fingerprint, priced_on, stale_stamp

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# Each table of the simulator a command writes, by the command that re-writes it.
STAMPED = {
    "disttrain_shape_breadth.md": "python benchmarks/disttrain_shape_breadth.py --out benchmarks/results/disttrain_shape_breadth.md",
    "disttrain_choice_breadth.md": (
        "python benchmarks/disttrain_shape_breadth.py --choices --out benchmarks/results/disttrain_choice_breadth.md"
    ),
    "disttrain_mfu_gap.md": "python benchmarks/disttrain_mfu_gap.py --out benchmarks/results/disttrain_mfu_gap.md",
    "optimus_host_time.md": "python benchmarks/optimus_host_time.py --out benchmarks/results/optimus_host_time.md",
    "stepccl_pairing.md": "python benchmarks/stepccl_pairing.py --out benchmarks/results/stepccl_pairing.md",
    "heldout.md": "python -m src.heldout",
}
STAMPS = sorted(path for path in RESULTS.rglob("*.md") if PRICED_ON.search(path.read_text()))


def test_every_stored_table_of_the_simulator_says_what_it_was_priced_on():
    assert set(STAMPED) <= {path.name for path in STAMPS}


@pytest.mark.parametrize("stored", STAMPS, ids=lambda path: path.relative_to(RESULTS).as_posix())
def test_a_stored_table_is_of_todays_presets(stored):
    """A preset's constants changed since the table was priced leave it stale: re-run the command
    that wrote it."""
    stale = stale_stamp(stored.read_text())
    assert stale is None, f"{stale}: re-run {STAMPED.get(stored.name, 'the command its first line names')}"


def test_the_stamp_names_the_jobs_presets_and_tells_a_changed_digest():
    jobs = [["cluster=a800", "model=mllm_9b"], ["cluster=hopper"]]
    line = priced_on(jobs)
    found = PRICED_ON.search(f"| a table |\n\n{line}\n")
    assert found is not None and found["digest"] == presets_fingerprint(jobs)
    assert found["files"].split(", ")[0] == "a800.yaml" and "hopper.yaml" in found["files"]
    assert stale_stamp(line) is None
    stale = line.replace(found["digest"], "0" * 16)
    assert stale_stamp(stale) == f"priced on {found['files']} at fingerprint {'0' * 16}; today's is {found['digest']}"
    assert re.match(r"2 lines", stale_stamp(f"{line}\n{line}") or "")
    assert stale_stamp("| a table without its stamp |") == "0 lines 'Priced on conf/cluster/ ...' where one is expected"
