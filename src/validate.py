"""The simulator against real runs of the same Program, on this machine.

    python -m src.validate [--out validation] [--steps 6] [--only megatron]
    python -m src.validate --reprice benchmarks/results/validation/validation.json [--host 'CPU model']


Each case of the grid (every strategy the real backend runs, on 2 and 4 workers, two model
sizes) runs twice through the front door: `backend=torch` measures it, `backend=sim` prices
the very same plan on the `local` preset. The table gives the measured and predicted
iteration times with their error and, per breakdown category, the measured and predicted
seconds; the MAPE and how many cases the simulator under- and over-predicts close it.
Writes validation.json, validation.md and validation.png under --out. The `local`
preset's figures come from `python -m src.calibrate`.

`--reprice FILE` runs nothing: it prices every case of a stored validation.json again with
the simulator as it is now (on the `local` preset) and sets the new
predictions against the stored measurements, so that a change to the cost model is checked
against the measurements it was not made from. It prices them with the profile of the CPU model
that measured them (the file's `host`, which every run records; `--host` for an older file), not
this host's. The table it writes says that it re-priced, and with which profile.

Timings are this machine's: run it when nothing else loads the cores (validation.json
records the load averages at the end).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from src.cluster_profile import host_identity
from src.errors import ConfigError
from src.report import plotting
from src.out_paths import output_dir
from src.timeline import BREAKDOWN_CATEGORIES, Timeline

# Two sizes of one GPT (a transformer's GEMMs and collectives; custom sizes need no preset),
# without dropout: the real backend trains without it, and the simulator prices the same model.
GPT_SIZES = {
    "gpt-s": [
        "model=gpt",
        "model.preset=null",
        "model.dropout=false",
        "model.layers=4",
        "model.hidden=128",
        "model.heads=4",
        "model.vocab=512",
        "train.seq_len=64",
        "train.global_batch=16",
    ],
    "gpt-m": [
        "model=gpt",
        "model.preset=null",
        "model.dropout=false",
        "model.layers=4",
        "model.hidden=384",
        "model.heads=8",
        "model.vocab=1024",
        "train.seq_len=128",
        "train.global_batch=16",
    ],
}
CLIP = ["model=clip", "model.scale=tiny"]


@dataclass(frozen=True)
class Case:
    name: str
    workers: int
    overrides: tuple[str, ...]


def grid() -> list[Case]:
    cases = []
    for size, model in GPT_SIZES.items():
        for workers in (2, 4):
            strategies = {
                "ddp-z0": ["strategy=ddp", "strategy.zero_stage=0"],
                "ddp-z2": ["strategy=ddp", "strategy.zero_stage=2"],
                # DeepSpeed's stage 3: every module's tensors partitioned (the small models' are all below
                # its default persistence threshold), gathered before its forward and backward
                "ddp-z3": ["strategy=ddp", "strategy.zero_stage=3", "strategy.param_persistence_threshold=0"],
                "megatron-tp": [
                    "strategy=megatron",
                    f"strategy.tp={workers}",
                    "strategy.pp=1",
                    "strategy.sequence_parallel=false",
                ],  # the real backend runs no SP
                # pp 2, and dp 2 on 4 workers
                "megatron-pp": [
                    "strategy=megatron",
                    "strategy.tp=1",
                    "strategy.pp=2",
                    "strategy.micro_batch_size=2",
                    "strategy.schedule=1f1b",
                ],
                # priced with PyTorch's fused softmax, which the workers' attention runs, not the unfused one of
                # DeepSpeed-3D's codebase (strategy.unfused)
                "deepspeed3d": [
                    "strategy=deepspeed3d",
                    "strategy.tp=1",
                    "strategy.pp=2",
                    "strategy.micro_batch_size=2",
                    "model.unfused=[]",
                ],
            }
            for label, strategy in strategies.items():
                cases.append(Case(f"{size}/{label}", workers, tuple(model + strategy)))
    for workers in (2, 4):
        cases.append(Case("clip-tiny/distmm", workers, tuple(CLIP + ["strategy=distmm"])))
    return cases


def _front_door(overrides: list[str], run_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The summary of one run, or None with the run's last line."""
    command = [sys.executable, "-m", "src.run", *overrides, "logger=none", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, capture_output=True, text=True)
    summary = run_dir / "summary.json"
    if done.returncode != 0 or not summary.exists():
        lines = (done.stderr or done.stdout).strip().splitlines()
        return None, lines[-1] if lines else f"exit {done.returncode}"
    return json.loads(summary.read_text()), ""


def _categories(summary: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in summary["breakdown_s"].items() if k in BREAKDOWN_CATEGORIES}


def validate_case(case: Case, out: Path, steps: int) -> dict[str, Any]:
    common = [*case.overrides, "cluster=local", f"cluster.devices_per_node={case.workers}"]
    row: dict[str, Any] = {"case": case.name, "workers": case.workers}
    where = out / case.name / f"{case.workers}w"
    measured, why = _front_door([*common, "backend=torch", f"train.steps={steps}"], where / "torch")
    if measured is None:
        return {**row, "error": f"torch: {why}"}
    predicted, why = _front_door([*common, "backend=sim"], where / "sim")
    if predicted is None:
        return {**row, "error": f"sim: {why}"}
    m, p = measured["iteration_time_s"], predicted["iteration_time_s"]
    return {
        **row,
        "measured_s": m,
        "predicted_s": p,
        "error_pct": 100.0 * (p - m) / m,
        "measured_breakdown_s": _categories(measured),
        "predicted_breakdown_s": _categories(predicted),
    }


def simulated(overrides: list[str]) -> tuple[dict[str, Any], Timeline]:
    """The summary a `backend=sim` run of these overrides reports, and its timeline, in this process."""
    from src.config import composed
    from src.metrics import summarize
    from src.plan_io import PlannedRun
    from src.setup import plan_run, validate
    from src.sim.engine import simulate

    setup = validate(composed([*overrides, "backend=sim", "logger=none"]))
    plan = plan_run(setup)
    timeline = simulate(plan.program, setup.model, setup.cluster, plan.precision)
    return summarize(PlannedRun(setup.model, setup.cluster, setup.train, plan), timeline), timeline


def predict(case: Case, cpu_model: str | None = None) -> dict[str, Any]:
    """The simulator's summary of one case, in this process (what `backend=sim` reports), with
    the host profile of `cpu_model` (default: this host's)."""
    host = [f"cluster.profile_cpu='{cpu_model}'"] if cpu_model is not None else []
    return simulated([*case.overrides, "cluster=local", f"cluster.devices_per_node={case.workers}", *host])[0]


def reprice(rows: list[dict[str, Any]], cpu_model: str | None = None) -> list[dict[str, Any]]:
    """The stored rows with their predictions priced again, with the profile of the CPU model
    that measured them; a row without a measurement stays as it was."""
    cases = {(c.name, c.workers): c for c in grid()}
    out = []
    for row in rows:
        case = cases.get((row["case"], row["workers"]))
        if "measured_s" not in row or case is None:
            out.append(row)
            continue
        predicted = predict(case, cpu_model)
        p, m = predicted["iteration_time_s"], row["measured_s"]
        out.append({**row, "predicted_s": p, "error_pct": 100.0 * (p - m) / m, "predicted_breakdown_s": _categories(predicted)})
    return out


def mape(rows: list[dict[str, Any]]) -> float | None:
    errors = [abs(r["error_pct"]) for r in rows if "error_pct" in r]
    return statistics.fmean(errors) if errors else None


def sign_split(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(cases predicted faster than measured, cases predicted slower or equal)."""
    errors = [r["error_pct"] for r in rows if "error_pct" in r]
    return sum(e < 0 for e in errors), sum(e >= 0 for e in errors)


def _shown_categories(rows: list[dict[str, Any]]) -> list[str]:
    """The categories some case spends time in, in the breakdown's order."""
    used = {k for r in rows for side in ("measured_breakdown_s", "predicted_breakdown_s") for k, v in r.get(side, {}).items() if v > 0}
    return [k for k in BREAKDOWN_CATEGORIES if k in used]


def table(rows: list[dict[str, Any]]) -> str:
    categories = _shown_categories(rows)
    header = ["case", "workers", "measured ms", "predicted ms", "error %"] + [f"{c} ms (meas/pred)" for c in categories]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['workers']} | failed: {r['error']} |" + " |" * (len(header) - 3))
            continue
        cells = [
            r["case"],
            str(r["workers"]),
            f"{1e3 * r['measured_s']:.1f}",
            f"{1e3 * r['predicted_s']:.1f}",
            f"{r['error_pct']:+.1f}",
        ]
        cells += [
            f"{1e3 * r['measured_breakdown_s'].get(c, 0.0):.1f} / {1e3 * r['predicted_breakdown_s'].get(c, 0.0):.1f}"
            for c in categories
        ]
        lines.append("| " + " | ".join(cells) + " |")
    score = mape(rows)
    lines.append("")
    if score is None:
        lines.append("iteration-time MAPE: no case finished")
        return "\n".join(lines)
    fast, slow = sign_split(rows)
    lines.append(f"iteration-time MAPE: {score:.1f} % over {fast + slow} cases")
    lines.append(f"predicted faster than measured: {fast} cases ({100 * fast / (fast + slow):.0f} %), slower: {slow}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    done = [r for r in rows if "error_pct" in r]
    if not done:
        return
    fig, (ax,) = plotting.new_figure(8.0, 6.0)
    for workers, marker in ((2, "o"), (4, "s")):
        mine = [r for r in done if r["workers"] == workers]
        ax.scatter(
            [1e3 * r["measured_s"] for r in mine], [1e3 * r["predicted_s"] for r in mine], marker=marker, label=f"{workers} workers"
        )
        for r in mine:
            ax.annotate(r["case"], (1e3 * r["measured_s"], 1e3 * r["predicted_s"]), fontsize=6, annotation_clip=True)
    top = 1.1e3 * max(max(r["measured_s"], r["predicted_s"]) for r in done)
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="predicted = measured")
    ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="grey", alpha=0.15, label="±10 %")
    # Room on the right for the case names beside the largest points.
    ax.set_xlim(0, 1.25 * top)
    ax.set_ylim(0, 1.1 * top)
    ax.set_xlabel("measured iteration time (ms)")
    ax.set_ylabel("predicted iteration time (ms)")
    plotting.title(ax, f"simulator vs real backend (MAPE {mape(done):.1f} %)")
    plotting.legend_outside(fig)
    plotting.save(fig, path)


def _load() -> list[float]:
    """The host's load averages when the table was made (the real runs' times are this
    machine's: a loaded machine slows them)."""
    import os

    return [round(x, 2) for x in os.getloadavg()]


def measuring_cpu(before: dict[str, Any], stored: Path, given: str | None) -> str:
    """The CPU model that measured a stored validation: the one it records, or the one given;
    stored measurements priced with another host's profile would say nothing of the simulator."""
    from src.cluster_profile import profiled_cpu_models

    recorded = (before.get("host") or {}).get("cpu_model")
    if recorded is not None and given is not None and given != recorded:
        raise ConfigError(f"--host {given!r}: {stored} was measured on {recorded!r}")
    cpu = recorded or given
    if cpu is None:
        raise ConfigError(
            f"{stored} does not say which CPU measured it: pass --host 'CPU model' "
            f"(local's profiles were measured on {profiled_cpu_models('local')})"
        )
    return str(cpu)


def _write_repriced(stored: Path, out: Path, given_host: str | None = None) -> None:
    if not stored.is_file():
        raise ConfigError(f"--reprice {stored}: no such file")
    before = json.loads(stored.read_text())
    cpu = measuring_cpu(before, stored, given_host)
    rows = reprice(before["rows"], cpu)
    fast, slow = sign_split(rows)
    summary = {
        "repriced_from": str(stored),
        "host": before.get("host") or {"cpu_model": cpu},
        "stored_mape_pct": before.get("mape_pct"),
        "rows": rows,
        "mape_pct": mape(rows),
        "predicted_faster": fast,
        "predicted_slower": slow,
        "load_when_measured": before.get("load"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "repriced.json").write_text(json.dumps(summary, indent=2) + "\n")
    header = (
        f"Re-priced by the current simulator against the measurements stored in {stored} (no case was run again), "
        f"with the profile of the CPU that measured them ({cpu}).\n\n"
    )
    text = header + table(rows)
    (out / "repriced.md").write_text(text + "\n")
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_dir, default=Path("validation"))
    parser.add_argument("--steps", type=int, default=6, help="real steps per case (the first is warm-up)")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument(
        "--reprice", type=Path, default=None, help="a stored validation.json: price its cases again, run nothing, write under --out"
    )
    parser.add_argument(
        "--host", default=None, help="with --reprice: the CPU model that measured a file recording none (its profile prices it)"
    )
    args = parser.parse_args()
    if args.host is not None and args.reprice is None:
        parser.error("--host goes with --reprice (a run records its own host)")
    if args.reprice is not None:
        try:
            _write_repriced(args.reprice, args.out, args.host)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the first step is warm-up and not measured)")
    cases = [c for c in grid() if args.only in c.name]
    if not cases:
        parser.error(f"--only {args.only!r} matches no case of {[c.name for c in grid()]}")
    rows = []
    for index, case in enumerate(cases):
        row = validate_case(case, args.out, args.steps)
        rows.append(row)
        shown = (
            row.get("error")
            or f"measured {1e3 * row['measured_s']:.1f} ms, predicted {1e3 * row['predicted_s']:.1f} ms ({row['error_pct']:+.1f} %)"
        )
        print(f"[{index + 1}/{len(cases)}] {case.name} on {case.workers} workers: {shown}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    fast, slow = sign_split(rows)
    summary = {
        "rows": rows,
        "mape_pct": mape(rows),
        "predicted_faster": fast,
        "predicted_slower": slow,
        "load": _load(),
        "host": host_identity(),
    }
    (args.out / "validation.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = table(rows)
    (args.out / "validation.md").write_text(text + "\n")
    plot(rows, args.out / "validation.png")
    print(text)


if __name__ == "__main__":
    main()
