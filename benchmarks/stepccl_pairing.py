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
sequence, sequence parallelism, bf16, the `a800` preset), per TP degree: each pair's GEMM
and transfer, as the cost model prices them, and the forward's exposed transfer both ways.
With n chunks a pair of transfer c and GEMM g (whole, not per chunk) exposes c / n paired
with the GEMM it feeds or follows, plus (n - 1) / n x max(0, c - g).

    python benchmarks/stepccl_pairing.py [--chunks 4] [--tp 4 8]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: this repository's src

from src.config import composed  # noqa: E402
from src.costmodel.comm import CommModel  # noqa: E402
from src.costmodel.compute import ComputeModel  # noqa: E402
from src.mesh import Sharding, tensor_parallel  # noqa: E402
from src.models.layers import ACT_BYTES  # noqa: E402
from src.models.spec import Kernel, LayerSpec  # noqa: E402
from src.setup import validate  # noqa: E402

CASE = ["logger=none", "model=mllm_9b", "cluster=a800"]


@dataclass(frozen=True)
class Pair:
    collective: str  # all_gather (before the GEMMs it feeds) or reduce_scatter (after the GEMM that produces it)
    gemms: tuple[str, ...]
    gemm_s: float
    transfer_s: float

    def exposed(self, chunks: int, paired: bool) -> float:
        first = self.transfer_s / chunks
        if not paired:
            return first
        return first + (chunks - 1) / chunks * max(0.0, self.transfer_s - self.gemm_s)


def pairs(layer: LayerSpec, tp: int, compute: ComputeModel, comm: CommModel) -> list[Pair]:
    """The layer's TP transfers in forward order, each with the GEMMs it overlaps: under
    sequence parallelism an all-gather precedes each run of column-parallel GEMMs and a
    reduce-scatter follows each row-parallel one."""
    nbytes = layer.tp_comm_elems * ACT_BYTES
    sharding = tensor_parallel(tp, sequence_parallel=True)
    ranks = list(range(tp))
    gather = comm.collective_time("all_gather", ranks, nbytes)
    scatter = comm.collective_time("reduce_scatter", ranks, nbytes)
    out: list[Pair] = []
    column: list[Kernel] = []
    for kernel in layer.kernels:
        if kernel.kind != "gemm" or kernel.tp_split not in ("n", "k"):
            continue
        if kernel.tp_split == "n":
            column.append(kernel)
            continue
        if column:
            out.append(_pair("all_gather", column, sharding, compute, gather))
            column = []
        out.append(_pair("reduce_scatter", [kernel], sharding, compute, scatter))
    return out


def _pair(collective: str, gemms: list[Kernel], sharding: Sharding, compute: ComputeModel, transfer_s: float) -> Pair:
    seconds = 0.0
    for g in gemms:
        m_div, n_div, k_div, batch_div = sharding.gemm_divisors(g.tp_split)
        seconds += compute.gemm_duration(g.m / m_div, g.n / n_div, g.k / k_div, g.batch / batch_div)
    return Pair(collective, tuple(g.name for g in gemms), seconds, transfer_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--tp", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    setup = validate(composed(CASE))
    layer = next(layer for layer in setup.model.unit("llm").layers if layer.tp_allreduces)
    compute, comm = ComputeModel(setup.cluster, "bf16"), CommModel(setup.cluster)
    print(f"MLLM-9B's LLM block ({setup.model.unit('llm').seq_len} tokens, one sequence), a800, {args.chunks} chunks; ms")
    print("| TP | transfer | GEMMs | GEMM | transfer time | exposed, a pass at a time | exposed, paired |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for tp in args.tp:
        found = pairs(layer, tp, compute, comm)
        for p in found:
            print(
                f"| {tp} | {p.collective} | {', '.join(p.gemms)} | {p.gemm_s * 1e3:.3f} | {p.transfer_s * 1e3:.3f} | "
                f"{p.exposed(args.chunks, False) * 1e3:.3f} | {p.exposed(args.chunks, True) * 1e3:.3f} |"
            )
        whole = sum(p.exposed(args.chunks, False) for p in found)
        paired = sum(p.exposed(args.chunks, True) for p in found)
        print(f"| {tp} | the forward | | | | {whole * 1e3:.3f} | {paired * 1e3:.3f} |")


if __name__ == "__main__":
    main()
