"""The reproduction scorecard: every number the four papers state in their evaluation,
ours beside it, and whether it holds.

    python -m src.reproduce                    # all four papers, from the stored figure results
    python -m src.reproduce paper=disttrain    # one paper
    python -m src.reproduce --rerun [--jobs 2] # re-run every figure preset the catalogue names first
    python -m src.reproduce --rerun-stale      # re-run only those whose stored results are not current

Reads the headline catalogue (benchmarks/reproduction/<paper>.yaml and the declared ranges of
ranges.yaml, or --catalogue; the presets it names from sweeps/, or --sweeps), each figure's
results (benchmarks/results/figures/<preset>.json, or --results DIR holding
<preset>/results.json sweep directories; a figure with no current results, none or another
version's, scores its rows "not run"),
and writes reproduction.md, .json and .png under --out (default benchmarks/results; one
paper: reproduction_<paper>.* in outputs/reproduction). --rerun runs
each figure afresh in outputs/reproduction/<preset> (its jobs' logs there), printing one line
per figure, and stores its results.json and plot in the results directory before scoring.
--rerun-stale re-runs only the figures with no current results (none stored, or stored by
another version of the preset: after a sweep file is edited or added, or a value of a cluster
preset or measured table its jobs run on changes); a change of code leaves stored results
current, so it needs --rerun.
--papers DIR: the folder holding the papers' texts (each catalogue's `text` file), which the
scorecard then cites there; the repository holds none of them, so by default it cites their
file names alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from src.errors import ConfigError
from src.reproduction.catalogue import CATALOGUE_DIR, SWEEPS_DIR, Catalogue, Presets, load_catalogue, papers_in
from src.reproduction.results import STORE, load_results, stale
from src.reproduction.scorecard import paper_section, score, summary_table, write
from src.sweep import REPO, SweepSpec, figure_jobs, multirun_command
from src.out_paths import output_dir

RUNS = Path("outputs") / "reproduction"
SCORECARD = REPO / "benchmarks" / "results"  # the committed scorecard: all papers


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("selection", nargs="?", default=None, help="paper=<name>: one paper of the catalogue")
    rerun = parser.add_mutually_exclusive_group()
    rerun.add_argument("--rerun", action="store_true", help="re-run the figure presets first (progress per figure)")
    rerun.add_argument(
        "--rerun-stale", action="store_true", help="re-run only the figure presets whose stored results are not current"
    )
    parser.add_argument("--jobs", type=int, default=2, help="figures run at once with --rerun or --rerun-stale (default 2)")
    parser.add_argument("--results", type=Path, default=STORE, help="figure results to read (and write, when re-running)")
    parser.add_argument("--out", type=output_dir, default=None, help="where the scorecard goes (default: see above)")
    parser.add_argument("--catalogue", type=Path, default=CATALOGUE_DIR, help="the headline catalogue, <paper>.yaml each")
    parser.add_argument("--sweeps", type=Path, default=SWEEPS_DIR, help="the figure presets the catalogue names")
    parser.add_argument("--papers", type=Path, default=None, help="the folder of the papers' texts, for the scorecard to cite")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: at least one figure must run at a time")
    papers = papers_in(args.catalogue)
    if not papers:
        raise ConfigError(f"no catalogue in {args.catalogue} (one <paper>.yaml per paper)")
    if args.selection is None:
        return args, papers
    key, _, paper = args.selection.partition("=")
    if key != "paper" or paper not in papers:
        raise ConfigError(f"unknown selection {args.selection!r}: give paper=<name>, one of {', '.join(papers)}")
    return args, [paper]


def run_figure(spec: SweepSpec, path: Path, results: Path) -> tuple[str, float, int]:
    """One figure afresh (no job of an earlier run reused); its results.json and plot are
    copied to the results directory. Returns (error or '', wall seconds, jobs that failed)."""
    sweep_dir = (REPO / RUNS / spec.name).resolve()
    shutil.rmtree(sweep_dir, ignore_errors=True)
    sweep_dir.mkdir(parents=True)
    log = sweep_dir / "run.log"
    print(f"  {spec.name}: {len(figure_jobs(spec))} jobs started (log: {log.relative_to(REPO)})", flush=True)
    start = time.perf_counter()
    with log.open("w") as out:
        command = multirun_command(path, sweep_dir, ["logger=none"])
        code = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    produced = sweep_dir / "results.json"
    if code != 0 or not produced.is_file():
        return f"{spec.name}: the multirun failed (exit {code}); its log is {log}", wall, 0
    results.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(produced, results / f"{spec.name}.json")
    shutil.copyfile(sweep_dir / f"{spec.name}.png", results / f"{spec.name}.png")
    failed = sum(row.get("value") is None for row in json.loads(produced.read_text())["rows"])
    return "", wall, failed


def rerun(specs: list[SweepSpec], presets: Presets, results: Path, jobs: int) -> list[str]:
    """Every figure, `jobs` at a time, one line each as it ends; the failures' lines."""
    print(f"re-running {len(specs)} figures, {jobs} at a time, in {RUNS}/ (the results go to {results})", flush=True)
    start = time.perf_counter()
    errors = []
    largest_first = sorted(specs, key=lambda spec: -len(figure_jobs(spec)))  # the long ones do not end alone
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_figure, spec, presets.path(spec.name), results): spec for spec in largest_first}
        for done, future in enumerate(as_completed(futures), start=1):
            spec = futures[future]
            error, wall, failed = future.result()
            status = f"FAILED: {error}" if error else f"{failed} row(s) did not run" if failed else "ok"
            print(f"[{done}/{len(specs)}] {spec.name}: {wall:.0f} s, {status}", flush=True)
            if error:
                errors.append(error)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"figures re-run in {time.perf_counter() - start:.0f} s wall, {children.ru_utime + children.ru_stime:.0f} s CPU", flush=True)
    return errors


def check_papers(folder: Path, catalogues: list[Catalogue]) -> None:
    """A scorecard cites only texts that are there."""
    missing = [c.text for c in catalogues if not (folder / c.text).is_file()]
    if missing:
        raise ConfigError(f"--papers {folder}: no {', '.join(missing)} there (the catalogue's paper texts)")


def main(argv: list[str] | None = None) -> int:
    try:
        args, papers = parse(argv)
        presets = Presets(args.sweeps)
        catalogues: list[Catalogue] = [load_catalogue(paper, presets, args.catalogue) for paper in papers]
        if args.papers is not None:
            check_papers(args.papers, catalogues)
        names = list(dict.fromkeys(name for c in catalogues for name in c.presets()))
        if args.rerun or args.rerun_stale:
            chosen = [name for name in names if args.rerun or stale(presets[name], args.results)]
            if not chosen:
                print(f"every figure has current results in {args.results}: none re-run", flush=True)
            errors = rerun([presets[name] for name in chosen], presets, args.results, args.jobs) if chosen else []
            if errors:
                print("error: " + "; ".join(errors), file=sys.stderr)
                return 2
        absent = {name: why for name in names if (why := stale(presets[name], args.results))}
        figures = {name: (presets[name], None if name in absent else load_results(presets[name], args.results)) for name in names}
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if absent:
        listed = ", ".join(f"{name} ({why})" for name, why in absent.items())
        print(f"note: no current results of {listed}: their rows read 'not run' (python -m src.reproduce --rerun)", file=sys.stderr)
    scores = [score(c, figures) for c in catalogues]
    stem = "reproduction" if args.selection is None else f"reproduction_{papers[0]}"
    out = args.out or (SCORECARD if args.selection is None else REPO / RUNS)
    results = args.results.resolve()
    source = results.relative_to(REPO) if results.is_relative_to(REPO) else results
    papers_dir = None if args.papers is None else str(args.papers)
    write(scores, out, stem, str(source), papers_dir, absent)
    print(summary_table(scores))
    if len(scores) == 1:
        print("\n" + paper_section(scores[0], papers_dir))
    print(f"\nwrote {out / stem}.md, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
