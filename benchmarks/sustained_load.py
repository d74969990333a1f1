"""Two of the simulator's GPU prices under a training load, beside what the device does (the
held-out Megatron-LM runs on Hopper price fast: benchmarks/heldout/README.md, "Where it stands"):

- gemms: a transformer layer's four forward GEMMs (QKV, the output projection, the MLP's two) at
  a held-out run's shapes on one TP rank, each timed alone (a synchronize after every one, as
  benchmarks/calibrate_gpu.py times the GEMMs the preset's curve was fitted on) and then cycled
  back to back for --seconds with the queue kept full (a training load, at the clocks its power
  draw leaves): the rate over the first half second and over the last two, beside the
  simulator's price of each GEMM;
- attention: FlashAttention 2 (PyTorch's SDPA flash backend), causal, heads of 128, one sequence
  of --seq tokens, forward and backward, at 2 to 32 heads (a TP rank's share of a model's),
  beside the simulator's price of the same core (the preset's measured rates, scaled by how
  FlashAttention 2's grid packs on the SMs).

    python benchmarks/sustained_load.py [--seconds 10] [--seq 8192] [--out results.json]
    python benchmarks/sustained_load.py --sim-only     # the simulator's columns, no GPU needed
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `src` is the repository's package
sys.path.insert(0, str(Path(__file__).resolve().parent))  # calibrate_gpu's timing of one kernel alone

# (name, [(gemm, m, k, n)]): one TP rank's forward GEMMs of a block, m the tokens of a micro-batch.
LAYERS = {
    # FlagPerf's Llama-3-70B under Megatron-Core (TP 8, sequence 8192, micro-batch 1; 8 query groups).
    "llama70b-tp8-s8192": [
        ("qkv", 8192, 8192, 1280),
        ("proj", 8192, 1024, 8192),
        ("fc1", 8192, 8192, 7168),
        ("fc2", 8192, 3584, 8192),
    ],
    # Megatron-Core's weak-scaling GPT-177B (TP 8, sequence 4096, micro-batch 1).
    "gpt177b-tp8-s4096": [
        ("qkv", 4096, 12288, 4608),
        ("proj", 4096, 1536, 12288),
        ("fc1", 4096, 12288, 6144),
        ("fc2", 4096, 6144, 12288),
    ],
}
HEADS = (2, 4, 8, 16, 32)
HEAD_DIM = 128
EARLY_S, LATE_S = 0.5, 2.0


def compute_model(*overrides: str) -> Any:
    """The simulator's compute model, bf16, of the cluster the overrides compose."""
    from src.cluster import cluster_from_config
    from src.config import composed
    from src.costmodel.compute import ComputeModel

    return ComputeModel(cluster_from_config(composed(list(overrides))["cluster"]), "bf16")


def priced_gemms(cluster: str = "hopper") -> dict[str, list[dict[str, Any]]]:
    """The simulator's seconds for each GEMM (its time in a queue of kernels: the per-kernel gap
    included), bf16 on `cluster`."""
    model = compute_model(f"cluster={cluster}")
    return {
        layer: [{"gemm": g, "m": m, "k": k, "n": n, "sim_s": model.gemm_time(m, n, k)} for g, m, k, n in gemms]
        for layer, gemms in LAYERS.items()
    }


def priced_attention(seq: int, cluster: str = "hopper") -> list[dict[str, Any]]:
    """The simulator's forward and backward seconds of a causal FlashAttention 2 core over one
    sequence of `seq` tokens, at each of HEADS heads of HEAD_DIM."""
    from src.mesh import Sharding
    from src.models.registry import build_model

    model = compute_model(f"cluster={cluster}")
    out = []
    for heads in HEADS:
        spec = build_model(
            {
                "name": "gpt",
                "preset": None,
                "layers": 1,
                "hidden": heads * HEAD_DIM,
                "heads": heads,
                "vocab": 32000,
                "attention": "flash2",
            },
            seq,
        )
        block = next(layer for layer in spec.unit("llm").layers if layer.block)
        times = [model.kernel_times(k, 1, Sharding(), 1, causal=True) for k in block.kernels if k.attention_core]
        out.append(
            {"heads": heads, "sim_fwd_s": sum(t.fwd for t in times), "sim_bwd_s": sum(t.bwd_input + t.bwd_weight for t in times)}
        )
    return out


def attention_flops(heads: int, seq: int) -> float:
    """A causal core's forward FLOPs as FlashAttention's benchmark counts them (half the scores);
    its backward counts 2.5 times as many."""
    return 4.0 * seq * seq * heads * HEAD_DIM / 2


def back_to_back(fn, seconds: float, depth: int = 64) -> list[float]:
    """GPU seconds of each run of `fn` enqueued back to back for about `seconds` of device time,
    the host waiting only on the run `depth` behind the newest (the queue stays full)."""
    import torch

    events = [torch.cuda.Event(enable_timing=True)]
    events[0].record()
    pending: collections.deque = collections.deque()
    elapsed, done = 0.0, 0
    while elapsed < seconds:
        fn()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        events.append(event)
        pending.append(event)
        if len(pending) > depth:
            pending.popleft().synchronize()
            done += 1
            elapsed = events[0].elapsed_time(events[done]) / 1e3
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]


def rates_over(cycles: list[float], flops: float) -> tuple[float, float]:
    """FLOP/s over the cycles of the first EARLY_S seconds and of the last LATE_S seconds."""
    total, early, late = sum(cycles), [], []
    clock = 0.0
    for seconds in cycles:
        if clock < EARLY_S:
            early.append(seconds)
        if clock >= total - LATE_S:
            late.append(seconds)
        clock += seconds
    return flops * len(early) / sum(early), flops * len(late) / sum(late)


def measure_gemms(seconds: float, priced: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    import torch
    from calibrate_gpu import timed

    out = {}
    for layer, rows in priced.items():
        operands = [
            (
                torch.randn(r["m"], r["k"], device="cuda", dtype=torch.bfloat16),
                torch.randn(r["k"], r["n"], device="cuda", dtype=torch.bfloat16),
            )
            for r in rows
        ]
        for r, (a, b) in zip(rows, operands):
            r["alone_s"] = timed(lambda a=a, b=b: a @ b, repeats=20)
            r["alone_tflops"] = 2.0 * r["m"] * r["k"] * r["n"] / r["alone_s"] / 1e12

        def cycle() -> None:
            for a, b in operands:
                a @ b

        flops = sum(2.0 * r["m"] * r["k"] * r["n"] for r in rows)
        cycles = back_to_back(cycle, seconds)
        early, late = rates_over(cycles, flops)
        alone = flops / sum(r["alone_s"] for r in rows)
        sim = flops / sum(r["sim_s"] for r in rows)
        out[layer] = {"gemms": rows, "cycles": len(cycles), "alone_tflops": alone / 1e12, "early_tflops": early / 1e12}
        out[layer] |= {
            "late_tflops": late / 1e12,
            "late_over_alone": late / alone,
            "sim_tflops": sim / 1e12,
            "sim_over_late": sim / late,
        }
        print(
            f"{layer}: alone {alone / 1e12:.0f} TFLOP/s, back to back {early / 1e12:.0f} (first {EARLY_S} s) "
            f"-> {late / 1e12:.0f} (last {LATE_S} s, {late / alone:.3f} of alone); simulator {sim / 1e12:.0f}",
            flush=True,
        )
    return out


def measure_attention(seq: int, priced: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from calibrate_gpu import timed
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for row in priced:
        q, k, v = (
            torch.randn(1, row["heads"], seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        grad = torch.randn(1, row["heads"], seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

        def forward() -> Any:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both() -> None:
            forward().backward(grad)

        row["fwd_s"] = timed(forward, repeats=20)
        row["bwd_s"] = timed(both, repeats=20) - row["fwd_s"]
        fwd_flops = attention_flops(row["heads"], seq)
        print(
            f"attention, {row['heads']} heads of {HEAD_DIM}, {seq} tokens: forward {row['fwd_s'] * 1e3:.3f} ms "
            f"({fwd_flops / row['fwd_s'] / 1e12:.0f} TFLOP/s), simulator {row['sim_fwd_s'] * 1e3:.3f}; backward "
            f"{row['bwd_s'] * 1e3:.3f} ms ({2.5 * fwd_flops / row['bwd_s'] / 1e12:.0f}), simulator {row['sim_bwd_s'] * 1e3:.3f}",
            flush=True,
        )
    return priced


def main() -> None:
    from src.out_paths import output_file, write_file  # a path it could not write, refused before the GPU's time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="device time each layer's GEMMs cycle back to back")
    parser.add_argument("--seq", type=int, default=8192, help="tokens of the attention's one sequence")
    parser.add_argument("--sim-only", action="store_true", help="the simulator's prices alone (no GPU)")
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    bad = [
        f"--seconds={args.seconds:g} must exceed the {LATE_S:g} s the late rate is taken over" if args.seconds <= LATE_S else "",
        f"--seq={args.seq} must be a positive number of tokens" if args.seq <= 0 else "",
    ]
    if any(bad):
        print(f"error: {next(b for b in bad if b)}", file=sys.stderr)
        sys.exit(2)
    gemms, attention = priced_gemms(), priced_attention(args.seq)
    if args.sim_only:
        print(json.dumps({"gemms": gemms, "attention": attention}))
        return
    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks/sustained_load.py needs a CUDA GPU (or --sim-only), and torch sees none here", file=sys.stderr)
        sys.exit(2)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    result = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__, "seconds": args.seconds}
    result |= {"gemms": measure_gemms(args.seconds, gemms), "attention": measure_attention(args.seq, attention)}
    if args.out:
        write_file(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
