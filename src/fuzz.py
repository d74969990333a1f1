"""Random command lines over the config space, each answered as a user would see it.

    python -m src.fuzz [--draws 2000] [--seed 0] [--limit-s 60]

A draw picks a model, a strategy and a cluster and sets a few knobs (node count, batch,
precision, the strategy's degrees and options) to values a user might type: sensible ones,
zeros, negatives, strings and huge numbers. It runs the simulator's front door in process
(the composed config, validate, plan, simulate, write the run directory) and checks the
promise of every run: it ends with a one-line refusal (ConfigError/SimulationError: exit
2) or with a summary whose 0 < MFU <= 1, whose breakdown adds up to the iteration time on
every rank, and whose plan fits the devices' memory; nothing else escapes (a traceback),
and nothing runs past `limit_s`. The test suite runs a few hundred draws; this script
runs thousands.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import random
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from src.errors import ConfigError
from src.report import JobInfo
from src.sim.engine import SimulationError

CONF = Path(__file__).resolve().parent.parent / "conf"

NODES = [1, 1, 2, 4, 8, 16, 3, 0, -2, "abc", 10**6]
BATCHES = [None, 1, 8, 64, 96, 512, 1536, 0, -5, "x", 10**9]
PRECISIONS = ["auto", "fp32", "bf16", "fp16", "int4"]
DEGREES = [None, 1, 2, 4, 8, 3, 0, -1, "two", 10**6]
# Strategy knobs a user types, with the values to draw (others keep their defaults).
KNOBS: dict[str, list[Any]] = {
    "tp": DEGREES,
    "pp": DEGREES,
    "dp": DEGREES,
    "vpp": DEGREES,
    "micro_batch_size": DEGREES,
    "zero_stage": [0, 1, 2, 3, 4, -1, "x"],
    "recompute": [None, "none", "selective", "full", "some"],
    "schedule": ["1f1b", "gpipe", "interleaved", "zigzag"],
    "sequence_parallel": [True, False, "yes"],
}
EXIT_REFUSED = (ConfigError, SimulationError)


@dataclass
class Outcome:
    overrides: list[str]
    status: str  # ok | refused | broken | slow
    seconds: float
    detail: str = ""


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _composed(model: str, strategy: str, cluster: str) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir

    from src.config import plain_config

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[f"model={model}", f"strategy={strategy}", f"cluster={cluster}", "logger=none"])
    return plain_config(cfg)


def draw(rng: random.Random) -> tuple[dict[str, Any], list[str]]:
    """A composed config with a few knobs set, and the command line that says so."""
    model, strategy, cluster = (rng.choice(options(g)) for g in ("model", "strategy", "cluster"))
    config = copy.deepcopy(_composed(model, strategy, cluster))
    overrides = [f"model={model}", f"strategy={strategy}", f"cluster={cluster}"]
    knobs: list[tuple[str, str, Sequence[Any]]] = [
        ("cluster", "nodes", NODES),
        ("train", "global_batch", BATCHES),
        ("train", "precision", PRECISIONS),
    ]
    knobs += [("strategy", key, values) for key, values in KNOBS.items() if key in config["strategy"]]
    for group, key, values in rng.sample(knobs, k=rng.randint(0, min(3, len(knobs)))):
        value: Any = rng.choice(values)
        config[group][key] = value
        overrides.append(f"{group}.{key}={'null' if value is None else value}")
    config["run"]["name"] = f"{model}-{strategy}-{cluster}"
    return config, overrides


class _TooSlow(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _TooSlow()


def check(summary: dict[str, Any], config: dict[str, Any]) -> str:
    """What is wrong with a finished run's summary ('' if nothing)."""
    from src.cluster import GIB, cluster_from_config

    if not 0 < summary["mfu"] <= 1:
        return f"MFU {summary['mfu']}"
    total = sum(summary["breakdown_s"].values())
    if abs(total - summary["iteration_time_s"]) > 1e-6 * summary["iteration_time_s"]:
        return f"breakdown adds up to {total}, iteration {summary['iteration_time_s']}"
    usable = cluster_from_config(config["cluster"]).usable_memory_bytes / GIB
    if summary["peak_memory_gib"] > usable * (1 + 1e-9):
        return f"peak memory {summary['peak_memory_gib']:.1f} GiB > usable {usable:.1f} GiB"
    return ""


def run_draw(config: dict[str, Any], overrides: list[str], limit_s: float) -> Outcome:
    from src.run import execute

    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        # The console's tables of hundreds of runs would bury the findings.
        with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(io.StringIO()):
            summary = execute(config, Path(run_dir), JobInfo(run_name=config["run"]["name"]))
        problem = check(summary, config)
        status, detail = ("broken", problem) if problem else ("ok", "")
    except EXIT_REFUSED as err:
        status, detail = "refused", str(err)
        if "\n" in detail:
            status, detail = "broken", f"a refusal of several lines: {detail!r}"
    except _TooSlow:
        status, detail = "slow", f"still running after {limit_s:g} s"
    except Exception:  # noqa: BLE001 - a traceback is exactly what the fuzzer looks for
        status, detail = "broken", traceback.format_exc(limit=-3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(overrides, status, time.perf_counter() - start, detail)


def fuzz(draws: int, seed: int, limit_s: float, progress: bool = False) -> list[Outcome]:
    rng = random.Random(seed)
    outcomes = []
    for index in range(draws):
        config, overrides = draw(rng)
        outcomes.append(run_draw(config, overrides, limit_s))
        if progress and (index + 1) % 50 == 0:
            print(f"{index + 1}/{draws} draws", file=sys.stderr, flush=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    outcomes = fuzz(args.draws, args.seed, args.limit_s, progress=True)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "refused", "broken", "slow")}
    print(
        f"{args.draws} draws (seed {args.seed}): "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + f"; slowest {max(o.seconds for o in outcomes):.1f} s"
    )
    for outcome in outcomes:
        if outcome.status in ("broken", "slow"):
            print(f"\n[{outcome.status}] python -m src.run {' '.join(outcome.overrides)}\n{outcome.detail}")
    return 1 if counts["broken"] or counts["slow"] else 0


if __name__ == "__main__":
    sys.exit(main())
