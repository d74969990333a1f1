"""The front door: compose the config, plan, write the plan, execute it, report.

python -m src.run model=clip strategy=megatron
python -m src.run -m model=clip,coca,lit strategy=megatron
python -m src.run backend=torch plan=outputs/<run>/<time>   # run a written plan

Every run ends in one of three ways: its results (summary.json), one `error:` line (exit
2 for input the user can fix, a full disk included; 1 for a failure of the run; 143 and 130
for SIGTERM and Ctrl-C, in whatever phase they come), or a kill that leaves no line (then
the workers write error.txt, runtime.lifeline). Every early end writes error.txt.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from src.backends import backend_for
from src.collector import collector_paused
from src.config import CONF_DIR, TRAIN_KEYS, plain_config, unknown_option
from src.errors import ConfigError
from src.progress import heartbeat, run_clock
from src.report import JobInfo
from src.report.files import WriteError
from src.out_paths import unwritable_dir
from src.runtime.errors import Terminated, TerminateSignal, WorkerFailure, signal_line
from src.runtime.processes import kill_descendants, leave, signals_end_the_run
from src.plan_io import PlannedRun, RunSettings
from src.setup import job_info, options_named, prepare_run, start_run_dir, write_run_dir
from src.sim.engine import SimulationError
from src.write_failures import describe, is_write_failure, release, reserve, write_error_file

log = logging.getLogger("src.run")
# The groups every run has, each a mapping; the Hydra groups among them name their option.
GROUPS = ("model", "strategy", "cluster", "backend", "logger", "train", "run")
NAMED_GROUPS = ("model", "strategy", "cluster", "backend", "run")


def compose_config(args: list[str], with_hydra: bool = False) -> DictConfig:
    """The project's config composed with `args` (overrides) as Hydra's parser reads them;
    ConfigError in one line where Hydra cannot compose them (Hydra itself prints several
    lines and exits 1)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name="config", overrides=args, return_hydra_config=with_hydra)
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # ValueError: an override's grammar
        raise ConfigError(_one_line(str(err))) from None


def refuse_bad_overrides(args: list[str]) -> None:
    """Compose a single run's overrides before Hydra runs them, so that a key or option
    Hydra cannot compose is one line and exit 2. Multiruns, sweeps and Hydra's own flags
    are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if any(arg.startswith("-") for arg in args):
        return
    try:
        if any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(args)):
            return
        cfg = compose_config(args, with_hydra=True)
        # Hydra creates the run directory before main, and a failure there is its traceback.
        run_dir = Path(str(cfg.hydra.run.dir))
    except (HydraException, OmegaConfBaseException) as err:
        _refuse(_one_line(str(err)))
    except ConfigError as err:
        _refuse(str(err))
    problem = unwritable_dir(run_dir)
    if problem:
        _refuse(problem)


def _refuse(line: str) -> None:
    print(f"error: {line}", file=sys.stderr)
    sys.exit(2)


def _one_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1 and lines[1].startswith("Available options"):
        options = lines[2 : lines.index("Config search path:")] if "Config search path:" in lines else lines[2:]
        return f"{lines[0]}; choose one of {', '.join(options)}"
    return "; ".join(line.rstrip(".") for line in lines[:3])


def config_of(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as plain dicts with its interpolations resolved, each group a
    mapping: ConfigError where a group was removed or replaced by one value
    (`~train`, `run=3`) or an interpolation lost what it names (`~model.name`)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        config = plain_config(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(_one_line(str(err))) from None
    for group in GROUPS:
        if group not in config:
            raise ConfigError(f"the config has no {group} group (removed with ~{group}?); every run needs one")
        if not isinstance(config[group], Mapping):
            raise ConfigError(f"{group} is a group of settings, got {config[group]!r}; set one entry of it, e.g. {group}.KEY=VALUE")
    for group in NAMED_GROUPS:
        if not isinstance(config[group].get("name"), str):
            raise ConfigError(f"{group}.name must name the {group}, got {config[group].get('name')!r} (removed with ~{group}.name?)")
    # conf/config.yaml states every train key: one removed would fall back to a default unsaid.
    missing = [key for key in TRAIN_KEYS if key not in config["train"]]
    if missing:
        raise ConfigError(f"train.{missing[0]} is missing (removed with ~train.{missing[0]}?): conf/config.yaml states each train key")
    return config


def execute(config: dict[str, Any], run_dir: Path, job: JobInfo, overrides: list[str] | None = None) -> dict[str, Any]:
    """Validate and plan once (or read the plan `plan=DIR` names), write the plan to the
    run directory, and run what was written."""
    start_run_dir(config, run_dir)
    reserve(run_dir)
    # A simulated run builds one graph of long-lived objects (its plan, then its timeline)
    # and drops it when it ends: with the collector on between its phases, each phase's
    # first pass walks the whole graph again (0.3-0.4 s CPU of a 1024-GPU Optimus run).
    with collector_paused() if config["backend"]["name"] == "sim" else contextlib.nullcontext(), run_clock():
        summary = _plan_and_run(config, run_dir, job, overrides)
    release(run_dir)
    return summary


def _plan_and_run(config: dict[str, Any], run_dir: Path, job: JobInfo, overrides: list[str] | None) -> dict[str, Any]:
    planned, settings = plan_into(config, run_dir, job, overrides)
    with heartbeat(f"importing backend={settings.backend}"):
        backend = backend_for(settings.backend)
    with options_named(planned.plan.strategy):
        return backend(planned, settings, run_dir)


def plan_into(
    config: dict[str, Any], run_dir: Path, job: JobInfo, overrides: list[str] | None = None
) -> tuple[PlannedRun, RunSettings]:
    """Plan the run (or read the plan `plan=DIR` names) and write it to the run directory."""
    # Building a big model and planning can take minutes, not every part with lines of its own.
    with heartbeat(f"planning {config['strategy'].get('name')} for {config['model'].get('name')} on {config['cluster'].get('name')}"):
        planned, settings = prepare_run(config, job, overrides)
    write_run_dir(run_dir, planned, settings)
    return planned, settings


# An absolute path: the `mmdist` script imports this module, where a relative one would be a package.
@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    job = JobInfo(run_name=run_dir.name, sweep_name=Path(HydraConfig.get().sweep.dir).name if _multirun() else None)
    with signals_end_the_run():
        try:
            config = config_of(cfg)
            run_dir, job, overrides = job_info(config)
            execute(config, run_dir, job, overrides)
        except (ConfigError, SimulationError, WriteError) as err:
            fail(run_dir, job, f"error: {err}", 2)
        except OSError as err:
            if err.filename is None and not is_write_failure(err):  # not a file's (a closed stdout pipe)
                raise
            fail(run_dir, job, f"error: {describe(err, run_dir)}", 2)  # a file of the front door's own (resolved.yaml)
        except Terminated as err:  # the driver stopped its workers; a signal stops a multirun, not only this job
            stopped(run_dir, f"error: {err}", err.exit_code, err.results_written)
        except WorkerFailure as err:
            fail(run_dir, job, f"error: {err}", err.exit_code)
        except (TerminateSignal, KeyboardInterrupt) as signalled:
            how, signum = signal_line(signalled, "preparing the run")
            stopped(run_dir, f"error: {how}: no results written", 128 + signum)


def _multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def fail(run_dir: Path, job: JobInfo, line: str, code: int) -> None:
    """The run's failure said; a single run exits with `code`, a multirun's job returns,
    so that the other jobs go on (the error file records it)."""
    _say_failed(run_dir, line)
    if job.sweep_name is None:
        sys.exit(code)


def stopped(run_dir: Path, line: str, code: int, results_written: bool = False) -> None:
    """A signal ended the run (a multirun too): what the door started is killed, the failure
    said, and the process leaves at once, without the seconds an interpreter holding torch
    takes to tear itself down. A signal in the workers' teardown, after the run's results
    were written, leaves them standing: no error.txt."""
    kill_descendants()
    if results_written:
        release(run_dir)
        log.error(line)
    else:
        _say_failed(run_dir, line)
    leave(code)


def _say_failed(run_dir: Path, line: str) -> None:
    """One line on stderr, in run.log and in the run's error.txt (in the room reserved for
    it: a full disk is reported too)."""
    release(run_dir)
    log.error(line)
    write_error_file(run_dir, line.removeprefix("error: "))


def cli() -> None:
    """`python -m src.run ARGS`, and the `mmdist` command (pyproject.toml's scripts)."""
    problem = unknown_option(sys.argv[1:])
    if problem:
        _refuse(problem)
    refuse_bad_overrides(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
