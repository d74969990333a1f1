"""On one GPU: the real backend's strategies, and its step against a plain PyTorch loop.

1. Every strategy that fits one GPU (ddp with ZeRO 0-3, megatron tp=1 pp=1) trains tiny
   CLIP for 5 steps in fp32 and in bf16 through the front door (NCCL, cluster=hopper with
   one device): each must finish and write its summary.
2. CLIP at single-device scale (ViT-L/14 at 336 px + its text tower), bf16, one GPU: the
   harness's step time and MFU against a plain PyTorch loop of the same modules, data and
   optimizer (AdamW, autocast bf16, fp32 weights), median over the steps after warm-up.
   MFU = the harness's model FLOPs per iteration / (step time x the preset's datasheet
   peak); the goal is the loop's step time or better, MFU >= 40 %.

    WANDB_MODE=offline python benchmarks/bench_runtime_gpu.py [--batch 64 128] [--steps 8] [--clip-only]
        [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `src` is the repository's package
ONE_GPU = ["backend=torch", "cluster=hopper", "cluster.nodes=1", "cluster.devices_per_node=1", "cluster.amp=true", "logger=none"]
TINY = ["model=clip", "model.scale=tiny", "train.global_batch=8", "train.steps=5"]
STRATEGIES = {f"ddp zero{z}": ["strategy=ddp", f"strategy.zero_stage={z}"] for z in range(4)}
STRATEGIES["megatron tp1 pp1"] = [
    "strategy=megatron",
    "strategy.tp=1",
    "strategy.pp=1",
    "strategy.recompute=none",
    "strategy.zero_stage=0",
    "strategy.micro_batch_size=8",
]


def run_all(named: dict[str, list[str]], root: Path) -> dict[str, dict]:
    """Every configuration back to back in ONE launch of one worker (start-up paid once),
    as the front door would run each; a failed launch is reported for every run."""
    from src.config import composed
    from src.report import JobInfo
    from src.runtime.backend import ready
    from src.runtime.driver import launch
    from src.runtime.errors import WorkerFailure
    from src.setup import prepare_run, start_run_dir, write_run_dir

    dirs = {}
    for name, overrides in named.items():
        config = composed(overrides)
        dirs[name] = root / name.replace(" ", "_")
        start_run_dir(config, dirs[name])
        planned, settings = prepare_run(config, JobInfo(run_name=name))
        write_run_dir(dirs[name], planned, settings)
        backend = ready(planned, settings, dirs[name])
    try:
        launch(list(dirs.values()), 1, backend)
    except WorkerFailure as err:
        return {name: {"error": str(err)} for name in dirs}
    out = {}
    for name, d in dirs.items():
        out[name] = json.loads((d / "summary.json").read_text())
        # The last step's spans of rank 0, by instruction: where the step's time went.
        events = json.loads((d / "trace.json").read_text())["traceEvents"]
        out[name]["instructions_s"] = [(e["name"], e["dur"] / 1e6) for e in events if e.get("ph") == "X" and e.get("dur", 0) > 500]
    return out


def plain_loop(batch: int, steps: int) -> tuple[list[float], list[dict[str, float]]]:
    """Step times of a plain PyTorch bf16 loop over the same CLIP modules and data."""
    import torch
    from torch import nn

    from src.models.registry import build_model
    from src.runtime.inputs import dataset_for, unit_fields
    from src.runtime.modules.units import build_units
    from src.data.synthetic import collate

    device = torch.device("cuda")
    model = build_model({"name": "clip", "scale": "single_device"})
    units = build_units(model, 0, {}, {u.name: set(range(u.num_layers)) for u in model.units}).to(device)
    optimizer = torch.optim.AdamW([p for p in units.parameters() if p.requires_grad], lr=1e-4)
    dataset = dataset_for(model, 0, "synthetic")
    times, phases = [], []
    for step in range(steps):
        rows = collate([dataset[i] for i in range(step * batch, (step + 1) * batch)])
        rows = {k: v.to(device) for k, v in rows.items()}
        torch.cuda.synchronize()
        start = time.perf_counter()
        marks = [start]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            features = {}
            for name in ("vision", "text"):
                state = unit_fields(model, name, rows)
                for layer in cast(nn.ModuleList, units[name]):
                    state = layer(state)
                features[name] = state["feature"]
            v, t = features["vision"], features["text"]
            loss = cast(nn.ModuleList, units["interaction"])[0]((0, v), (0, t), v, t) / batch
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        loss.float().backward()
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        times.append(marks[-1] - start)
        phases.append({p: b - a for p, a, b in zip(("forward", "backward", "optimizer"), marks, marks[1:])})
    phases[-1]["device_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del units, optimizer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return times, phases


def main() -> None:
    from src.out_paths import output_file, write_file  # a path it could not write, refused before the GPU's time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--clip-only", action="store_true", help="skip the tiny runs of every strategy")
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():  # it would run its CLIP on the CPU until killed
        print("error: benchmarks/bench_runtime_gpu.py needs a CUDA GPU, and torch sees none on this machine", file=sys.stderr)
        sys.exit(2)
    results: dict = {"strategies": {}, "clip": {}}
    named = (
        {}
        if args.clip_only
        else {
            f"{name} {precision}": ONE_GPU + TINY + overrides + [f"train.precision={precision}"]
            for name, overrides in STRATEGIES.items()
            for precision in ("fp32", "bf16")
        }
    )
    for batch in args.batch:
        named[f"clip batch {batch}"] = ONE_GPU + [
            "model=clip",
            "model.scale=single_device",
            f"train.global_batch={batch}",
            f"train.steps={args.steps}",
            "train.precision=bf16",
            "strategy=ddp",
            "strategy.zero_stage=0",
        ]
    with tempfile.TemporaryDirectory() as tmp:
        summaries = run_all(named, Path(tmp))
    for name, summary in summaries.items():
        if name.startswith("clip"):
            continue
        row = (
            summary
            if "error" in summary
            else {
                "losses": summary["measured"]["loss"],
                "step_time_s": summary["iteration_time_s"],
                "mfu": summary["mfu"],
                "dist_backend": summary["dist_backend"],
                "device": summary.get("device"),
            }
        )
        results["strategies"][name] = row
        print(f"{name:22s}: {row}", flush=True)
    for batch in args.batch:
        harness = summaries[f"clip batch {batch}"]
        if "error" in harness:
            results["clip"][batch] = harness
            continue
        loop, phases = plain_loop(batch, args.steps)
        plain = statistics.median(loop[1:])
        flops, peak = harness["model_flops_per_iteration"], harness["peak_flops_per_device"]
        results["clip"][batch] = {
            "harness_step_s": harness["iteration_time_s"],
            "harness_mfu": harness["mfu"],
            "harness_losses": harness["measured"]["loss"],
            "plain_step_s": plain,
            "plain_mfu": flops / (plain * peak),
            "ratio_harness_over_plain": harness["iteration_time_s"] / plain,
            "peak_flops": peak,
            "measured_gemm_flops": harness.get("measured_gemm_flops_per_device"),
            "device": harness.get("device"),
            "breakdown_s": harness["breakdown_s"],
            "harness_device_peak_gib": harness["memory_gib"].get("measured_device_peak_gib"),
            "plain_device_peak_gib": phases[-1].pop("device_peak_gib"),
            "plain_phases_s": {p: statistics.median(x[p] for x in phases[1:]) for p in phases[0]},
            "harness_instructions_s": harness["instructions_s"],
        }
        print(json.dumps({batch: {k: v for k, v in results["clip"][batch].items() if k != "harness_losses"}}, indent=1), flush=True)
    if args.out:
        write_file(args.out, json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
