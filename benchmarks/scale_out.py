"""Scale-out study: what the simulator says grows with the number of GPUs.

- Megatron-LM, 175B (MegaScale's model: 96 layers, hidden 12288, 128 heads, vocabulary
  64000, sequence 2048) on dgx_a100, TP 8, PP 8 interleaved with 6 virtual chunks,
  micro-batch 1, full recomputation, distributed optimizer, gradient reduction overlapped
  with the backward (--overlap-grad-reduce): 256-1024 GPUs at global batch 768,
  3072-12288 at 6144 (the two batch sizes of MegaScale's strong-scaling table).
- ZeRO-3 (strategy=ddp, zero_stage=3) GPT-20B on perlmutter: 64 GPUs and 1024 GPUs,
  global batch 2 per GPU, with and without overlap_comm.

Prints, per case, the iteration time, MFU and the mean exposed communication by kind.

    python benchmarks/scale_out.py [megatron|zero3]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import composed
from src.metrics import summarize
from src.plan_io import PlannedRun
from src.setup import plan_run, validate
from src.sim.engine import simulate

MEGATRON = [
    "strategy=megatron",
    "strategy.tp=8",
    "strategy.pp=8",
    "strategy.vpp=6",
    "strategy.schedule=interleaved",
    "strategy.micro_batch_size=1",
    "strategy.recompute=full",
    "strategy.zero_stage=1",
    "strategy.sequence_parallel=true",
    "strategy.overlap_grad_reduce=true",
    "cluster=dgx_a100",
    "model=gpt",
    "model.preset=null",
    "model.layers=96",
    "model.hidden=12288",
    "model.heads=128",
    "model.vocab=64000",
    "train.seq_len=2048",
    "logger=none",
]
MEGATRON_SCALES = [(256, 768), (512, 768), (1024, 768), (3072, 6144), (6144, 6144), (12288, 6144)]

ZERO3 = ["strategy=ddp", "strategy.zero_stage=3", "model=gpt", "model.preset=gpt_20b", "cluster=perlmutter", "logger=none"]
ZERO3_SCALES = [(64, False), (64, True), (1024, False), (1024, True)]


def run(overrides: list[str]) -> tuple[dict, float]:
    config = composed(overrides)
    start = time.perf_counter()
    setup = validate(config)
    planned = PlannedRun(setup.model, setup.cluster, setup.train, plan_run(setup))
    timeline = simulate(planned.plan.program, setup.model, setup.cluster, planned.plan.precision)
    return summarize(planned, timeline), time.perf_counter() - start


def show(label: str, summary: dict, seconds: float) -> None:
    b = summary["breakdown_s"]
    bubble = sum(v for k, v in b.items() if k.startswith("bubble"))
    print(
        f"{label:32s} iter {summary['iteration_time_s']:8.3f} s  MFU {100 * summary['mfu']:5.1f} %  "
        f"compute {b['compute']:7.3f}  dp {b['comm_dp']:6.3f}  tp {b['comm_tp']:6.3f}  pp {b['comm_pp']:6.3f}  "
        f"bubble {bubble:6.3f}  ({seconds:.1f} s to price)",
        flush=True,
    )


def main() -> None:
    which = sys.argv[1:] or ["megatron", "zero3"]
    if "megatron" in which:
        for gpus, batch in MEGATRON_SCALES:
            summary, seconds = run(MEGATRON + [f"cluster.nodes={gpus // 8}", f"train.global_batch={batch}"])
            show(f"175B {gpus} GPUs batch {batch}", summary, seconds)
    if "zero3" in which:
        for gpus, overlap in ZERO3_SCALES:
            summary, seconds = run(
                ZERO3
                + [f"cluster.nodes={gpus // 4}", f"train.global_batch={2 * gpus}", f"strategy.overlap_comm={str(overlap).lower()}"]
            )
            show(f"ZeRO-3 20B {gpus} GPUs overlap={overlap}", summary, seconds)


if __name__ == "__main__":
    main()
