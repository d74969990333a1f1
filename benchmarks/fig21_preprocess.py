"""DistTrain Fig. 21, measured: the preprocessing time a trainer sees, inline against
disaggregated, by images per iteration and image resolution.

    python benchmarks/fig21_preprocess.py [--resolutions 256 512 1024] [--batches 8 32] [--steps 6] [--out DIR | --update]

Each point is a real run through the front door: the tiny MLLM (model=mllm_9b
model.scale=tiny) under strategy=disttrain on this machine's CPU workers, reading JPEG
image-caption tar shards written here at the given resolution (decoded and resized to
the encoder's input and the generator's target, per sample, as real training does). A
run's preprocessing time seen by the trainer is the median over steps 1.. of data_wait_s
(the longest wait of any trainer for its step's batches; step 0 also waits for the
producer's start); the step time beside it is the median step_time_s, so that what
disaggregation costs the trainers' cores shows too. Writes disttrain_fig21.{md,json} into
--out (outputs/fig21_preprocess); `--update` writes the committed
benchmarks/results/ copies instead.

The paper (DistTrain, Fig. 21) reports preprocessing dropping from seconds to
milliseconds with dedicated CPU nodes; here the producers share the trainers' cores.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SAMPLES = 64  # distinct images per resolution (a run's samples wrap around them)
RUN = ["backend=torch", "cluster=local", "model=mllm_9b", "model.scale=tiny", "strategy=disttrain", "train.data=uniform"]


def write_shard(path: Path, resolution: int) -> None:
    """JPEG photos-like images (smooth gradients plus noise, so that they compress as
    photos do, not as flat colour) with short captions."""
    rng = np.random.default_rng(resolution)
    ramp = np.linspace(0, 255, resolution, dtype=np.float32)
    with tarfile.open(path, "w") as tar:
        for i in range(SAMPLES):
            base = (ramp[None, :, None] * rng.random(3) + ramp[:, None, None] * rng.random(3)) / 2
            pixels = np.clip(base + rng.normal(0, 20, (resolution, resolution, 3)), 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
            for name, data in ((f"{i:05d}.jpg", buffer.getvalue()), (f"{i:05d}.txt", f"picture {i} at {resolution}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def run(shards: str, batch: int, preprocess: str, steps: int, run_dir: Path) -> dict[str, float]:
    overrides = [f"backend.data={shards}", f"train.global_batch={batch}", f"backend.preprocess={preprocess}"]
    overrides += [f"train.steps={steps}", "logger=none", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "src.run", *RUN, *overrides], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(overrides)}): {done.stderr.strip().splitlines()[-1]}")
    measured = json.loads((run_dir / "summary.json").read_text())["measured"]
    return {
        "data_wait_ms": 1e3 * statistics.median(measured["data_wait_s"][1:]),
        "step_ms": 1e3 * statistics.median(measured["step_time_s"][1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=6)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=ROOT / "outputs" / "fig21_preprocess", help="where to write the results")
    where.add_argument("--update", action="store_true", help=f"write the committed results ({RESULTS.relative_to(ROOT)}) instead")
    args = parser.parse_args()
    out = RESULTS if args.update else args.out
    if args.steps < 2:
        raise SystemExit(f"--steps={args.steps}: at least 2 (step 0 also waits for the producer's start)")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for resolution in args.resolutions:
            shard = Path(scratch) / f"r{resolution}-0.tar"
            write_shard(shard, resolution)
            for batch in args.batches:
                row: dict[str, float | int] = {"resolution": resolution, "images_per_iteration": batch}
                for preprocess in ("inline", "disaggregated"):
                    measured = run(str(shard), batch, preprocess, args.steps, Path(scratch) / f"{resolution}-{batch}-{preprocess}")
                    row.update({f"{preprocess}_{k}": v for k, v in measured.items()})
                rows.append(row)
                print(
                    f"{resolution:>5} px  {batch:>3} images  data wait inline {row['inline_data_wait_ms']:8.1f} ms  "
                    f"disaggregated {row['disaggregated_data_wait_ms']:7.1f} ms  |  step inline {row['inline_step_ms']:6.1f} ms  "
                    f"disaggregated {row['disaggregated_step_ms']:6.1f} ms",
                    flush=True,
                )
    load = os.getloadavg()[0]
    out.mkdir(parents=True, exist_ok=True)
    (out / "disttrain_fig21.json").write_text(json.dumps({"rows": rows, "load_average": load, "cpus": os.cpu_count()}, indent=2))
    lines = [
        "# DistTrain Fig. 21 (measured): preprocessing time seen by the trainer",
        "",
        f"`python benchmarks/fig21_preprocess.py` on {os.cpu_count()} CPU cores (1-minute load average {load:.1f} at the end);",
        "tiny MLLM, strategy=disttrain, JPEG tar shards; medians over steps 1.. of each run. Paper: seconds -> milliseconds.",
        "",
        "| resolution | images / iteration | data wait inline (ms) | data wait disaggregated (ms) "
        "| step inline (ms) | step disaggregated (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['resolution']} | {r['images_per_iteration']} | {r['inline_data_wait_ms']:.1f} | "
            f"{r['disaggregated_data_wait_ms']:.1f} | {r['inline_step_ms']:.1f} | {r['disaggregated_step_ms']:.1f} |"
        )
    lines += [
        "",
        "The producers here share the trainers' cores (the paper's run on dedicated CPU nodes), so",
        "disaggregation can lengthen the step while it removes the wait: on a small machine it moves",
        "the decoding off the trainer's critical path, not off its cores.",
    ]
    (out / "disttrain_fig21.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'disttrain_fig21.md'} and .json", flush=True)


if __name__ == "__main__":
    main()
