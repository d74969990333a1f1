"""Benchmark: what StepCCL's overlap exposes when each collective is paired with its own GEMM.

DistTrain's StepCCL cuts a TP collective and the GEMM next to it into chunks and runs chunk
c + 1's transfer under chunk c's GEMM: an all-gather under the GEMM it feeds, a reduce-scatter
under the GEMM that produces it (§7, line 106). Where a transfer is longer than its GEMM, the
difference is exposed at every chunk but the first ("when TP communication is longer than
GEMM, fusing them cannot fully hide the communication overhead", line 108; the LLM backbone
has no module without a dependency to hide it under). The simulator prices the pairs so
(`LayerSpec.tp_pairs`, `Collective.beside`); before, it priced the overlap a pass at a time:
chunk c's collectives of every layer of the stage under chunk c + 1's compute of every
layer, which exposed only the last chunk's transfers (the table's "a pass at a time").

For one layer's forward of DistTrain Fig. 22's case (MLLM-9B's LLM, one micro-batch of a
sequence, sequence parallelism, bf16, the `a800` preset), per TP degree: each of the layer's
pairs as the simulator prices them (`LayerSpec.tp_pairs`: an all-reduce's volume, half of it
the reduce-scatter beside the row-parallel product, half the all-gather beside the next
column-parallel one), a chunk's GEMM and its share of the chunk's transfer, and what the
forward exposes both ways. With n chunks a pair of chunk transfer c and chunk GEMM g
exposes c (the last chunk's) a pass at a time, and paired c + (n - 1) x max(0, c - g).

    python benchmarks/stepccl_pairing.py [--chunks 4] [--tp 4 8] [--out benchmarks/results/stepccl_pairing.md]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.cluster_inputs import priced_on  # noqa: E402
from src.config import composed  # noqa: E402
from src.costmodel.comm import CommModel  # noqa: E402
from src.costmodel.compute import ComputeModel  # noqa: E402
from src.mesh import tensor_parallel  # noqa: E402
from src.models.layers import ACT_BYTES  # noqa: E402
from src.models.spec import ModelSpec  # noqa: E402
from src.out_paths import output_file, write_file  # noqa: E402
from src.setup import validate  # noqa: E402
from src.strategies.builders.emit import paired_gemms  # noqa: E402

CASE = ["logger=none", "model=mllm_9b", "cluster=a800"]


@dataclass(frozen=True)
class Pair:
    collective: int  # which of the pass's TP collectives (an all-reduce's volume)
    gemm: str
    gemm_s: float  # the GEMM's chunk
    transfer_s: float  # its share of the chunk's transfer

    def exposed(self, chunks: int, paired: bool) -> float:
        if not paired:
            return self.transfer_s
        return self.transfer_s + (chunks - 1) * max(0.0, self.transfer_s - self.gemm_s)


def pairs(model: ModelSpec, tp: int, chunks: int, compute: ComputeModel, comm: CommModel) -> list[Pair]:
    """The forward pairs of the LLM's first block at `tp` under sequence parallelism, one
    sequence a micro-batch, each priced as the simulator's overlapped pass prices it."""
    unit = model.unit("llm")
    index, layer = next((i, layer) for i, layer in enumerate(unit.layers) if layer.tp_allreduces)
    sharding = tensor_parallel(tp, sequence_parallel=True)
    pass_pairs = layer.tp_pairs(False, "none", True)
    assert pass_pairs is not None, "a Llama block pairs each collective with its products"
    latency, transfer = comm.collective_parts("all_reduce", tuple(range(tp)), layer.tp_comm_elems * ACT_BYTES / chunks)
    out = []
    for number, pair in enumerate(pass_pairs):
        share = (latency + transfer) / len(pair)
        for (_, kernel), gemm in zip(pair, paired_gemms("llm", index, 1, sharding, 1 / chunks, pair)):
            out.append(Pair(number, layer.kernels[kernel].name, compute.work_streams(gemm, model)[0], share))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--tp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--out", type=output_file, default=None, help="also write the table here")
    args = parser.parse_args()
    setup = validate(composed(CASE))
    compute, comm = ComputeModel(setup.cluster, "bf16"), CommModel(setup.cluster)
    lines = [
        f"MLLM-9B's LLM block ({setup.model.unit('llm').seq_len} tokens, one sequence), a800, {args.chunks} chunks; ms",
        "| TP | collective | GEMM | GEMM's chunk | transfer's share of a chunk | exposed, a pass at a time | exposed, paired |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for tp in args.tp:
        found = pairs(setup.model, tp, args.chunks, compute, comm)
        for p in found:
            lines.append(
                f"| {tp} | {p.collective} | {p.gemm} | {p.gemm_s * 1e3:.3f} | {p.transfer_s * 1e3:.3f} | "
                f"{p.exposed(args.chunks, False) * 1e3:.3f} | {p.exposed(args.chunks, True) * 1e3:.3f} |"
            )
        whole = sum(p.exposed(args.chunks, False) for p in found)
        paired = sum(p.exposed(args.chunks, True) for p in found)
        lines.append(f"| {tp} | the forward | | | | {whole * 1e3:.3f} | {paired * 1e3:.3f} |")
    lines += ["", priced_on([CASE])]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        command = f"python benchmarks/stepccl_pairing.py --chunks {args.chunks} --tp {' '.join(map(str, args.tp))}"
        write_file(args.out, f"`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
