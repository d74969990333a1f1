"""The balancing figure: every balancing policy for Megatron-LM (its plan chosen at the mean load,
and chosen on the data: strategy.choose_on=data) and DistTrain (its orchestration's 64 best
choices and the best of its 32 best distinct LLM shapes timed on the data, its defaults) on
MLLM-9B/15B/72B on 1152 A800s
(global batch 1920, DistTrain's Figure 15 sizes), each plan priced on 16 (9B) or 8 global
batches of interleaved data; then the skew swept for MLLM-9B over a range declared here before
any result was seen, 4 batches a point (a simulated batch of 1152 GPUs, each replica's pipeline
its own rank classes, takes 10-20 s on a 2-core machine).

The skew's range: a sequence's mean image count (model.images_per_sequence) of 5, 10 and 20
(10 is DistTrain's "typical training sample" of ten images, §4.2; half and twice it bracket
it), and the spread of image sides (model.image_size_spread) of 0, 0.3 and 0.6 (0: every
image at the encoder's side; 0.3 gives DistTrain Fig. 5(b)'s 64-1024 tokens; 0.6 twice as
wide). The sweep's other value stays at the figure's (10 images, spread 0.3).

Optimus plans its own MLLMs (encoders feeding an LLM, no generator), so it has cases of its
own: Figure 15's model B (ViT-22B + LLAMA-70B on 128 H100s, batch 64, Table 11's degrees)
and Figure 16's DualEnc(22B, 5B) (GPT-175B on 512 H100s, batch 256, Appendix D.3's degrees),
on interleaved data of the MLLM cases' image density, ten 256-token images in 8192 tokens
(DistTrain §4.2) being 2.5 in Optimus's 2048, rounded up to whole images: 3 a sequence, at
spread 0.3 (each image read by both encoders of the DualEnc model); Optimus beside
Megatron-LM as the figure's preset runs it (the paper's plan, and balanced for model B).

Writes benchmarks/results/balance/<case>/balance.{json,md} (python -m src.balance_study's
files) and benchmarks/results/balance/README.md (every case's table).

    python benchmarks/balance_figure.py [--jobs 2] [--only CASE]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src import balance_study

OUT = Path(__file__).resolve().parent / "results" / "balance"
BASE = ["logger=none", "cluster=a800", "cluster.nodes=144", "train.global_batch=1920"]
# Megatron-LM as DistTrain's Figure 15 runs its best plan: the encoder and generator on stages of
# their own, replicated over each TP group (§2.1).
SERIES = [
    "megatron=strategy=megatron strategy.modality_stages=extra strategy.replicate=[encoder,generator]",
    # The same search with its plan chosen on the first batch under each policy (strategy.choose_on).
    "megatron_on_data=strategy=megatron strategy.modality_stages=extra strategy.replicate=[encoder,generator] strategy.choose_on=data",
    # DistTrain as its §8.1 runs: the encoder and generator replicated over each TP group (line 122).
    "disttrain=strategy=disttrain strategy.replicate=[encoder,generator]",
]
# A plan chosen on the data replaces the one chosen at the mean load: its skew is that one's.
SKEW_OF = ["megatron_on_data=megatron"]
# Megatron-LM's search with k more warm-up forwards on every stage but the last (strategy.extra_warmup),
# k = 1, 2, 4 (not searched: each is a plan of its own, whose skew is Megatron-LM's 1F1B's).
WARMUPS = (1, 2, 4)
WARMUP_SERIES = [
    f"megatron_warmup{k}=strategy=megatron strategy.modality_stages=extra strategy.replicate=[encoder,generator] "
    f"strategy.extra_warmup={k}"
    for k in WARMUPS
]
WARMUP_SKEW_OF = [f"megatron_warmup{k}=megatron" for k in WARMUPS]
A800 = "1152 A800s, batch 1920"


@dataclass(frozen=True)
class Case:
    overrides: list[str]
    batches: int
    title: str = A800
    series: list[str] = field(default_factory=lambda: SERIES)
    skew_of: list[str] = field(default_factory=lambda: SKEW_OF)


# Optimus's Figure 15, model B, as sweeps/optimus_fig15_weak_scaling.yaml runs it.
OPTIMUS_B = [
    "model=optimus",
    "model.encoders=[vit_22b]",
    "model.llm=llama_70b",
    "cluster=hopper",
    "cluster.nodes=16",
    "train.global_batch=64",
]
TABLE_11 = "strategy.tp=8 strategy.micro_batch_size=2 strategy.pp=4"
OPTIMUS_SERIES = [
    f"megatron=strategy=megatron strategy.modality_stages=merged {TABLE_11} strategy.vpp=5",
    f"balanced=strategy=megatron strategy.balance=true {TABLE_11} strategy.vpp=6",
    "optimus=strategy=optimus strategy.llm.tp=8 strategy.llm.micro_batch_size=2 strategy.llm.pp=4",
]
# Optimus's Figure 16, DualEnc(22B, 5B), as sweeps/optimus_fig16_multi_encoder.yaml runs it.
DUALENC = ["model=optimus", "model.encoders=[vit_22b,vit_5b]", "model.llm=gpt_175b", "cluster=hopper", "cluster.nodes=64"]
D3 = "strategy.tp=8 strategy.pp=8 strategy.micro_batch_size=2"
DUALENC_SERIES = [
    f"megatron=strategy=megatron strategy.modality_stages=merged {D3} strategy.vpp=12",
    "optimus=strategy=optimus strategy.llm.tp=8 strategy.llm.pp=8 strategy.llm.micro_batch_size=2",
]
CASES: dict[str, Case] = {
    "mllm_9b": Case(
        BASE + ["model=mllm_9b", "model.images_per_sequence=10"], 16, A800, SERIES + WARMUP_SERIES, SKEW_OF + WARMUP_SKEW_OF
    ),
    "mllm_15b": Case(
        BASE + ["model=mllm_15b", "model.images_per_sequence=10"], 8, A800, SERIES + WARMUP_SERIES, SKEW_OF + WARMUP_SKEW_OF
    ),
    "mllm_72b": Case(
        BASE + ["model=mllm_72b", "model.images_per_sequence=10"], 8, A800, SERIES + WARMUP_SERIES, SKEW_OF + WARMUP_SKEW_OF
    ),
    "mllm_9b_images_5": Case(BASE + ["model=mllm_9b", "model.images_per_sequence=5"], 4),
    "mllm_9b_images_20": Case(BASE + ["model=mllm_9b", "model.images_per_sequence=20"], 4),
    "mllm_9b_spread_0": Case(BASE + ["model=mllm_9b", "model.images_per_sequence=10", "model.image_size_spread=0"], 4),
    "mllm_9b_spread_0.6": Case(BASE + ["model=mllm_9b", "model.images_per_sequence=10", "model.image_size_spread=0.6"], 4),
    "optimus_b": Case(
        ["logger=none", *OPTIMUS_B, "train.data=interleaved", "model.images_per_sample=3"],
        8,
        "Optimus Fig. 15 model B, 128 H100s, batch 64",
        OPTIMUS_SERIES,
        [],
    ),
    "optimus_dualenc": Case(
        ["logger=none", *DUALENC, "train.global_batch=256", "train.data=interleaved", "model.images_per_sample=3"],
        8,
        "Optimus Fig. 16 DualEnc(22B, 5B), 512 H100s, batch 256",
        DUALENC_SERIES,
        [],
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", choices=list(CASES), action="append")
    args = parser.parse_args()
    for case in args.only or list(CASES):
        spec = CASES[case]
        argv = [f"--batches={spec.batches}", f"--jobs={args.jobs}", f"--out={OUT / case}", f"--title={case}, {spec.title}"]
        argv += [f"--series={s}" for s in spec.series] + [f"--skew-of={s}" for s in spec.skew_of] + spec.overrides
        print(f"{case}: python -m src.balance_study {' '.join(argv)}", flush=True)
        if balance_study.main(argv) != 0:
            return 2
    tables = [(OUT / case / "balance.md").read_text() for case in CASES if (OUT / case / "balance.md").exists()]
    (OUT / "README.md").write_text(
        "# Balancing policies on skewed data\n\nMade by `python benchmarks/balance_figure.py` (docs/balancing.md says how "
        "to read it).\n\n" + "\n".join(t.replace("# ", "## ", 1) for t in tables)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
