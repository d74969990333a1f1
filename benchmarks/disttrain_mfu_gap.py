"""Where DistTrain's MFU goes: MLLM-72B on 1152 A800s, batch 1920 (DistTrain Fig. 15, whose
paper value is 54.7 %), split into the causes that take its points.

Every run's machine time (every GPU of the cluster for one iteration) is split, in points
of MFU, into what each GPU does:
- MFU: model FLOPs at the device's peak;
- kernel efficiency: forward and backward compute time beyond what the model's and the
  recomputation's FLOPs take at peak (GEMMs below peak, memory-bound kernels);
- recomputation: the forwards run again (HFU - MFU);
- optimizer step; exposed communication by kind; pipeline bubbles by kind; idle ranks
  (a rank done before the iteration ends); GPUs the plan leaves unused.
They add up to 100. Five runs, each through the front door's planner and the simulator:
DistTrain on interleaved data (the figure's), the same with its attention cores priced as
GEMMs on the device's curve (model.attention=flash, where the preset's `flash2` prices them
at FlashAttention 2's rates as measured on an A100: the kernel's version is software the
paper does not state), on uniform data (every sequence alike: what the data costs), and the LLM alone
(Llama 70B as model=gpt) with DistTrain's LLM plan on its GPUs (what this cost model gives
unimodal training of that LLM, the paper's comparison: "closely approximates that of
state-of-the-art unimodal LLM training", §8.1 line 127).
Prints a markdown table and writes it with --out.

    python benchmarks/disttrain_mfu_gap.py [--out benchmarks/results/disttrain_mfu_gap.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.cluster_inputs import priced_on
from src.config import composed
from src.metrics import iteration_flops, summarize
from src.plan_io import PlannedRun
from src.program import Plan, UnitPlan
from src.out_paths import output_file, write_file
from src.setup import Setup, plan_run, validate
from src.sim.engine import simulate
from src.timeline import BREAKDOWN_CATEGORIES, Timeline

FIGURE = ["logger=none", "cluster=a800", "cluster.nodes=144", "train.global_batch=1920", "model.images_per_sequence=10"]
# DistTrain as Figure 15 runs it: the encoder and generator replicated over each TP group (§8.1, line 122).
MLLM = FIGURE + ["model=mllm_72b", "strategy=disttrain", "strategy.replicate=[encoder,generator]"]
# MLLM-72B's LLM (DistTrain Table 1: Llama3-70B's shapes, Llama 2's 32000-token vocabulary).
LLM_ALONE = [
    "model=gpt",
    "model.preset=null",
    "model.style=llama",
    "model.layers=80",
    "model.hidden=8192",
    "model.heads=64",
    "model.ffn=28672",
    "model.kv_heads=8",
    "model.vocab=32000",
    "train.seq_len=8192",
]
PAPER_MFU = 0.547  # DistTrain abstract line 5, §8.1 line 127: reference only, nothing computes with it


def priced(overrides: list[str]) -> tuple[Setup, Plan, Timeline]:
    setup = validate(composed(overrides))
    plan = plan_run(setup)
    return setup, plan, simulate(plan.program, setup.model, setup.cluster, setup.train.precision)


def points(setup: Setup, plan: Plan, timeline: Timeline) -> dict[str, float]:
    """The cluster's machine time of one iteration, in points of MFU per cause (sum 100)."""
    seconds, devices = timeline.iteration_time, setup.cluster.devices
    peak = setup.cluster.peak(plan.precision)
    machine = seconds * devices * peak  # FLOPs the cluster could do in the iteration
    model_flops, hardware_flops = iteration_flops(setup.model, plan, setup.train)
    out = {"MFU": 100 * model_flops / machine, "recomputation": 100 * (hardware_flops - model_flops) / machine}
    optimizer = 0.0
    by_category = dict.fromkeys(BREAKDOWN_CATEGORIES, 0.0)
    for rank_timeline in timeline.ranks:
        n = len(rank_timeline.ranks)
        for category, spent in rank_timeline.breakdown.items():
            by_category[category] += n * spent
        steps = [s for s in rank_timeline.spans if s.category == "compute" and s.name.startswith("optimizer")]
        optimizer += n * sum(s.end - s.start for s in steps)
    share = 100 / (seconds * devices)
    out["kernel efficiency"] = share * (by_category.pop("compute") - optimizer) - out["MFU"] - out["recomputation"]
    out["optimizer step"] = share * optimizer
    for category, spent in by_category.items():
        out[category] = share * spent
    out["GPUs left unused"] = share * (devices - plan.devices) * seconds
    return out


def unit_plans(plan: Plan) -> str:
    def shape(u: UnitPlan) -> str:
        rows = f" rows{u.row_shares}" if u.row_shares > 1 else ""
        return f"{u.unit} tp{u.mesh.degree('tp')}{rows} pp{u.mesh.degree('pp')} dp{u.mesh.degree('dp')}"

    return "; ".join(shape(u) for u in plan.units)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_file, default=None, help="also write the table here")
    args = parser.parse_args()
    wall, cpu = time.perf_counter(), time.process_time()
    runs: dict[str, tuple[Setup, Plan, Timeline]] = {
        "DistTrain, interleaved data": priced(MLLM + ["train.data=interleaved"]),
        "DistTrain, interleaved data, attention as GEMMs": priced(MLLM + ["train.data=interleaved", "model.attention=flash"]),
        "DistTrain, uniform data": priced(MLLM + ["train.data=uniform"]),
    }
    llm = next(u for u in runs["DistTrain, uniform data"][1].units if u.unit == "llm")
    tp, pp, dp = llm.mesh.degree("tp"), llm.mesh.degree("pp"), llm.mesh.degree("dp")
    nodes = -(-tp * pp * dp // 8)
    runs[f"the LLM alone, DistTrain's LLM plan (tp {tp} pp {pp} dp {dp})"] = priced(
        FIGURE[:-1]
        + LLM_ALONE
        + [
            f"cluster.nodes={nodes}",
            "strategy=megatron",
            f"strategy.tp={tp}",
            f"strategy.pp={pp}",
            f"strategy.micro_batch_size={llm.micro_batch}",
            f"strategy.recompute={llm.recompute}",
            f"strategy.zero_stage={llm.zero_stage}",
            f"strategy.sequence_parallel={str(llm.sequence_parallel).lower()}",
            f"strategy.vpp={llm.vpp}",
            "strategy.uneven_pp=true",  # DistTrain cuts its LLM's stages as evenly as they go
        ]
    )
    tables = {name: points(*run) for name, run in runs.items()}
    causes = list(dict.fromkeys(cause for table in tables.values() for cause in table))
    names = list(tables)
    lines = [
        "# Where DistTrain's MFU goes: MLLM-72B on 1152 A800s, batch 1920",
        "",
        "Written by `python benchmarks/disttrain_mfu_gap.py` (the simulator, this repository's cluster preset "
        f"`a800`). The paper reports {100 * PAPER_MFU:.1f} % MFU for this run (on 1172 GPUs). Points of the "
        "cluster's machine time per cause; each column adds up to 100.",
        "",
        "| cause | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for cause in causes:
        values = [tables[name].get(cause, 0.0) for name in names]
        if any(abs(v) >= 0.05 for v in values):
            lines.append(f"| {cause} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    lines += ["", "Iteration time and plan:", ""]
    for name, (setup, plan, timeline) in runs.items():
        summary = summarize(PlannedRun(setup.model, setup.cluster, setup.train, plan), timeline)
        lines.append(f"- {name}: {timeline.iteration_time:.2f} s, MFU {100 * summary['mfu']:.1f} %, {unit_plans(plan)}")
    lines += ["", priced_on([FIGURE])]
    text = "\n".join(lines) + "\n"
    print(text)
    print(f"({time.perf_counter() - wall:.0f} s wall, {time.process_time() - cpu:.0f} s CPU)")
    if args.out is not None:
        write_file(args.out, text)


if __name__ == "__main__":
    main()
