"""Measure what a GPU preset's per-layer terms are made of, on one GPU (torch + stdlib only).

calibrate_gpu.py times one GEMM at a time, so its small shapes measure the launch and the
event floor, not the GEMM. Training queues kernels back to back; this measures what the
cost model's compute terms stand for in that regime:

- queued GEMMs: the same shapes run back to back (many in one timed region), so the host's
  launch cost is hidden behind the device's work as it is in a training step: the GEMM
  efficiency curve where it matters (thin shards, small hidden sizes);
- the device's own cost per kernel: tiny kernels replayed from a CUDA graph (no host in
  the loop), i.e. what a kernel costs when the host keeps ahead;
- the host's cost per kernel: the same tiny kernels launched eagerly from Python;
- a transformer block (pre-norm, fused attention, bias, GELU MLP; bf16 weights, as
  Megatron-LM runs them) at several sizes, forward and forward + backward, eager PyTorch:
  per layer the device time (CUDA events around a stack of blocks) and, at sizes where the
  device waits on the host, the host-bound time that is the framework's per-layer overhead;
  a profile of the smallest block counts its kernels.

    python benchmarks/calibrate_gpu_layers.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: src.out_paths, standard library only
from src.out_paths import output_file, write_file  # noqa: E402

PEAK_BF16 = 989e12  # H100 SXM datasheet, dense
SQUARE = [256, 512, 1024, 2048, 4096, 8192]
THIN = [64, 128, 256, 512, 1024, 2048]
# (hidden, tokens per micro-batch): tiny (host-bound) to large (device-bound).
BLOCKS = [(64, 256), (256, 1024), (512, 2048), (1024, 2048), (2048, 4096), (4096, 4096), (8192, 2048)]
STACK = 8


def events_seconds(fn, repeats: int, inner: int = 1) -> float:
    """Median seconds of one call of `fn` (run `inner` times per timed region)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def queued_gemms() -> list[dict]:
    shapes = [(n, n, n) for n in SQUARE]
    for t in THIN:
        shapes += [(t, 8192, 8192), (8192, t, 8192), (8192, 8192, t)]
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        inner = max(1, min(200, int(5e-3 / (flops / 700e12))))  # ~5 ms of work per region
        seconds = events_seconds(lambda: a @ b, repeats=7, inner=inner)
        out.append({"m": m, "n": n, "k": k, "seconds": seconds, "efficiency": flops / seconds / PEAK_BF16})
        print(f"gemm {m:5d} {n:5d} {k:5d}  {flops / seconds / 1e12:7.1f} TFLOP/s  {flops / seconds / PEAK_BF16:.3f}", flush=True)
    return out


def kernel_costs() -> dict:
    x = torch.zeros(1024, device="cuda")
    count = 500

    def eager() -> None:
        for _ in range(count):
            x.add_(1.0)

    host = events_seconds(eager, repeats=7) / count
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    device = events_seconds(graph.replay, repeats=7) / count
    print(f"tiny kernel: eager {host * 1e6:.2f} us each, from a CUDA graph {device * 1e6:.2f} us each", flush=True)
    return {"eager_s": host, "graph_s": device}


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.heads = max(1, hidden // 64)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def block_times(hidden: int, tokens: int) -> dict:
    seq = min(tokens, 2048)
    batch = tokens // seq
    model = nn.Sequential(*[Block(hidden) for _ in range(STACK)]).cuda().to(torch.bfloat16)
    x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def train() -> None:
        model(x).float().pow(2).mean().backward()

    fwd = events_seconds(forward, repeats=7) / STACK
    step = events_seconds(train, repeats=7) / STACK
    # Host time to issue one pass (no sync): the device's queue is far from full at these counts.
    torch.cuda.synchronize()
    start = time.perf_counter()
    forward()
    host_fwd = (time.perf_counter() - start) / STACK
    torch.cuda.synchronize()
    flops = 2.0 * tokens * 12 * hidden * hidden + 4.0 * batch * seq * seq * hidden / 2  # causal: half the scores
    row = {
        "hidden": hidden,
        "tokens": tokens,
        "seq": seq,
        "fwd_s": fwd,
        "fwd_bwd_s": step,
        "host_fwd_s": host_fwd,
        "fwd_tflops": flops / fwd / 1e12,
    }
    print(
        f"block h={hidden:5d} tokens={tokens:5d}: fwd {fwd * 1e6:8.1f} us ({flops / fwd / 1e12:6.1f} TFLOP/s), "
        f"fwd+bwd {step * 1e6:8.1f} us, host issue fwd {host_fwd * 1e6:7.1f} us",
        flush=True,
    )
    return row


def kernel_counts(hidden: int, tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    model = nn.Sequential(*[Block(hidden) for _ in range(STACK)]).cuda().to(torch.bfloat16)
    x = torch.randn(tokens // min(tokens, 2048), min(tokens, 2048), hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    model(x).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    counts = {}
    for phase in ("fwd", "fwd_bwd"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if phase == "fwd":
                with torch.no_grad():
                    model(x)
            else:
                model(x).float().pow(2).mean().backward()
            torch.cuda.synchronize()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
        counts[phase] = kernels / STACK
    print(f"kernels per block: fwd {counts['fwd']:.1f}, fwd+bwd {counts['fwd_bwd']:.1f}", flush=True)
    return counts


def device_header(script: str) -> dict:
    """The GPU a measurement runs on, printed and as its results' first fields; without one,
    `script` is refused in one line (exit 2)."""
    if not torch.cuda.is_available():
        print(f"error: {script} needs a CUDA device, and none is visible", file=sys.stderr)
        sys.exit(2)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, torch {torch.__version__}, cuda {torch.version.cuda}", flush=True)
    return {"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    result = {
        **device_header("calibrate_gpu_layers"),
        "kernels": kernel_costs(),
        "queued_gemms": queued_gemms(),
        "blocks": [block_times(h, t) for h, t in BLOCKS],
        "kernels_per_block": kernel_counts(*BLOCKS[0]),
        "command": "python benchmarks/calibrate_gpu_layers.py --out h100_layers.json",
    }
    if args.out:
        write_file(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
