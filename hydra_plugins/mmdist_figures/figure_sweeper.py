"""A Hydra sweeper that runs one paper figure as a multirun.

    python -m src.run -m +experiment=distmm_fig7_end_to_end [overrides of every job]
    python -m src.run -m +experiment=distmm_fig7_end_to_end hydra/launcher=joblib

The experiment preset (conf/experiment/) selects this sweeper and names the figure's sweep
file (sweeps/); every (group, series) of the figure is one job of the front door, run by
whichever launcher the multirun uses (basic, joblib, submitit local or Slurm), in its own
short subdirectory `<job>_<series>` of the sweep directory. A job whose summary.json exists
is skipped, so an interrupted figure resumes where it stopped; a job that fails leaves its
one-line reason (error.txt) and the others go on. When all jobs are done, the figure's
table, plot and results.json, with the paper's values beside ours, are written to the
sweep directory.

Hydra loads sweepers only from the `hydra_plugins` package: this module is the harness's
plugin; the figure logic itself is src.sweep's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class FigureSweeper(Sweeper):
    def __init__(self, figure: str) -> None:
        self.figure = figure
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        from src.config import plain_config
        from src.errors import ConfigError
        from src.report.wandb_sink import log_figure
        from src.sweep import figure_jobs, find_sweep_file, load_sweep, outcome_of, write_report

        assert self.config is not None and self.launcher is not None
        swept = [o.input_line for o in OverridesParser.create().parse_overrides(arguments) if o.is_sweep_override()]
        if swept:
            raise ConfigError(
                f"a figure's jobs are its sweep file's; {swept} would sweep inside it: run the figure once per value instead"
            )
        spec = load_sweep(find_sweep_file(self.figure))
        out = Path(self.config.hydra.sweep.dir)
        out.mkdir(parents=True, exist_ok=True)
        jobs = figure_jobs(spec)
        pending = [job for job in jobs if outcome_of(out / job.subdir) is None]
        if len(pending) < len(jobs):
            log.info(f"[{spec.name}] resuming: {len(jobs) - len(pending)} of {len(jobs)} jobs already have a summary")
        batch = [[*job.overrides, *arguments, f"hydra.sweep.subdir={job.subdir}"] for job in pending]
        returns = self.launcher.launch(batch, initial_job_idx=0) if batch else []
        report = write_report(spec, {job.key: outcome_of(out / job.subdir) for job in jobs}, out)
        log.info(report)
        # The jobs' own config (the hydra node resolves only inside a job).
        log_figure(plain_config(OmegaConf.masked_copy(self.config, [str(k) for k in self.config if k != "hydra"])), out, spec.name)
        return returns
