"""How many distinct LLM shapes DistTrain's planner must time on the data to find the best plan
it can find: DistTrain Fig. 15's three sizes (MLLM-9B and MLLM-72B on 1152 A800s, MLLM-15B on
1280, batch 1920, interleaved data of ten images a sequence), each planned with the best choice
of its `ranked_shapes` best distinct LLM shapes at the mean load timed on batch 0's data
(strategy.ranked_shapes), at several breadths and at every shape the orchestration recovers.

The data's skew slows a deep LLM pipeline most (its heavy micro-batches fill and drain every
stage), so the shapes that lead at the mean load are not those that lead on the data. Per
breadth: the plan's simulated time, the rank at the mean load of its LLM shape among every
shape's best choice, how many choices were timed on the data, and the plan's CPU time.
Prints a markdown table and writes it with --out.

With --choices, the same sizes under the `cost` balancing policy, planned with each of several
numbers of the orchestration's best choices at the mean load timed on the data
(strategy.ranked; the shapes at their default): per breadth the plan's simulated time, its LLM
shape, how many choices were timed and the plan's CPU time. A wider breadth is not always a
faster plan: only the best three by the estimate on the data are simulated.

    python benchmarks/disttrain_shape_breadth.py [--out benchmarks/results/disttrain_shape_breadth.md]
    python benchmarks/disttrain_shape_breadth.py --choices [--out benchmarks/results/disttrain_choice_breadth.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.cluster_inputs import priced_on
from src.config import composed
from src.out_paths import output_file, write_file
from src.setup import plan_run, validate

FIGURE = [
    "logger=none",
    "cluster=a800",
    "train.global_batch=1920",
    "model.images_per_sequence=10",
    "strategy=disttrain",
    "strategy.replicate=[encoder,generator]",
]
SIZES = {
    "MLLM-9B": ["model=mllm_9b", "cluster.nodes=144"],
    "MLLM-15B": ["model=mllm_15b", "cluster.nodes=160"],
    "MLLM-72B": ["model=mllm_72b", "cluster.nodes=144"],
}
BREADTHS = (8, 16, 32)
CHOICE_BREADTHS = (8, 16, 32, 64, 128, 256)
EVERY = 100_000  # more distinct shapes than any of these clusters has: each one's best choice


def llm_shape(record: dict) -> tuple:
    llm = record["units"]["llm"]
    return tuple(llm[k] for k in ("tp", "pp", "dp"))


def run(size: list[str], *overrides: str) -> tuple[list[dict], float]:
    cpu = time.process_time()
    planned = plan_run(validate(composed(FIGURE + size + list(overrides))))
    return planned.details["search"]["candidates"], time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_file)
    parser.add_argument("--choices", action="store_true", help="the choices timed (strategy.ranked) under train.balance=cost")
    args = parser.parse_args()
    table = (choice_breadths() if args.choices else shape_breadths()) + f"\n\n{priced_on([FIGURE])}"
    print(table)
    if args.out:
        command = "python benchmarks/disttrain_shape_breadth.py" + (" --choices" if args.choices else "")
        write_file(args.out, f"`{command}`\n\n{table}\n")


def shape_breadths() -> str:
    lines = [
        "| model | shapes timed | plan simulated (s) | its LLM shape (TP, PP, DP) | its rank at the mean load "
        "| choices timed on the data | plan CPU (s) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for name, size in SIZES.items():
        candidates, every_cpu = run(size, f"strategy.ranked_shapes={EVERY}")
        # Each LLM shape's (degrees') best choice at the mean load, in the orchestration's order.
        rank: dict[tuple, int] = {}
        for record in sorted((c for c in candidates if c["origin"] == "disaggregated"), key=lambda c: c["model_s"]):
            rank.setdefault(llm_shape(record), len(rank) + 1)
        for breadth in BREADTHS:
            timed, cpu = run(size, f"strategy.ranked_shapes={breadth}")
            lines.append(_row(name, str(breadth), timed, rank, cpu))
        lines.append(_row(name, f"all {len(rank)}", candidates, rank, every_cpu))
        print("\n".join(lines[-len(BREADTHS) - 1 :]), flush=True)
    return "\n".join(lines)


def choice_breadths() -> str:
    lines = [
        "| model | choices timed (strategy.ranked) | plan simulated (s) | its LLM shape (TP, PP, DP) | its generator (TP, DP) "
        "| choices timed on the data | plan CPU (s) |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for name, size in SIZES.items():
        for breadth in CHOICE_BREADTHS:
            timed, cpu = run(size, "train.balance=cost", f"strategy.ranked={breadth}")
            best = _simulated_best(timed)
            llm, generator = llm_shape(best), best["units"]["generator"]
            lines.append(
                f"| {name} | {breadth} | {best['simulated_s']:.3f} | {llm[0]}, {llm[1]}, {llm[2]} | "
                f"{generator['tp']}, {generator['dp']} | {len(timed)} | {cpu:.1f} |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines)


def _simulated_best(timed: list[dict]) -> dict:
    return min((c for c in timed if c["simulated_s"] is not None), key=lambda c: c["simulated_s"])


def _row(name: str, breadth: str, timed: list[dict], rank: dict[tuple, int], cpu: float) -> str:
    best = _simulated_best(timed)
    shape = llm_shape(best)
    return (
        f"| {name} | {breadth} | {best['simulated_s']:.3f} | {shape[0]}, {shape[1]}, {shape[2]} | "
        f"{rank.get(shape, '-')} | {len(timed)} | {cpu:.1f} |"
    )


if __name__ == "__main__":
    main()
