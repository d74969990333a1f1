"""Benchmark: a rank materialises only its shard. Per-rank peak RSS of a ~1B-parameter GPT
trained for real on 4 CPU workers with tp=2, pp=2, against the size of the whole model.

    python benchmarks/bench_runtime_memory.py [--layers 20] [--hidden 2048] [--steps 1]

The run is the front door as a user runs it (`python -m src.run backend=torch ...`,
megatron tp=2 pp=2, fp32, AdamW through DeepSpeed ZeRO-0). Each rank holds a quarter of
the parameters (half the layers, half of each layer's TP-split weights; embeddings and
heads whole on their stage), so its expected footprint is its shard's parameters x 16
bytes (weights, gradients and Adam's two moments in fp32) plus the process's base. A rank
that built the whole model before slicing it would peak at the whole model's weights or
more. Printed: the whole model's parameters and fp32 weight bytes, each rank's peak RSS
(`memory_gib.measured_rss_gib_by_rank` of the run's summary) and its ratio to the whole.
Beyond that, ZeRO-0's reduction flattens the gradients into one more buffer. Needs about
4 x (shard x 20 B + 0.5 GiB) of free memory: about 19 GiB at the default size (0.94 B
parameters); use --layers 8 on a smaller machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `src` is the repository's package

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable,
            "-m",
            "src.run",
            "backend=torch",
            "cluster=local",
            "logger=none",
            "model=gpt",
            "model.preset=null",
            f"model.layers={args.layers}",
            f"model.hidden={args.hidden}",
            f"model.heads={args.heads}",
            f"model.vocab={args.vocab}",
            f"train.seq_len={args.seq}",
            "train.global_batch=2",
            f"train.steps={args.steps}",
            "strategy=megatron",
            "strategy.tp=2",
            "strategy.pp=2",
            "strategy.micro_batch_size=1",
            "strategy.recompute=none",
            f"hydra.run.dir={run_dir}",
        ]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the run failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    params = summary["model_params"]
    whole = params * 4 / GIB
    print(
        f"GPT {args.layers} layers x hidden {args.hidden}, vocab {args.vocab}: {params / 1e9:.3f} B parameters, "
        f"{whole:.2f} GiB of fp32 weights whole ({4 * whole:.2f} GiB with gradients and Adam moments)"
    )
    print("4 CPU workers, megatron tp=2 pp=2, fp32")
    print(f"{'rank':>4} {'peak RSS GiB':>13} {'/ whole weights':>16} {'/ whole training state':>23}")
    for rank, rss in enumerate(summary["memory_gib"]["measured_rss_gib_by_rank"]):
        print(f"{rank:>4} {rss:>13.2f} {rss / whole:>16.2f} {rss / (4 * whole):>23.2f}")
    print(f"the plan's own estimate per rank (weights+grads+optimizer+activations): {summary['memory_gib']['total']:.2f} GiB")


if __name__ == "__main__":
    main()
