"""The front door: compose the config, plan, write the plan, execute it, report.

python -m src.run model=clip strategy=megatron
python -m src.run -m model=clip,coca,lit strategy=megatron
python -m src.run backend=torch plan=outputs/<run>/<time>   # run a written plan
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from src.backends import backend_for
from src.config import plain_config
from src.errors import ConfigError
from src.progress import heartbeat
from src.report import JobInfo
from src.report.files import WriteError, unwritable_dir, write_failure
from src.runtime.errors import Terminated, WorkerFailure
from src.setup import ERROR_FILE, job_info, options_named, prepare_run, start_run_dir, write_run_dir
from src.sim.engine import SimulationError

log = logging.getLogger("src.run")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def refuse_bad_overrides(args: list[str]) -> None:
    """Compose a single run's overrides before Hydra runs them, so that a key or option
    Hydra cannot compose is one line and exit 2 (Hydra itself prints several lines and
    exits 1). Multiruns, sweeps and Hydra's own flags are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if any(arg.startswith("-") for arg in args):
        return
    try:
        if any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(args)):
            return
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=args, return_hydra_config=True)
    except HydraException as err:
        print(f"error: {_one_line(str(err))}", file=sys.stderr)
        sys.exit(2)
    # Hydra creates the run directory before main, and a failure there is its traceback.
    problem = unwritable_dir(Path(str(cfg.hydra.run.dir)))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def _one_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1 and lines[1].startswith("Available options"):
        options = lines[2 : lines.index("Config search path:")] if "Config search path:" in lines else lines[2:]
        return f"{lines[0]}; choose one of {', '.join(options)}"
    return "; ".join(line.rstrip(".") for line in lines[:3])


def execute(config: dict[str, Any], run_dir: Path, job: JobInfo, overrides: list[str] | None = None) -> dict[str, Any]:
    """Validate and plan once (or read the plan `plan=DIR` names), write the plan to the
    run directory, and run what was written."""
    start_run_dir(config, run_dir)
    # Building a big model and planning can take minutes, not every part with lines of its own.
    with heartbeat(f"planning {config['strategy'].get('name')} for {config['model'].get('name')} on {config['cluster'].get('name')}"):
        planned, settings = prepare_run(config, job, overrides)
    write_run_dir(run_dir, planned, settings)
    with options_named(planned.plan.strategy):
        return backend_for(settings.backend)(planned, settings, run_dir)


# An absolute path: the `mmdist` script imports this module, where a relative one would be a package.
@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    config = plain_config(cfg)
    run_dir, job, overrides = job_info(config)
    try:
        execute(config, run_dir, job, overrides)
    except (ConfigError, SimulationError, WriteError) as err:
        fail(run_dir, job, f"error: {err}", 2)
    except OSError as err:
        if err.filename is None:  # not a file's (a closed stdout pipe): not the run directory's to report
            raise
        fail(run_dir, job, f"error: {write_failure(err)}", 2)  # a file of the front door's own (resolved.yaml)
    except WorkerFailure as err:  # SIGTERM (Terminated) stops a multirun, not only this job, as Ctrl-C does
        fail(run_dir, job, f"error: {err}", err.exit_code, stop_all=isinstance(err, Terminated))
    except KeyboardInterrupt:
        # The driver has already stopped every worker it started.
        log.error("error: interrupted; all workers stopped")
        sys.exit(130)


def fail(run_dir: Path, job: JobInfo, line: str, code: int, stop_all: bool = False) -> None:
    """One line on stderr and in the run's error file. A single run exits with `code`; a
    multirun's job returns, so that the other jobs go on (the error file records it),
    unless `stop_all`."""
    log.error(line)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / ERROR_FILE).write_text(line.removeprefix("error: ") + "\n")
    except OSError:  # the directory does not allow it (the line above says why, if that is the error)
        (run_dir / ERROR_FILE).unlink(missing_ok=True)  # an empty one would say nothing
    if job.sweep_name is None or stop_all:
        sys.exit(code)


def cli() -> None:
    """`python -m src.run ARGS`, and the `mmdist` command (pyproject.toml's scripts)."""
    refuse_bad_overrides(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
