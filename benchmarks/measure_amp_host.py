"""What PyTorch AMP adds to the host's work per transformer block, on one GPU (torch + stdlib only).

The presets' host terms (host_forward_kernel_s, host_backward_kernel_s) were measured by
calibrate_gpu_layers.py on a block with bf16 weights, as Megatron-LM keeps them. Under
PyTorch AMP (fp32 weights, bf16 autocast: the real backend, Lightning-style trainers) every
Linear's weight and bias are cast to bf16 at each use, the normalisations run in fp32 and
the GEMM after one casts its input, and backward casts every gradient back and adds it into
the fp32 `.grad`. Where the device waits on the host (narrow layers, few tokens) each of
those is an operator the host dispatches.

The same block as calibrate_gpu_layers.py (pre-norm, fused attention, biases, GELU MLP), a
stack of 8 at host-bound sizes, two ways (bf16 weights; fp32 weights under autocast), per
block: the host time of a training forward (autograd recording), of forward + backward on
a step's first micro-batch (no `.grad` yet: backward hands each gradient over) and on a
later one (an add per parameter), and the kernels each runs (profiler). Beside them the host
time of single operators launched eagerly: a tiny in-place add, a weight's cast, a bf16
Linear and an fp32 Linear under autocast.

    python benchmarks/measure_amp_host.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: src.out_paths, standard library only
from calibrate_gpu_layers import STACK, Block, device_header  # noqa: E402  (the calibration's block, unchanged)
from src.out_paths import output_file, write_file  # noqa: E402

# (hidden, tokens): where the device runs a block's kernels faster than the host issues them.
SIZES = [(64, 256), (256, 1024), (512, 1024)]
WAYS = ("bf16_weights", "amp")
REPEATS = 9


def host_seconds(fn: Callable[[], None], before: Callable[[], None] = lambda: None) -> float:
    """Median wall seconds of `fn` from an idle device to its last kernel's end; where the
    host bounds the work, the host's time to issue it."""
    for _ in range(2):
        before()
        fn()
    times = []
    for _ in range(REPEATS):
        before()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernels_of(fn: Callable[[], None], before: Callable[[], None] = lambda: None) -> int:
    from torch.profiler import ProfilerActivity, profile

    before()
    fn()
    before()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def block_host(hidden: int, tokens: int, way: str) -> dict:
    amp = way == "amp"
    model = nn.Sequential(*[Block(hidden) for _ in range(STACK)]).cuda()
    if not amp:
        model = model.to(torch.bfloat16)
    dtype = torch.float32 if amp else torch.bfloat16  # AMP's residual stream stays fp32
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)

    def loss() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            return model(x).float().pow(2).mean()

    def forward() -> None:
        loss()

    def train() -> None:
        loss().backward()

    def first() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None

    def accumulating() -> None:  # a micro-batch after the first: .grad exists
        if next(model.parameters()).grad is None:
            train()

    row: dict[str, Any] = {"hidden": hidden, "tokens": tokens, "way": way}
    for name, fn, before in (
        ("fwd", forward, first),
        ("fwd_bwd_first", train, first),
        ("fwd_bwd_accumulating", train, accumulating),
    ):
        row[f"{name}_s"] = host_seconds(fn, before) / STACK
        row[f"{name}_kernels"] = kernels_of(fn, before) / STACK
    parts = ("fwd", "fwd_bwd_first", "fwd_bwd_accumulating")
    described = ", ".join(f"{n} {row[n + '_s'] * 1e6:7.1f} us / {row[n + '_kernels']:.1f} kernels" for n in parts)
    print(f"block h={hidden:4d} tokens={tokens:5d} {way:12s}: {described}", flush=True)
    return row


def operator_host() -> dict:
    """Host seconds of one eagerly launched operator (a run of 500, the device idle-waiting)."""
    count = 500
    hidden = 256
    xf = torch.randn(64, hidden, device="cuda")
    xb = xf.to(torch.bfloat16)
    wf, bf = torch.randn(hidden, hidden, device="cuda"), torch.randn(hidden, device="cuda")
    wb, bb = wf.to(torch.bfloat16), bf.to(torch.bfloat16)

    def run(op: Callable[[], object]) -> Callable[[], None]:
        def loop() -> None:
            for _ in range(count):
                op()

        return loop

    def autocast_linear() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(count):
                F.linear(xf, wf, bf)

    ops = {
        "add_": run(lambda: xf.add_(1.0)),
        "cast_to_bf16": run(lambda: wf.to(torch.bfloat16)),
        "linear_bf16": run(lambda: F.linear(xb, wb, bb)),
        "linear_fp32_under_autocast": autocast_linear,
    }
    out = {name: host_seconds(fn) / count for name, fn in ops.items()}
    print("operators: " + ", ".join(f"{n} {s * 1e6:.1f} us" for n, s in out.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    result = {
        **device_header("measure_amp_host"),
        "stack": STACK,
        "operators_s": operator_host(),
        "blocks": [block_host(h, t, way) for h, t in SIZES for way in WAYS],
        "command": "python benchmarks/measure_amp_host.py --out amp_host.json",
    }
    if args.out:
        write_file(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
