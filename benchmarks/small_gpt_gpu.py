"""Small GPTs on one GPU: what a step costs on the device, beside the simulator's price of it.

Tiny to small GPTs (hidden 256-2048, Megatron-LM's GPT layer: LayerNorm, biases, GELU MLP,
learned positions, a tied 51200-token head; bf16 autocast over fp32 weights, AdamW), each
trained on one GPU three ways:

- the harness: the front door's real backend (backend=torch, strategy=megatron tp=1 pp=1,
  one launch of one worker for every configuration, start-up paid once);
- a plain PyTorch loop over the same modules, data and optimizer: step time with one
  synchronize a step, the forward / backward / optimizer phases (each synchronized), and one
  profiled step: how many kernels the device ran and how long it was busy (the union of the
  kernels' spans), i.e. how much of the step the device waited on the host;
- the simulator: the same configuration priced with backend=sim on `cluster=hopper`, as the
  preset is (an H100), and with the device this runs on where it differs (an H200: the
  datasheet's HBM bandwidth and memory), its forward / backward / optimizer split from its trace.

Where the simulator is faster than the device at small sizes, the profile says whether the
device was idle (the host's per-kernel cost, launch-bound) or busy (kernels slower than priced).

    WANDB_MODE=offline python benchmarks/small_gpt_gpu.py [--steps 10] [--only NAME ...] [--out results.json]
    python benchmarks/small_gpt_gpu.py --sim-only     # the simulator's column alone, no GPU needed
    python benchmarks/small_gpt_gpu.py --sim-only --sim-override cluster.memory_bandwidth=1e14  # less its memory-bound time
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `src` is the repository's package
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_runtime_gpu's one-launch runner
VOCAB = 51200  # Megatron-LM's GPT-2 BPE vocabulary, padded


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    layers: int
    heads: int
    seq: int
    micro_batch: int
    micro_batches: int = 1
    vocab: int = VOCAB

    def overrides(self) -> list[str]:
        return [
            "model=gpt",
            "model.preset=null",
            f"model.layers={self.layers}",
            f"model.hidden={self.hidden}",
            f"model.heads={self.heads}",
            f"model.vocab={self.vocab}",
            "model.dropout=false",  # the real backend trains without dropout: the simulator prices none either
            "model.param_grad_kernels=separate",  # both loops are eager PyTorch: a reduction kernel per bias and norm
            "model.cross_entropy=eager",  # and PyTorch's F.cross_entropy for the loss
            f"train.seq_len={self.seq}",
            f"train.global_batch={self.micro_batch * self.micro_batches}",
            "train.precision=bf16",
            "strategy=megatron",
            "strategy.tp=1",
            "strategy.pp=1",
            f"strategy.micro_batch_size={self.micro_batch}",
            "strategy.recompute=none",
            "strategy.zero_stage=0",
            "cluster=hopper",
            "cluster.nodes=1",
            "cluster.devices_per_node=1",
            "cluster.amp=true",  # both loops keep fp32 weights under bf16 autocast
            "logger=none",
        ]


# Tiny (the host issues kernels slower than the device runs them) to small (device-bound);
# the 355M model at three micro-batch sizes and with four micro-batches a step separates
# what a micro-batch pays from what a step pays (the optimizer).
CASES = [
    Case("h256-L4-mb4", 256, 4, 4, 1024, 4),
    Case("h512-L8-mb4", 512, 8, 8, 1024, 4),
    Case("h768-L12-mb8 (125M)", 768, 12, 12, 1024, 8),
    Case("h1024-L24-mb1 (355M)", 1024, 24, 16, 1024, 1),
    Case("h1024-L24-mb4 (355M)", 1024, 24, 16, 1024, 4),
    Case("h1024-L24-mb8 (355M)", 1024, 24, 16, 1024, 8),
    Case("h1024-L24-mb4x4 (355M)", 1024, 24, 16, 1024, 4, 4),
    Case("h1536-L24-mb8 (760M)", 1536, 24, 16, 1024, 8),
    Case("h2048-L24-mb1 s2048 (1.3B)", 2048, 24, 16, 2048, 1),
    Case("h2048-L24-mb4 s2048 (1.3B)", 2048, 24, 16, 2048, 4),
    # One GPU's share of Megatron-Core's 1.7B weak-scaling run on 48 H100s (src.heldout's mc24-1.7b:
    # sequence 4096, vocabulary 131,072, global batch 192 over 48 replicas: 4 micro-batches of 1).
    Case("mc24-1.7B per GPU", 2048, 24, 16, 4096, 1, 4, 131072),
]
# The H200's datasheet (NVIDIA H200 Tensor Core GPU): HBM3e at 4.8 TB/s, 141 GB; its compute is the H100's.
H200 = ["cluster.device=H200-SXM-141GB", "cluster.memory_bandwidth=4800.0e9", "cluster.memory_gib=141"]


def simulated(overrides: list[str]) -> dict[str, Any]:
    """The simulator's iteration time and its forward / backward / optimizer seconds."""
    from src.validate import simulated as priced

    summary, timeline = priced(overrides)
    phases: dict[str, float] = {}
    for span in timeline.ranks[0].spans:
        kind = span.name.split(" ")[0]
        phases[kind] = phases.get(kind, 0.0) + span.end - span.start
    return {"iteration_s": summary["iteration_time_s"], "phases_s": phases, "breakdown_s": summary["breakdown_s"]}


# How the plain loop keeps its weights and updates them: as the harness does (fp32 weights under
# bf16 autocast, the run's optimizer: torch's fused AdamW), the same with torch's multi-tensor
# ("foreach") AdamW, and bf16 weights without autocast (no per-micro-batch casts of the weights,
# bf16 gradients; its optimizer step is not the mixed-precision one). The results of 2026-11-29
# were measured when the run's AdamW was the multi-tensor one: their "autocast" is today's
# "autocast+foreach_adamw", their "autocast+fused_adamw" today's "autocast".
VARIANTS = ("autocast", "autocast+foreach_adamw", "bf16_weights")


def plain_loop(case: Case, steps: int, variant: str = VARIANTS[0]) -> dict[str, Any]:
    """The same GPT modules, data and optimizer in a plain loop on the GPU (`variant`: VARIANTS)."""
    import torch

    from src.config import ContrastiveSpec, DeepSpeedSpec, composed
    from src.data.synthetic import collate
    from src.runtime.inputs import dataset_for, unit_fields
    from src.runtime.modules.units import build_units, unit_layers
    from src.runtime.optimizer import build_optimizer, parameter_groups
    from src.setup import validate

    device = torch.device("cuda")
    torch.cuda.empty_cache()  # the case before's modules went with its call
    torch.cuda.reset_peak_memory_stats(device)
    model = validate(composed(case.overrides())).model
    units = build_units(model, 0, {}, {u.name: set(range(u.num_layers)) for u in model.units}).to(device)
    autocast = not variant.startswith("bf16_weights")
    if not autocast:
        units = units.to(torch.bfloat16)
    if variant.endswith("foreach_adamw"):
        spec = DeepSpeedSpec().optimizer  # the run's default, AdamW
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(parameter_groups(units, spec), **spec.params(), foreach=True)
    else:
        optimizer = build_optimizer(units, DeepSpeedSpec(), ContrastiveSpec())
    dataset = dataset_for(model, 0, "synthetic")
    mb = case.micro_batch
    batches = [
        {k: v.to(device) for k, v in collate([dataset[i] for i in range(j * mb, (j + 1) * mb)]).items()}
        for j in range(case.micro_batches)
    ]  # on the device before timing: the harness's data wait is its own figure

    def forward(rows: dict) -> Any:
        state = unit_fields(model, "llm", rows)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            for layer in unit_layers(units, "llm"):
                state = layer(state)
        return state["loss"].float() / case.micro_batches

    def step(marks: list[float] | None = None) -> None:
        for rows in batches:
            loss = forward(rows)
            if marks is not None:
                torch.cuda.synchronize()
                marks.append(time.perf_counter())
            loss.backward()
            if marks is not None:
                torch.cuda.synchronize()
                marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    phases: list[dict[str, float]] = []
    for _ in range(3):
        torch.cuda.synchronize()
        marks = [time.perf_counter()]
        step(marks)
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        phases.append({"fwd": sum(gaps[0:-1:2]), "bwd": sum(gaps[1:-1:2]), "optimizer": gaps[-1]})
    row = {
        "step_s": statistics.median(times[2:]),
        "steps_s": times,
        "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "device_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "profile": profiled(step),
    }
    return row


def profiled(step: Any) -> dict[str, Any]:
    """One step under torch.profiler: the kernels the device ran, how long it was busy (the
    union of their spans) and the step's span from its first kernel's launch."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        kernels = sorted(
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Optimizer.")  # an annotation
        )
    except Exception as err:  # a profiler that fails on this machine leaves the timings standing
        return {"error": f"{type(err).__name__}: {err}"}
    busy, end = 0.0, float("-inf")
    for a, b, _ in kernels:
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name: dict[str, list[float]] = {}
    by_kind: dict[str, float] = {}
    for a, b, name in kernels:
        by_name.setdefault(name[:160], []).append(b - a)
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (b - a) / 1e6
    # Enough kernels to price each kind against its bytes (LayerNorm's passes, the loss's), with
    # names long enough to tell a kernel's dtype and operator apart.
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:40]
    return {
        "by_kind_s": by_kind,
        "wall_s": wall,
        "kernels": len(kernels),
        "device_busy_s": busy / 1e6,
        "device_span_s": (kernels[-1][1] - kernels[0][0]) / 1e6 if kernels else 0.0,
        "top_kernels": [{"name": n, "count": len(d), "total_s": sum(d) / 1e6} for n, d in top],
    }


KINDS = {  # a kernel's kind by the words its name holds, first match (FlashAttention's names hold "cutlass")
    "attention": ("sdpa", "flash", "fmha"),
    "gemm": ("nvjet", "gemm", "cutlass", "xmma"),
    "optimizer": ("multi_tensor", "fused_adam", "adam"),
    "copy_cast": ("copy",),
    "norm": ("layer_norm", "gammabeta", "rms"),
    "softmax_loss": ("softmax", "nll", "cross_entropy"),
    "reduce": ("reduce",),
}


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, words in KINDS.items() if any(w in lowered for w in words)), "elementwise")


def main() -> None:
    from src.out_paths import output_file, write_file  # a path it could not write, refused before the GPU's time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="+", help="cases whose name starts with one of these")
    parser.add_argument("--sim-only", action="store_true", help="the simulator's column only (no GPU)")
    parser.add_argument("--plain-only", action="store_true", help="the plain loop and the simulator, not the harness")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=[VARIANTS[0]], help="the plain loop's ways")
    parser.add_argument(
        "--sim-override",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="overrides the simulator's columns take after the case's (e.g. cluster.memory_bandwidth=1e14: its GEMMs alone)",
    )
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or any(c.name.startswith(o) for o in args.only)]
    if not cases:
        print(f"error: --only {' '.join(args.only)} names none of: {', '.join(c.name for c in CASES)}", file=sys.stderr)
        sys.exit(2)
    if not args.sim_only:
        import torch

        if not torch.cuda.is_available():
            print("error: benchmarks/small_gpt_gpu.py needs a CUDA GPU (or --sim-only), and torch sees none here", file=sys.stderr)
            sys.exit(2)
    # Written as each part ends, so that a run stopped early (a lent GPU's time limit) keeps what
    # it measured; "complete" says whether every case ran.
    results: dict[str, Any] = {"complete": False, "cases": {}}

    def save() -> None:
        if args.out:
            write_file(args.out, json.dumps(results, indent=1))

    from src.errors import ConfigError
    from src.run import compose_config

    for case in cases:
        try:
            compose_config(case.overrides() + H200 + args.sim_override)  # a key Hydra cannot compose: one line
            results["cases"][case.name] = {
                "case": case.__dict__,
                "sim_hopper": simulated(case.overrides() + args.sim_override),
                "sim_h200": simulated(case.overrides() + H200 + args.sim_override),
            }
        except ConfigError as err:
            print(f"error: {case.name}: {err}", file=sys.stderr)
            sys.exit(2)
    if not args.sim_only:
        from bench_runtime_gpu import run_all

        results["device"] = torch.cuda.get_device_name(0)
        results["torch"] = torch.__version__
        named = {c.name: c.overrides() + ["backend=torch", f"train.steps={args.steps}"] for c in cases}
        summaries: dict[str, dict] = {}
        if not args.plain_only:
            with tempfile.TemporaryDirectory() as tmp:
                summaries = run_all(named, Path(tmp))
        for name, harness in summaries.items():
            results["cases"][name]["harness"] = harness_row(harness)
        save()  # the harness's launch, before the plain loops run
        for case in cases:
            row = results["cases"][case.name]
            for variant in args.variants:  # the harness's way under "plain", the others beside it
                measured = plain_loop(case, args.steps, variant)
                if variant == VARIANTS[0]:
                    row["plain"] = measured
                else:
                    row.setdefault("plain_variants", {})[variant] = measured
            print(json.dumps({case.name: summary_line(row)}), flush=True)
            save()
    for name, row in results["cases"].items():
        print(f"{name:28s} {json.dumps(summary_line(row))}")
    results["complete"] = True
    save()


def harness_row(harness: dict[str, Any]) -> dict[str, Any]:
    """The harness's step (the median after the first two), MFU and time by instruction kind,
    from its run's summary; a failed launch's error as it came."""
    if "error" in harness:
        return harness
    times = harness["measured"]["step_time_s"]
    spans: dict[str, float] = {}
    for name, seconds in harness["instructions_s"]:
        spans[name.split(" ")[0]] = spans.get(name.split(" ")[0], 0.0) + seconds
    return {
        "step_s": statistics.median(times[2:]),
        "steps_s": times,
        "mfu": harness["mfu"],
        "breakdown_s": harness["breakdown_s"],
        "instruction_spans_s": spans,
    }


def summary_line(row: dict[str, Any]) -> dict[str, Any]:
    line = {"sim_hopper_s": round(row["sim_hopper"]["iteration_s"], 5), "sim_h200_s": round(row["sim_h200"]["iteration_s"], 5)}
    if "harness" in row:
        line["harness_s"] = round(row["harness"].get("step_s", float("nan")), 5)
    variants = {VARIANTS[0]: row["plain"]} if "plain" in row else {}
    for variant, plain in {**variants, **row.get("plain_variants", {})}.items():
        line[variant] = {"step_s": round(plain["step_s"], 5), **{k: round(v, 5) for k, v in plain["phases_s"].items()}}
        if "device_busy_s" in plain["profile"]:
            line[variant] |= {"device_busy_s": round(plain["profile"]["device_busy_s"], 5), "kernels": plain["profile"]["kernels"]}
    return line


if __name__ == "__main__":
    main()
