"""What share of its HBM bandwidth a GPU's memory-bound PyTorch kernels reach in a training step.

Reads the kernel profiles `small_gpt_gpu.py` recorded on a lent GPU (one profiled step of the
plain loop per case and way: each kernel's name, launches and total time) and, for the kernels
whose bytes follow from the case's shape alone, divides those bytes by the time: GELU forward
and backward over the MLP's activations, LayerNorm's forward, its input gradient and its affine
parameters' reduction, and the fused AdamW over every parameter (the biases' column sums share
one kernel name across widths, whose bytes a line's launches do not fix). Each rate is given as a share of the device's datasheet
bandwidth; the median over the kinds (each kind's median over its cases and ways, so that a
kind profiled more often weighs no more) is what a preset's `memory_efficiency` takes (the rate the cost
model gives every bandwidth-bound kernel of a layer, its optimizer and its loss), where a
device copy's share (`calibrate_gpu.py`) is what a GEMM's operand stream reaches.

    python benchmarks/memory_kernel_rates.py benchmarks/results/small_gpt_h200.json \
        benchmarks/results/small_gpt_variants_h200.json --hbm 4.8e12 \
        --out benchmarks/results/memory_kernel_rates_h200.json

It also reads `measure_memory_kernels.py`'s kernels timed alone (each kind over a transformer's
shapes, the bytes it counts), by the same rule: on a lent H100,
`python benchmarks/memory_kernel_rates.py memory_kernels.json --hbm 3.35e12`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: src.out_paths, standard library only
from src.out_paths import output_file, write_file  # noqa: E402

# The profile's ways (small_gpt_gpu.py VARIANTS): autocast keeps fp32 weights and runs LayerNorm in
# fp32 (its input, the residual stream, is fp32); bf16_weights runs every layer kernel in bf16.
NORM_BYTES = {"autocast": 4, "autocast+fused_adamw": 4, "bf16_weights+fused_adamw": 2}


@dataclass(frozen=True)
class Shape:
    """A profiled case's model and micro-batch (small_gpt_gpu.Case's fields)."""

    hidden: int
    layers: int
    seq: int
    micro_batch: int
    micro_batches: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    @property
    def params(self) -> int:
        """Megatron-LM's GPT layer with biases (12h^2 + 13h), learned positions, a tied head and
        the final LayerNorm."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (self.vocab + self.seq) * h + 2 * h


@dataclass(frozen=True)
class KernelRule:
    """A kernel the profile names, its kind and the bytes one launch moves."""

    kind: str
    words: tuple[str, ...]  # all in the (truncated) kernel name
    launch_bytes: Callable[[Shape, int], float]  # (shape, the way's LayerNorm element bytes)
    # Its launches a micro-batch, where the bytes are a launch's; None: the bytes are the step's,
    # however many launches split them (the optimizer's).
    per_micro_batch: Callable[[Shape], int] | None
    ways: tuple[str, ...] = tuple(NORM_BYTES)  # the ways whose kernel of this name is this one


def _per_layer(s: Shape) -> int:
    return s.layers


def _per_norm(s: Shape) -> int:  # two LayerNorms a layer and the final one
    return 2 * s.layers + 1


RULES = [
    # bf16 in, bf16 out over the MLP's tokens x 4h activations (both ways: the GEMM before it is bf16)
    KernelRule("gelu forward", ("GeluCUDAKernelImpl",), lambda s, b: 4.0 * s.tokens * 4 * s.hidden, _per_layer),
    # the incoming gradient and the input read, the input's gradient written
    KernelRule("gelu backward", ("GeluBackward",), lambda s, b: 6.0 * s.tokens * 4 * s.hidden, _per_layer),
    # the input read and the output written (the rows' mean and reciprocal deviation are negligible)
    KernelRule("layernorm forward", ("vectorized_layer_norm_kernel",), lambda s, b: 2.0 * b * s.tokens * s.hidden, _per_norm),
    # the output's gradient and the input read, the input's gradient written
    KernelRule("layernorm input gradient", ("layer_norm_grad_input",), lambda s, b: 3.0 * b * s.tokens * s.hidden, _per_norm),
    # the output's gradient and the input read, reduced over the tokens
    KernelRule("layernorm weight gradient", ("GammaBetaBackward",), lambda s, b: 2.0 * b * s.tokens * s.hidden, _per_norm),
    # fp32 weights, gradients and moments: each read, all but the gradient written (28 bytes a parameter)
    KernelRule(
        "fused adamw",
        ("multi_tensor_apply_kernel",),
        lambda s, b: 28.0 * s.params,
        None,
        ways=("autocast+fused_adamw",),
    ),
]


def rule_for(name: str, way: str) -> KernelRule | None:
    return next((r for r in RULES if way in r.ways and all(w in name for w in r.words)), None)


def launches_expected(rule: KernelRule, shape: Shape) -> int | None:
    """How many launches of the kernel one step runs, where the rule's bytes are per launch."""
    return None if rule.per_micro_batch is None else rule.per_micro_batch(shape) * shape.micro_batches


def kernel_rates(profile: dict[str, Any], hbm: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for case_name, case in profile["cases"].items():
        shape = Shape(**{k: case["case"][k] for k in ("hidden", "layers", "seq", "micro_batch", "micro_batches", "vocab")})
        ways = {"autocast": case["plain"], **case.get("plain_variants", {})}
        for way, run in ways.items():
            if way not in NORM_BYTES or "top_kernels" not in run.get("profile", {}):
                continue
            for kernel in run["profile"]["top_kernels"]:
                rule = rule_for(kernel["name"], way)
                if rule is None:
                    continue
                expected = launches_expected(rule, shape)
                if expected is not None and kernel["count"] != expected:
                    continue  # another kernel of the same name shares the line: its bytes are not known
                total = rule.launch_bytes(shape, NORM_BYTES[way]) * (1 if expected is None else kernel["count"])
                rate = total / kernel["total_s"]
                rows.append(
                    {
                        "case": case_name,
                        "way": way,
                        "kernel": rule.kind,
                        "launches": kernel["count"],
                        "us_per_launch": 1e6 * kernel["total_s"] / kernel["count"],
                        "mb_per_launch": total / kernel["count"] / 1e6,
                        "tb_per_s": rate / 1e12,
                        "share": rate / hbm,
                    }
                )
    return rows


def timed_rates(result: dict[str, Any], hbm: float) -> list[dict[str, Any]]:
    """The kernels `measure_memory_kernels.py` timed alone, each kind at each shape, with the
    bytes it counted; its copy is the preset's `copy_efficiency`, not one of the kinds."""
    return [
        {
            "case": f"{row['tokens']} x {row['width']}",
            "way": "alone",
            "kernel": row["kind"],
            "launches": 1,
            "us_per_launch": 1e6 * row["seconds"],
            "mb_per_launch": row["bytes"] / 1e6,
            "tb_per_s": row["bandwidth"] / 1e12,
            "share": row["bandwidth"] / hbm,
        }
        for row in result["kernels"]
        if row["kind"] != "copy"
    ]


def rates_of(document: dict[str, Any], hbm: float) -> list[dict[str, Any]]:
    """A small_gpt_gpu.py profile's kernels, or measure_memory_kernels.py's; none for anything else."""
    if "cases" in document:
        return kernel_rates(document, hbm)
    if all("kind" in row and "bandwidth" in row for row in document.get("kernels", [{}])):
        return timed_rates(document, hbm)
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "profiles",
        type=Path,
        nargs="+",
        help="small_gpt_gpu.py --out files with their plain loops' profiles, or measure_memory_kernels.py --out files",
    )
    parser.add_argument("--hbm", type=float, required=True, help="the device's datasheet HBM bandwidth, bytes/s")
    parser.add_argument("--out", type=output_file, help="write the rates and their median share here (JSON)")
    args = parser.parse_args()
    if args.hbm <= 0:
        parser.exit(2, f"--hbm must be a positive bandwidth in bytes/s, got {args.hbm}\n")
    rows: list[dict[str, Any]] = []
    devices = set()
    for path in args.profiles:
        try:
            profile = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            parser.exit(2, f"cannot read the profile {path}: {err}\n")
        devices.add(profile.get("device"))
        rows += [{"profile": path.name, **row} for row in rates_of(profile, args.hbm)]
    if len(devices) > 1:
        parser.exit(2, f"the profiles come from different devices ({sorted(map(str, devices))}): one --hbm prices one device\n")
    if not rows:
        parser.exit(2, f"{', '.join(map(str, args.profiles))} hold no profiled kernel these rules size\n")
    print(f"{'case':<28} {'way':<26} {'kernel':<26} {'launches':>8} {'us':>8} {'MB':>8} {'TB/s':>6} {'share':>6}")
    for r in rows:
        print(
            f"{r['case']:<28} {r['way']:<26} {r['kernel']:<26} {r['launches']:>8} {r['us_per_launch']:>8.1f}"
            f" {r['mb_per_launch']:>8.1f} {r['tb_per_s']:>6.2f} {r['share']:>6.3f}"
        )
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        by_kind.setdefault(r["kernel"], []).append(r["share"])
    # Each kind of kernel counts once, however many cases and ways profiled it.
    kinds = {k: statistics.median(v) for k, v in by_kind.items()}
    median = statistics.median(kinds.values())
    print("\nmedian share by kernel: " + ", ".join(f"{k} {v:.3f}" for k, v in kinds.items()))
    print(f"median over the {len(kinds)} kinds: {median:.3f}")
    if args.out:
        summary = {
            "profiles": [p.as_posix() for p in args.profiles],
            "device": devices.pop(),
            "datasheet_hbm": args.hbm,
            "kernels": rows,
            "median_share_by_kernel": kinds,
            "median_share": median,
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        }
        write_file(args.out, json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
