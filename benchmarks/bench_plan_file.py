"""Benchmark: the plan file at MegaScale's size (175B on 12288 GPUs, bench_sim_megatron.py's
second case) and at Optimus's (its 175B MLLM on Frontier and Perlmutter: ~290 000
instructions, 45 MB).

- The front door's total: `python -m src.run ... logger=none` as a user runs it (Hydra,
  validation, planning, writing plan.json, simulating, the summary), one process and the
  planner's pool (children's CPU counted). Targets: MegaScale <= 2 s CPU; Optimus <= 10 s.
- Writing the plan file (src.plan_io.write_plan, as the door calls it, on the plan the
  command wrote, read back): at most 10 % of its command's CPU; read back identical.
- A worker started from the written plan: a fresh interpreter that imports the worker
  entry, reads plan.json and run.json for a world of 12288 (src.runtime.worker.load), and
  derives what it holds from the plan (its placements, its class's instructions, the
  process-group families every rank walks), for one rank of each rank class.
  Target: <= 1 s per worker.

Prints CPU (process_time / the child's rusage) and wall times; the machine may be shared,
so the wall time counts others' load.

    python benchmarks/bench_plan_file.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: this repository's src
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_sim_megatron import CASES  # noqa: E402

MEGASCALE = CASES["MegaScale 175B, 12288 GPUs, vpp 6, batch 6144"][1]
OPTIMUS = {
    cluster: ["model=optimus", "strategy=optimus", f"cluster={cluster}", "logger=none"] for cluster in ("frontier", "perlmutter")
}
FRONT_DOOR_TARGET_S = 2.0
OPTIMUS_TARGET_S = 10.0
WRITE_SHARE_TARGET = 0.10
WORKER_TARGET_S = 1.0

# Run in a fresh interpreter per rank: everything a worker does with the plan before
# torch.distributed, timed from its first line.
WORKER = """
import json, sys, time
start, start_cpu = time.perf_counter(), time.process_time()
from pathlib import Path
from src.runtime.worker import load
from src.runtime.placement import placements
run_dir, rank, world = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
imported = time.process_time()
[(planned, settings)] = load([run_dir], world)
loaded = time.process_time()
plan = planned.plan
places = placements(plan, rank)
instructions = plan.program.class_of(rank).instructions
families = [g.family or (g.ranks,) for g in plan.program.groups.values()]
families += [f for u in plan.units for f in (u.mesh.family("tp"), u.mesh.family("dp"))]
groups = {tuple(m) for family in families for m in family}
print(json.dumps({"cpu_s": time.process_time() - start_cpu, "wall_s": time.perf_counter() - start,
                  "imports_cpu_s": imported - start_cpu, "load_cpu_s": loaded - imported,
                  "instructions": len(instructions), "groups": len(groups)}))
"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def front_door(run_dir: Path, overrides: list[str]) -> tuple[float, float]:
    before, start = _children_cpu(), time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "src.run", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        env={"WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin"},
    )
    return _children_cpu() - before, time.perf_counter() - start


def worker_start(run_dir: Path, rank: int, world: int) -> dict:
    """The worker's own timings, and its whole process's CPU (the interpreter's start too)."""
    before = _children_cpu()
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(run_dir), str(rank), str(world)], cwd=REPO, check=True, capture_output=True, text=True
    )
    return {**json.loads(out.stdout), "process_cpu_s": _children_cpu() - before}


def plan_write(run_dir: Path) -> tuple[float, float, bool]:
    """CPU and wall seconds of writing the plan the command wrote, and whether it reads back identical."""
    from src.plan_io import read_plan, write_plan

    planned = read_plan(run_dir)
    with tempfile.TemporaryDirectory() as tmp:
        start_cpu, start = time.process_time(), time.perf_counter()
        write_plan(Path(tmp), planned)
        cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
        return cpu, wall, read_plan(Path(tmp)) == planned


def optimus() -> None:
    for cluster, overrides in OPTIMUS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cpu, wall = front_door(Path(tmp), overrides)
            write_cpu, write_wall, identical = plan_write(Path(tmp))
            size = (Path(tmp) / "plan.json").stat().st_size
        print(f"front door, Optimus 175B MLLM on {cluster}: {cpu:.2f} s CPU, {wall:.2f} s wall (target <= {OPTIMUS_TARGET_S:g} s CPU)")
        print(
            f"  plan.json: {size / 2**20:.1f} MiB, written in {write_cpu:.2f} s CPU ({write_wall:.2f} s wall): "
            f"{write_cpu / cpu:.1%} of the command's CPU (target <= {WRITE_SHARE_TARGET:.0%}); read back identical: {identical}"
        )


def main() -> None:
    from src.config import TorchBackendSpec
    from src.plan_io import RunSettings, read_plan, write_settings
    from src.report import JobInfo

    optimus()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        cpu, wall = front_door(run_dir, MEGASCALE)
        size = (run_dir / "plan.json").stat().st_size
        print(f"front door, MegaScale 175B on 12288 GPUs: {cpu:.2f} s CPU, {wall:.2f} s wall (target <= {FRONT_DOOR_TARGET_S:g} s)")
        print(f"  plan.json: {size / 2**20:.1f} MiB")

        # The workers' settings, as the real backend would write them beside the plan.
        backend = TorchBackendSpec(
            workers=8,
            dist_backend="nccl",
            timeout_s=600.0,
            threads_per_worker=1,
            data="synthetic",
            data_errors="fail",
            preprocess="inline",
            prefetch_steps=2,
        )
        write_settings(run_dir, RunSettings("torch", backend, JobInfo(run_name="megascale"), {}))
        planned = read_plan(run_dir)
        world = planned.plan.devices
        worst = 0.0
        for rank_program in planned.plan.program.classes:
            rank = rank_program.ranks[0]
            got = worker_start(run_dir, rank, world)
            worst = max(worst, got["process_cpu_s"])
            print(
                f"  worker rank {rank:5d} ({rank_program.label}): {got['process_cpu_s']:.2f} s CPU for its process, of which "
                f"{got['imports_cpu_s']:.2f} imports and {got['load_cpu_s']:.2f} reading the plan; {got['wall_s']:.2f} s wall "
                f"from its first line; {got['instructions']} instructions, {got['groups']} groups"
            )
        print(f"slowest worker start from the written plan: {worst:.2f} s CPU (target <= {WORKER_TARGET_S:g} s)")


if __name__ == "__main__":
    main()
