"""Random command lines over the config space, each answered as a user would see it.

    python -m src.fuzz [--draws 2000] [--seed 0] [--limit-s 60]

A draw picks a model, a strategy and a cluster and sets a few knobs (node count, batch,
precision, cluster constants and peaks, the strategy's degrees and options, a model's
sizes) to values a user might type: sensible ones, zeros, negatives, strings, NaN and
infinity, huge numbers (past any index), a list where one value goes and one value where a
list or a mapping goes, a group or a key removed (`~train.seed`). The command line goes
through Hydra's parser and composition as the front door's does (src.run: its one-line
refusal of what Hydra cannot compose, its check of the composed groups), then the door's
own steps in process (validate, plan, simulate, write the run directory); and each draw is
checked against the promise of every run: it ends with a one-line refusal
(ConfigError/SimulationError: exit 2), with no progress line ahead of it unless it is the
finding of a search that ran past src.progress.FIRST_CPU_S of CPU ("refused late": no plan
fits, after strategy=auto priced every strategy), or with a summary whose 0 < MFU <= 1, whose
breakdown adds up to the iteration time on every rank, and whose plan fits the devices'
memory; nothing else escapes (a traceback); a run that used more than SAY_AFTER_S of CPU
prints progress on stderr, and none stays silent for QUIET_MAX_S. A run still going at
`limit_s` is stopped: `long` if it was printing progress, `slow` if it was silent. Both
times leave out the time a busy machine kept the draw waiting for a CPU, as src.progress
does (run it with `nice` on a shared machine: the verdicts stay those of a quiet one). The
test suite runs a few hundred draws; this script runs thousands.

`--backend torch` draws the real backend's command lines instead (`backend=torch
cluster=local`, the models at their tiny sizes, a few worker counts, the data kinds and the
options only it refuses among the knobs) and takes each through the front door's steps up to
the start of its workers (validate, plan, write the run directory, refuse what the backend
cannot run or this machine's workers cannot hold: src.runtime.backend), starting none: each
ends runnable, or refused in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import math
import random
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from src.config import composed, group_options
from src.errors import ConfigError
from src.progress import FIRST_CPU_S, scheduled
from src.report import JobInfo
from src.sim.engine import SimulationError


NAN, INF = float("nan"), float("inf")
HUGE = 99999999999999999999  # past any index (2^63)
NODES = [1, 1, 2, 4, 8, 16, 3, 0, -2, "abc", 10**6, HUGE, INF, [2]]
BATCHES = [None, 1, 8, 64, 96, 512, 1536, 0, -5, "x", 10**9, HUGE, NAN, [8, 16]]
PRECISIONS = ["auto", "fp32", "bf16", "fp16", "int4", ["fp32"]]
DEGREES = [None, 1, 2, 4, 8, 3, 0, -1, "two", 10**6, HUGE, INF, NAN, [2, 2]]
# Cluster constants a user overrides to try a machine (any preset has them).
CONSTANTS = [NAN, INF, -INF, -1.0, 0.0, 1e-30, 1.0, 1e30, HUGE, [1.0]]
CLUSTER_KNOBS = [
    "inter_bandwidth",
    "intra_bandwidth",
    "inter_latency",
    "memory_gib",
    "memory_bandwidth",
    "gemm_max_efficiency",
    "kernel_overhead_s",
    "gemm_fixed_s",
]
# Strategy knobs a user types, with the values to draw (others keep their defaults).
KNOBS: dict[str, list[Any]] = {
    "tp": DEGREES,
    "pp": DEGREES,
    "dp": DEGREES,
    "vpp": DEGREES,
    "micro_batch_size": DEGREES,
    "zero_stage": [0, 1, 2, 3, 4, -1, "x", NAN, [1]],
    "recompute": [None, "none", "selective", "full", "some", ["full"]],
    "schedule": ["1f1b", "gpipe", "interleaved", "zigzag", 3],
    "extra_warmup": [0, 1, 3, 10**6, -1, "x", NAN, [2]],
    "sequence_parallel": [True, False, "yes", [True]],
    # A list (Par4D's grid, auto's contenders) or a mapping (a unit's degrees) where one goes.
    "grid": [None, [2, 2, 2, 1], [1, 1, 1, 64], [2, 2], 3, INF, "abc", [NAN, 1, 1, 1]],
    "contenders": [None, ["megatron", "distmm"], ["nobody"], "megatron", 3],
    "vision": [None, 4, [2], {"tp": 2}, {"tp": NAN}],
    "text": [None, 4, "x", {"dp": 10**6}],
    "llm": [None, 2, [1], {"pp": 4}, {"tp": INF}],
    "encoder": [None, 1, {"tp": 2}],
}
# Model sizes past any cluster (a GPT of 100 000 layers), past any index, and malformed ones.
SIZES = [100_000, 10**9, HUGE, NAN, 0, [4]]
MODEL_KNOBS: dict[str, list[Any]] = {"layers": SIZES, "hidden": [10**7, 10**6, HUGE, INF, -64, [64]]}
TOWERS = ("vision", "text")  # the contrastive models' sub-groups
# Whole groups and keys removed or replaced by one value: the config's shape broken.
SHAPES = [
    "~train.seed",
    "~train",
    "~model.name",
    "~strategy.name",
    "~cluster.memory_gib",
    "~cluster.peak_flops",
    "train=5",
    "run=3",
    "cluster.collectives=3",
    "cluster.peak_flops=1e15",
    "cluster.peak_flops=[1e15]",
]
# The real backend's draws: a model at its tiny size on this machine's workers, and the
# knobs whose values only it refuses (data kinds, replicated units, fine-grained bins, precisions,
# the distributed optimizer's overlaps, an encoder's TP and PP).
TINY: dict[str, list[str]] = {
    "gpt": ["model.preset=null", "model.layers=4", "model.hidden=64", "model.heads=4", "model.vocab=128", "train.seq_len=16"],
    "unet": ["model.preset=unet_50m", "model.image_size=16"],
}
WORKERS = [1, 2, 3, 4, 4, 6, 8, 0]
TORCH_KNOBS: dict[str, list[Any]] = {
    "backend.workers": [2, 4, 8, 0],
    "train.data": ["uniform", "interleaved", "skewed", 3],
    "train.balance": ["none", "reorder", "cost", "best"],
    "train.precision": ["fp32", "bf16", "fp16", "int4"],
    "train.global_batch": [2, 4, 6, 8, 12, 0, -1, "x"],
    "strategy.replicate": [[], ["encoder", "generator"], ["generator"], ["llm"], ["nobody"], "encoder"],
    "strategy.fine_grained": [True, False, "x"],
    "strategy.modality_stages": ["merged", "extra", "none"],
    "strategy.scatter_gather": [True, False],
    "strategy.overlap_grad_reduce": [True, False],
    "strategy.overlap_param_gather": [True, False],
    "strategy.zero_stage": [0, 1, 3],
    "strategy.encoder.tp": [1, 2],
    "strategy.encoder.pp": [1, 2],
}
EXIT_REFUSED = (ConfigError, SimulationError)
FAILED = ("broken", "slow", "silent")
SAY_AFTER_S = FIRST_CPU_S + 2.0  # a run that used more CPU than this prints progress
QUIET_MAX_S = 60.0  # and never stays silent longer than this


@dataclass
class Outcome:
    overrides: list[str]
    # ok | refused | refused late (after a search's progress lines) | broken (a traceback, a
    # summary that breaks a promise, a progress line before a refusal of little work) | long | slow | silent
    status: str
    seconds: float
    detail: str = ""


@functools.lru_cache(maxsize=None)
def _composed(model: str, strategy: str, cluster: str) -> dict[str, Any]:
    return composed([f"model={model}", f"strategy={strategy}", f"cluster={cluster}", "logger=none"])


def draw(rng: random.Random, backend: str = "sim") -> list[str]:
    """A command line: a model, a strategy and a cluster, with a few knobs set (`backend`:
    the simulator's over every cluster, or the real backend's on this machine's workers)."""
    model, strategy = rng.choice(group_options("model")), rng.choice(group_options("strategy"))
    cluster = rng.choice(group_options("cluster")) if backend == "sim" else "local"
    config = _composed(model, strategy, cluster)
    overrides = [f"model={model}", f"strategy={strategy}", f"cluster={cluster}"]
    knobs: list[tuple[str, Sequence[Any]]]
    if backend == "torch":
        overrides += ["backend=torch", f"cluster.devices_per_node={rng.choice(WORKERS)}"]
        overrides += TINY.get(model, ["model.scale=tiny"] if "scale" in config["model"] else [])
        knobs = [(key, values) for key, values in TORCH_KNOBS.items() if not _absent(config, key)]
    else:
        knobs = [
            ("cluster.nodes", NODES),
            ("train.global_batch", BATCHES),
            ("train.precision", PRECISIONS),
            (f"cluster.{rng.choice(CLUSTER_KNOBS)}", CONSTANTS),
            (f"cluster.peak_flops.{rng.choice(sorted(config['cluster']['peak_flops']))}", CONSTANTS),
            ("", SHAPES),
        ]
    knobs += [(f"strategy.{key}", values) for key, values in KNOBS.items() if key in config["strategy"]]
    knobs += [(f"model.{key}", values) for key, values in MODEL_KNOBS.items() if key in config["model"]]
    knobs += [(f"model.{tower}.{key}", values) for tower in TOWERS for key, values in MODEL_KNOBS.items() if tower in config["model"]]
    knobs += [(f"model.{tower}", [4, [2]]) for tower in TOWERS if tower in config["model"]]
    for key, values in rng.sample(knobs, k=rng.randint(0, min(3, len(knobs)))):
        value: Any = rng.choice(values)
        overrides.append(value if not key else f"{'+' if _absent(config, key) else ''}{key}={_typed(value)}")
    return overrides


def _absent(config: dict[str, Any], key: str) -> bool:
    """Whether `key` (dotted) is not in the composed config: Hydra adds it with a `+`."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return True
        node = node[part]
    return False


def _typed(value: Any) -> str:
    """A value as a user types it on the command line (Hydra's grammar)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_typed(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_typed(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return str(value)


class _Lines(io.TextIOBase):
    """stderr of a run: when each line arrived, for the progress check, on a clock that
    leaves out the time the machine kept the run waiting for a CPU (a busy machine
    stretches a silence that the run could not have filled)."""

    def __init__(self) -> None:
        self.start = self._clock()
        self.arrivals: list[float] = []
        self.text: list[str] = []

    def _clock(self) -> float:
        return time.perf_counter() - scheduled()[1]

    def write(self, text: str) -> int:
        now = self._clock() - self.start
        self.arrivals += [now] * text.count("\n")
        self.text.append(text)
        return len(text)

    def elapsed(self) -> float:
        return self._clock() - self.start

    def longest_silence(self) -> float:
        marks = [0.0, *self.arrivals, self.elapsed()]
        return max(b - a for a, b in zip(marks, marks[1:]))


class _TooSlow(Exception):
    pass


def _stop_at(limit_s: float, clock: _Lines) -> Callable[[int, Any], None]:
    """SIGALRM's handler: the draw stops once `clock` (its time less the time the machine
    kept it waiting for a CPU) reaches `limit_s`; before that, the timer is set again."""

    def alarm(signum: int, frame: Any) -> None:
        left = limit_s - clock.elapsed()
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        raise _TooSlow()

    return alarm


def check(summary: dict[str, Any], config: dict[str, Any]) -> str:
    """What is wrong with a finished run's summary ('' if nothing)."""
    from src.cluster import GIB, cluster_from_config, gib

    if not 0 < summary["mfu"] <= 1:
        return f"MFU {summary['mfu']}"
    total = sum(summary["breakdown_s"].values())
    if abs(total - summary["iteration_time_s"]) > 1e-6 * summary["iteration_time_s"]:
        return f"breakdown adds up to {total}, iteration {summary['iteration_time_s']}"
    usable = cluster_from_config(config["cluster"]).usable_memory_bytes
    if summary["peak_memory_gib"] * GIB > usable * (1 + 1e-9):
        return f"peak memory {gib(summary['peak_memory_gib'] * GIB)} GiB > usable {gib(usable)} GiB"
    return ""


def _up_to_workers(config: dict[str, Any], run_dir: Path) -> None:
    """The front door's steps of a real-backend run up to its workers' start (src.run's
    execute, src.runtime.backend.run_torch), starting none."""
    from src.progress import run_clock
    from src.run import plan_into
    from src.runtime.backend import check_workers, ready
    from src.setup import options_named, start_run_dir

    start_run_dir(config, run_dir)
    with run_clock():
        planned, settings = plan_into(config, run_dir, JobInfo(run_name=config["run"]["name"]))
        with options_named(planned.plan.strategy):
            check_workers(planned.plan, ready(planned, settings, run_dir))


def run_draw(overrides: list[str], limit_s: float, backend: str = "sim") -> Outcome:
    """One command line through the front door's steps, in process: its composition by
    Hydra, the composed groups' check, validate, plan, simulate, write the run directory
    (the real backend's: up to its workers' start)."""
    from src.run import compose_config, config_of, execute

    start, start_cpu = time.perf_counter(), time.process_time()
    stderr = _Lines()
    previous = signal.signal(signal.SIGALRM, _stop_at(limit_s, stderr))
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        # The console's tables of hundreds of runs would bury the findings; stderr is kept
        # to see whether a long run said what it was doing.
        with (
            tempfile.TemporaryDirectory() as run_dir,
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(stderr),
        ):
            config = config_of(compose_config([*overrides, "logger=none"]))
            if backend == "torch":
                _up_to_workers(config, Path(run_dir))
            else:
                summary = execute(config, Path(run_dir), JobInfo(run_name=config["run"]["name"]))
        problem = check(summary, config) if backend == "sim" else ""
        status, detail = ("broken", problem) if problem else ("ok", "")
    except EXIT_REFUSED as err:
        status, detail = "refused", str(err)
        if "\n" in detail:
            status, detail = "broken", f"a refusal of several lines: {detail!r}"
    except _TooSlow:
        spoke = bool(stderr.arrivals)
        status = "long" if spoke else "slow"
        detail = f"stopped at {limit_s:g} s, {'printing progress' if spoke else 'having printed nothing'}"
    except Exception:  # noqa: BLE001 - a traceback is exactly what the fuzzer looks for
        status, detail = "broken", traceback.format_exc(limit=-3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    silence = stderr.longest_silence()
    if status in ("ok", "refused", "long") and (silence > QUIET_MAX_S or (cpu > SAY_AFTER_S and not stderr.arrivals)):
        last = "".join(stderr.text).strip().splitlines()[-1:] or ["nothing"]
        status = "silent"
        detail = f"{seconds:.1f} s ({cpu:.1f} s CPU), {silence:.1f} s of it without a line on stderr (last: {last[0]})"
    if status == "refused" and stderr.arrivals:
        # Checks refuse before any progress line; a search that finds no plan refuses after
        # the lines of its work (past FIRST_CPU_S of CPU: the same on any machine).
        status = "refused late" if cpu > FIRST_CPU_S else "broken"
        detail = f"after {cpu:.1f} s of CPU and its progress lines ({len(stderr.arrivals)}): {detail}"
    return Outcome(overrides, status, seconds, detail)


def fuzz(draws: int, seed: int, limit_s: float, progress: bool = False, backend: str = "sim") -> list[Outcome]:
    rng = random.Random(seed)
    outcomes = []
    for index in range(draws):
        outcomes.append(run_draw(draw(rng, backend), limit_s, backend))
        if progress and (index + 1) % 50 == 0:
            print(f"{index + 1}/{draws} draws", file=sys.stderr, flush=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=float, default=60.0)
    parser.add_argument("--backend", choices=("sim", "torch"), default="sim")
    args = parser.parse_args(argv)
    outcomes = fuzz(args.draws, args.seed, args.limit_s, progress=True, backend=args.backend)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "refused", "refused late", "long", "broken", "slow", "silent")}
    print(
        f"{args.draws} draws (seed {args.seed}): "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + f"; slowest {max(o.seconds for o in outcomes):.1f} s"
    )
    for outcome in outcomes:
        if outcome.status in FAILED:
            print(f"\n[{outcome.status}] python -m src.run {' '.join(outcome.overrides)}\n{outcome.detail}")
    return 1 if any(counts[s] for s in FAILED) else 0


if __name__ == "__main__":
    sys.exit(main())
