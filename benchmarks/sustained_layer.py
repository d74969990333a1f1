"""A transformer layer's training step under sustained load on one GPU: whether its GEMMs keep
the rate they reach alone (the rate the preset's GEMM curve was fitted on) once the device has
run a training step's whole mix for many seconds, at the clocks its power draw leaves.

benchmarks/sustained_load.py found a layer's GEMMs cycled back to back at 0.87-0.93 of their rate
alone; a training step puts norms, attention and activations between its GEMMs, which draw less
power. This runs one TP rank's share of a held-out run's layers (no collectives: one GPU),
forward then backward, bf16 weights, the attention core on PyTorch's FlashAttention 2 or cuDNN's
fused attention (--attention), Llama blocks fused or as Transformers writes them (--unfused):

- fresh: steps each timed alone (a synchronize before each), and one profiled: each kernel
  kind's device time (benchmarks/small_gpt_gpu.py's kinds);
- sustained: steps back to back for --seconds with the queue kept full, the step time over the
  first half second and the last two, then steps profiled with the load still on;
- the step's GEMMs (forward x @ w, input gradient dy @ w.T, weight gradient x.T @ dy) each timed
  alone as benchmarks/calibrate_gpu.py times the curve's GEMMs, and with the step's weights;
- the simulator's price of the same block by kind (GEMMs, attention core, memory-bound kernels)
  on `hopper` as it is and with the H200's datasheet HBM;
- the SM clock, the board's power and the clock-limit reasons (NVML) sampled throughout.

    python benchmarks/sustained_layer.py [--seconds 20] [--layers 4] [--only NAME] [--attention flash|cudnn]
                                         [--unfused] [--out results.json]
    python benchmarks/sustained_layer.py --sim-only     # the simulator's prices of the blocks alone, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `src` is the repository's package
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks' timing and kinds
from small_gpt_gpu import H200  # the H200's datasheet: the device this runs on, where it is one

HEAD_DIM = 128
# PyTorch SDPA backends by name: FlashAttention 2, and cuDNN's fused attention (the kernels
# Transformer Engine runs for Megatron-Core on Hopper).
ATTENTION_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
# How the simulator prices each: FlashAttention 2 by its measured rates (flash2); cuDNN's as the
# `hopper` preset prices Transformer Engine's fused attention (flash: the core's GEMMs on the curve).
SIM_ATTENTION = {"flash": "flash2", "cudnn": "flash"}
# What a Transformers Llama block runs step by step (src/models/elementwise.py).
UNFUSED_OPS = ("rmsnorm", "rope", "swiglu")
SUSTAINED_PROFILED = 3  # steps profiled with the load still on


@dataclass(frozen=True)
class Layer:
    """A held-out run's block (the whole model's widths) and its TP degree: one rank's share runs."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    llama: bool  # RMSNorm and SwiGLU (its first GEMM twice as wide), else LayerNorm and GELU
    seq: int
    tp: int

    @property
    def rank_heads(self) -> int:
        return self.heads // self.tp

    @property
    def rank_kv_heads(self) -> int:
        return max(1, self.kv_heads // self.tp)

    @property
    def rank_ffn(self) -> int:
        return self.ffn // self.tp


LAYERS = (
    # FlagPerf's Llama-3-70B under Megatron-Core: TP 8, sequence 8192, 64 heads in 8 groups.
    Layer("llama70b-tp8-s8192", 8192, 64, 8, 28672, True, 8192, 8),
    # Megatron-Core's weak-scaling GPT-177B: TP 8, sequence 4096, 96 heads.
    Layer("gpt177b-tp8-s4096", 12288, 96, 96, 49152, False, 4096, 8),
    # FlagPerf's Llama-2-7B under DeepSpeed ZeRO-3 on H800s: a whole layer a GPU, sequence 4096.
    Layer("llama7b-s4096", 4096, 32, 32, 11008, True, 4096, 1),
)


def gemm_shapes(layer: Layer) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of a rank's forward GEMMs; each has two backward GEMMs of as many FLOPs."""
    q, kv = layer.rank_heads * HEAD_DIM, layer.rank_kv_heads * HEAD_DIM
    fc1 = 2 * layer.rank_ffn if layer.llama else layer.rank_ffn
    s, h = layer.seq, layer.hidden
    return [("qkv", s, h, q + 2 * kv), ("proj", s, q, h), ("fc1", s, h, fc1), ("fc2", s, layer.rank_ffn, h)]


def priced_block(layer: Layer, attention: str, overrides: Sequence[str] = (), unfused: bool = False) -> dict[str, float]:
    """The simulator's seconds of one rank's block, forward and backward, by kind: its GEMMs, its
    attention core as the backend `attention` is priced (SIM_ATTENTION), its memory-bound kernels
    (the model's own list: a Llama's rotary embedding and a GPT's biases included, which the
    measured block does not run), on `hopper`; `unfused`: as the model prices Transformers' Llama
    (model.unfused, its norms' parameter gradients reduced in kernels of their own)."""
    from src.mesh import Sharding
    from src.models.registry import build_model
    from sustained_load import compute_model

    model = compute_model("cluster=hopper", *overrides)
    config: dict[str, Any] = {"name": "gpt", "preset": None, "layers": 1, "hidden": layer.hidden, "heads": layer.heads}
    config["vocab"] = 32000
    config |= {"kv_heads": layer.kv_heads, "ffn": layer.ffn, "attention": SIM_ATTENTION[attention], "dropout": False}
    config |= {"style": "llama"} if layer.llama else {}
    config |= {"unfused": list(UNFUSED_OPS), "param_grad_kernels": "separate"} if unfused else {}
    block = next(unit_layer for unit_layer in build_model(config, layer.seq).unit("llm").layers if unit_layer.block)
    sharding = Sharding((("tp", layer.tp),)) if layer.tp > 1 else Sharding()
    priced = {"gemm": 0.0, "attention": 0.0, "memory": 0.0}
    for kernel in block.kernels:
        t = model.kernel_times(kernel, 1, sharding, 1, causal=True)
        priced["attention" if kernel.attention_core else kernel.kind] += t.fwd + t.bwd_input + t.bwd_weight
    return priced


class Sampler:
    """NVML's SM clock (MHz), board power (W) and clock-limit reasons, every `period` seconds."""

    def __init__(self, period: float = 0.02) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.period = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), period
        self.samples: list[tuple[float, int, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nv = self.nvml
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.is_set():
            clock = nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM)
            power = nv.nvmlDeviceGetPowerUsage(self.handle) / 1e3
            self.samples.append((time.perf_counter(), clock, power, int(reasons(self.handle))))
            time.sleep(self.period)

    def between(self, start: float, end: float) -> dict[str, Any]:
        window = [s for s in self.samples if start <= s[0] <= end]
        if not window:
            return {}
        reasons: dict[str, int] = {}
        for s in window:
            reasons[hex(s[3])] = reasons.get(hex(s[3]), 0) + 1
        return {
            "samples": len(window),
            "sm_mhz_median": statistics.median(s[1] for s in window),
            "sm_mhz_min": min(s[1] for s in window),
            "power_w_median": statistics.median(s[2] for s in window),
            "power_w_max": max(s[2] for s in window),
            "limit_reasons": reasons,  # NVML's bitmask: 0x4 software power cap, 0x20/0x40 thermal, 0x8 hardware slowdown
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def build_step(layer: Layer, layers: int, attention: str = "flash", unfused: bool = False) -> Any:
    """A closure running `layers` blocks forward, then backward from a fixed output gradient, its
    attention core on PyTorch's SDPA backend `attention` (ATTENTION_BACKENDS). `unfused` (Llama
    blocks): Transformers' LlamaDecoderLayer's operations as it writes them, each step a kernel
    of its own (LlamaRMSNorm, rotate_half's rotary embedding, SiLU times the up projection), with
    its separate query, key, value, gate and up projections."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, bf16 = "cuda", torch.bfloat16
    heads, kv_heads, ffn = layer.rank_heads, layer.rank_kv_heads, layer.rank_ffn
    q_dim, kv_dim = heads * HEAD_DIM, kv_heads * HEAD_DIM

    def weight(k: int, n: int) -> Any:
        return (torch.randn(k, n, device=dev, dtype=bf16) * k**-0.5).requires_grad_()

    h = layer.hidden
    shapes = {name: (k, n) for name, _, k, n in gemm_shapes(layer)}
    if unfused:
        shapes = {"q": (h, q_dim), "k": (h, kv_dim), "v": (h, kv_dim), "proj": shapes["proj"]}
        shapes |= {"gate": (h, ffn), "up": (h, ffn), "fc2": (ffn, h)}
    blocks = [
        {name: torch.ones(h, device=dev, dtype=bf16, requires_grad=True) for name in ("norm1", "norm2")}
        | {name: weight(k, n) for name, (k, n) in shapes.items()}
        for _ in range(layers)
    ]
    params = [p for b in blocks for p in b.values()]
    angles = torch.outer(torch.arange(layer.seq, device=dev), 10000.0 ** -(torch.arange(0, HEAD_DIM, 2, device=dev) / HEAD_DIM))
    cos, sin = (f(torch.cat((angles, angles), dim=-1)).to(bf16) for f in (torch.cos, torch.sin))

    def norm(x: Any, w: Any) -> Any:
        if unfused:  # LlamaRMSNorm
            x32 = x.to(torch.float32)
            return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        return F.rms_norm(x, (h,), w) if layer.llama else F.layer_norm(x, (h,), w)

    def rotary(t: Any) -> Any:  # Transformers' apply_rotary_pos_emb on [1, heads, s, d]
        half = HEAD_DIM // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    def block(x: Any, p: dict[str, Any]) -> Any:
        s = x.shape[0]
        normed = norm(x, p["norm1"])
        if unfused:
            q, k, v = normed @ p["q"], normed @ p["k"], normed @ p["v"]
        else:
            q, k, v = (normed @ p["qkv"]).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(1, s, heads, HEAD_DIM).transpose(1, 2)
        k, v = (t.view(1, s, kv_heads, HEAD_DIM).transpose(1, 2) for t in (k, v))
        if unfused:
            q, k = rotary(q), rotary(k)
        if kv_heads < heads:  # keys and values repeated to the heads, as Megatron-LM's legacy attention did
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        with sdpa_kernel(getattr(SDPBackend, ATTENTION_BACKENDS[attention])):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + o.transpose(1, 2).reshape(s, q_dim) @ p["proj"]
        normed = norm(x, p["norm2"])
        if unfused:
            return x + (F.silu(normed @ p["gate"]) * (normed @ p["up"])) @ p["fc2"]
        m = normed @ p["fc1"]
        m = F.silu(m[:, :ffn]) * m[:, ffn:] if layer.llama else F.gelu(m, approximate="tanh")
        return x + m @ p["fc2"]

    x0 = torch.randn(layer.seq, h, device=dev, dtype=bf16)
    grad = torch.randn(layer.seq, h, device=dev, dtype=bf16)

    def step() -> None:
        x = x0
        for p in blocks:
            x = block(x, p)
        x.backward(grad)
        for p in params:
            p.grad = None

    return step


def gemms_alone(layer: Layer) -> list[dict[str, Any]]:
    """Each of a block's GEMMs as autograd runs it (forward x @ w, input gradient dy @ w.T,
    weight gradient x.T @ dy), timed alone as benchmarks/calibrate_gpu.py times the curve's (its
    operands drawn from N(0, 1)), and, where a weight is an operand, again with the weight scaled
    as the step's are (by k^-1/2): whether the operands' values alone move a GEMM's time (the
    power its bits draw)."""
    import torch
    from calibrate_gpu import timed

    rows = []
    for name, m, k, n in gemm_shapes(layer):
        x, w, dy = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((m, k), (k, n), (m, n)))
        small = w * k**-0.5
        for way, run, scaled in (
            ("fwd", lambda: x @ w, lambda: x @ small),
            ("dgrad", lambda: dy @ w.T, lambda: dy @ small.T),
            ("wgrad", lambda: x.T @ dy, None),
        ):
            row = {"gemm": f"{name}.{way}", "m": m, "k": k, "n": n, "alone_s": timed(run, repeats=20)}
            rows.append(row | ({"alone_step_weights_s": timed(scaled, repeats=20)} if scaled else {}))
    return rows


def measure(layer: Layer, layers: int, seconds: float, sampler: Any, attention: str, unfused: bool) -> dict[str, Any]:
    import torch
    from calibrate_gpu import timed
    from small_gpt_gpu import profiled
    from sustained_load import EARLY_S, LATE_S, back_to_back, rates_over

    row: dict[str, Any] = asdict(layer) | {"layers": layers, "attention_backend": attention, "gemms": gemms_alone(layer)}
    row["gemms_alone_s"] = layers * sum(r["alone_s"] for r in row["gemms"])
    weighted = [r for r in row["gemms"] if "alone_step_weights_s" in r]
    random_s, scaled_s = (sum(r[key] for r in weighted) for key in ("alone_s", "alone_step_weights_s"))
    row["weight_gemms_alone_over_step_weights"] = random_s / scaled_s
    row["sim_attention"] = SIM_ATTENTION[attention]
    row["unfused"] = unfused
    row["sim_hopper_s"] = {kind: layers * t for kind, t in priced_block(layer, attention, unfused=unfused).items()}
    row["sim_h200_s"] = {kind: layers * t for kind, t in priced_block(layer, attention, H200, unfused).items()}

    step = build_step(layer, layers, attention, unfused)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    row["fresh_step_s"] = timed(step, repeats=5)
    row["fresh_profile"] = profiled(step)
    t1 = time.perf_counter()
    cycles = back_to_back(step, seconds, depth=8)
    t2 = time.perf_counter()
    row["sustained_profile"] = profiled(lambda: [step() for _ in range(SUSTAINED_PROFILED)])
    early, late = rates_over(cycles, 1.0)  # steps a second
    row |= {"cycles": len(cycles), "early_step_s": 1.0 / early, "late_step_s": 1.0 / late}
    bins: dict[int, list[float]] = {}  # the step time second by second: whether it still falls
    clock = 0.0
    for c in cycles:
        bins.setdefault(int(clock), []).append(c)
        clock += c
    row["step_s_by_second"] = [statistics.median(b) for _, b in sorted(bins.items())]
    if sampler is not None:
        row |= {"fresh_nvml": sampler.between(t0, t1), "early_nvml": sampler.between(t1, t1 + EARLY_S)}
        row["late_nvml"] = sampler.between(t2 - LATE_S, t2)
    row["sustained_by_kind_s"] = {kind: t / SUSTAINED_PROFILED for kind, t in row["sustained_profile"].get("by_kind_s", {}).items()}
    report(layer.name, row)  # the profiles keep their 40 largest kernels: a step's memory-bound kernels to size by shape
    return row


def report(name: str, row: dict[str, Any]) -> None:
    """A block's lines: its step fresh and sustained beside the simulator's, then by kind, then
    the clocks and power."""
    from sustained_load import EARLY_S, LATE_S

    fresh, sustained, sim, layers = (
        row["fresh_profile"].get("by_kind_s", {}),
        row["sustained_by_kind_s"],
        row["sim_h200_s"],
        row["layers"],
    )
    print(
        f"{name} x{layers}: step fresh {row['fresh_step_s'] * 1e3:.2f} ms, sustained {row['early_step_s'] * 1e3:.2f} "
        f"(first {EARLY_S} s) -> {row['late_step_s'] * 1e3:.2f} (last {LATE_S} s); simulator {sum(sim.values()) * 1e3:.2f} "
        f"(H200), {sum(row['sim_hopper_s'].values()) * 1e3:.2f} (hopper)",
        flush=True,
    )
    memory_kinds = [kind for kind in sustained if kind not in ("gemm", "attention")]
    for label, kinds in (("gemm", ["gemm"]), ("attention", ["attention"]), ("memory-bound", memory_kinds)):
        key = "memory" if label == "memory-bound" else label
        print(
            f"  {label}: fresh {sum(fresh.get(k, 0.0) for k in kinds) * 1e3:.2f} ms, sustained "
            f"{sum(sustained.get(k, 0.0) for k in kinds) * 1e3:.2f}, simulator {sim[key] * 1e3:.2f}"
            + (
                f", each alone {row['gemms_alone_s'] * 1e3:.2f} (with the step's weights "
                f"{1 / row['weight_gemms_alone_over_step_weights']:.3f} of the time)"
                if label == "gemm"
                else ""
            ),
            flush=True,
        )
    nvml = {k: row.get(f"{k}_nvml", {}) for k in ("fresh", "late")}
    print(
        f"  SM clock fresh {nvml['fresh'].get('sm_mhz_median')} MHz, late {nvml['late'].get('sm_mhz_median')}; "
        f"power fresh {nvml['fresh'].get('power_w_median')} W, late {nvml['late'].get('power_w_median')}",
        flush=True,
    )


def main() -> None:
    from src.out_paths import output_file, write_file  # a path it could not write, refused before the GPU's time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="device time the steps run back to back")
    parser.add_argument("--layers", type=int, default=4, help="blocks a step runs")
    parser.add_argument("--only", action="append", choices=[layer.name for layer in LAYERS])
    parser.add_argument("--attention", choices=list(ATTENTION_BACKENDS), default="flash", help="the attention core's SDPA backend")
    parser.add_argument("--unfused", action="store_true", help="Llama blocks as Transformers writes them, step by step")
    parser.add_argument("--sim-only", action="store_true", help="the simulator's price of each block by kind alone (no GPU)")
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    if args.seconds <= 2.5 or args.layers < 1:
        print(f"error: --seconds={args.seconds:g} must exceed 2.5 and --layers={args.layers} be at least 1", file=sys.stderr)
        sys.exit(2)
    chosen = [layer for layer in LAYERS if not args.only or layer.name in args.only]
    if args.unfused and not all(layer.llama for layer in chosen):
        others = ", ".join(layer.name for layer in chosen if not layer.llama)
        print(f"error: --unfused runs Transformers' Llama block, and {others} is not one (--only a Llama block)", file=sys.stderr)
        sys.exit(2)
    if args.sim_only:
        prices = {
            layer.name: {
                "hopper": priced_block(layer, args.attention, unfused=args.unfused),
                "h200": priced_block(layer, args.attention, H200, args.unfused),
            }
            for layer in chosen
        }
        print(json.dumps(prices))
        return
    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks/sustained_layer.py needs a CUDA GPU (or --sim-only), and torch sees none here", file=sys.stderr)
        sys.exit(2)
    try:
        sampler: Any = Sampler()
    except Exception as err:  # NVML absent or refused: the timings stand without the clocks
        print(f"NVML unavailable ({type(err).__name__}: {err}); no clock or power samples", flush=True)
        sampler = None
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "seconds": args.seconds}
    result |= {"attention": args.attention, "unfused": args.unfused}
    result["layers"] = []
    for layer in chosen:
        result["layers"].append(measure(layer, args.layers, args.seconds, sampler, args.attention, args.unfused))
        torch.cuda.empty_cache()
        if args.out:
            write_file(args.out, json.dumps(result, indent=1))
    if sampler is not None:
        idle_start = time.perf_counter()
        time.sleep(1.0)
        result["idle_nvml"] = sampler.between(idle_start, time.perf_counter())
        sampler.stop()
    if args.out:
        write_file(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
