"""The bandwidth PyTorch's memory-bound kernels reach on one GPU, kernel by kernel (torch + stdlib only).

The presets price a GEMM's operand traffic at a copy's rate (copy_efficiency, calibrate_gpu.py)
and every other memory-bound kernel at one rate (memory_efficiency), which memory_kernel_rates.py
takes from a profiled training step: on an H200 a small GPT's kernels reached less than a copy
does (benchmarks/results/memory_kernel_rates_h200.json: GELU and LayerNorm's input gradient about
0.6 of the datasheet's bandwidth, the reductions over the tokens 0.25-0.4, growing with the rows
a call reduces). This times each kind alone, on bf16 activations of a transformer's shapes
(tokens x width), on the preset's own device, so that per-kind rates can come from a measurement:

- copy (`clone`), add (a residual add), GELU forward and backward (tanh, as GPT's), LayerNorm
  forward and backward (its input's gradient and its parameters' reduction), LayerNorm forward
  over fp32 values (the held-out Liger rows' kernel), the sum over the tokens (a bias's
  gradient) and softmax over the width; PyTorch's cross entropy over 4096 rows of 32768 and
  131,072 fp32 logits each way (the held-out loss rows' operation);
- per kind and shape: seconds (CUDA events, the median of 7 regions of many calls), the bytes
  the kernel must move (read and written once) and the bandwidth that makes, and that over a
  copy's of the same size.

    python benchmarks/measure_memory_kernels.py [--out results.json]
    python benchmarks/memory_kernel_rates.py results.json --hbm 3.35e12   # the preset's rate, by its rule
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: src.out_paths, standard library only
from calibrate_gpu_layers import device_header, events_seconds  # noqa: E402
from src.out_paths import output_file, write_file  # noqa: E402

TOKENS = [2048, 8192, 32768]
WIDTHS = [2048, 8192]
ELEMENT = 2  # bf16 bytes
LOSS_ROWS = 4096  # rows of logits the loss is timed over, at each vocabulary size
VOCABS = [32768, 131072]


def kinds(tokens: int, width: int) -> dict[str, tuple[Callable[[], Any], float]]:
    """Each kind's call on (tokens x width) bf16 tensors and the bytes it must move."""
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    y, dy = torch.randn_like(x), torch.randn_like(x)
    weight = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn_like(weight)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [width], weight, bias, 1e-5)
    x32, weight32, bias32 = x.float(), weight.float(), bias.float()
    n = float(tokens * width * ELEMENT)
    return {
        "copy": (lambda: x.clone(), 2 * n),
        "add": (lambda: x + y, 3 * n),
        "gelu": (lambda: F.gelu(x, approximate="tanh"), 2 * n),
        "gelu_backward": (lambda: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"), 3 * n),
        "layer_norm": (lambda: F.layer_norm(x, (width,), weight, bias), 2 * n),
        # fp32, as the held-out LayerNorm rows of an H100 NVL and an A100 time it (benchmarks/heldout/
        # README.md): the share of the datasheet it reaches here, against theirs, says whether a
        # kernel's share carries over from one part to another.
        "layer_norm_fp32": (lambda: F.layer_norm(x32, (width,), weight32, bias32), 4 * n),
        # The input's gradient (reads dy and x, writes dx) and the parameters' (reads them again).
        "layer_norm_backward": (
            lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [width], mean, rstd, weight, bias, [True, True, True]),
            5 * n,
        ),
        "sum_over_tokens": (lambda: dy.sum(0), n),
        "softmax": (lambda: torch.softmax(x, dim=-1), 2 * n),
    }


def loss_kinds(rows: int, vocab: int) -> dict[str, tuple[Callable[[], Any], float]]:
    """PyTorch's cross entropy over (rows x vocab) fp32 logits, as the held-out loss rows time
    it (benchmarks/heldout/README.md), each way, with a copy of the logits first: the bytes the
    model counts (log_softmax's one read and write forward; nll_loss's dense gradient, then
    log_softmax's backward reading it and its output and writing the input's gradient)."""
    logits = torch.randn(rows, vocab, device="cuda", requires_grad=True)
    target = torch.randint(vocab, (rows,), device="cuda")
    loss = F.cross_entropy(logits, target)
    n = float(rows * vocab * 4)
    return {
        "copy": (lambda: logits.detach().clone(), 2 * n),
        "cross_entropy_fp32": (lambda: F.cross_entropy(logits, target), 2 * n),
        "cross_entropy_fp32_backward": (lambda: torch.autograd.grad(loss, logits, retain_graph=True), 4 * n),
    }


def measure(tokens: int, width: int, calls: dict[str, tuple[Callable[[], Any], float]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind, (call, moved) in calls.items():
        inner = max(1, int(2e-3 / (moved / 3e12)))  # about 2 ms of work a timed region
        seconds = events_seconds(call, repeats=7, inner=inner)
        rows.append({"kind": kind, "tokens": tokens, "width": width, "seconds": seconds, "bytes": moved, "bandwidth": moved / seconds})
    copy = rows[0]["bandwidth"]
    for row in rows:
        row["of_copy"] = row["bandwidth"] / copy
        print(
            f"{row['kind']:20s} {tokens:6d} x {width:5d}: {row['seconds'] * 1e6:9.1f} us  "
            f"{row['bandwidth'] / 1e12:5.2f} TB/s  {row['of_copy']:.2f} of a copy",
            flush=True,
        )
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    result = {
        **device_header("measure_memory_kernels"),
        "kernels": [row for tokens in TOKENS for width in WIDTHS for row in measure(tokens, width, kinds(tokens, width))]
        + [row for vocab in VOCABS for row in measure(LOSS_ROWS, vocab, loss_kinds(LOSS_ROWS, vocab))],
        "command": "python benchmarks/measure_memory_kernels.py --out memory_kernels.json",
    }
    if args.out:
        write_file(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
