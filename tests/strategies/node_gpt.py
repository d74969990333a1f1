"""The strategy tests' model: a GPT of hidden 512 on one 8-GPU DGX A100 node, small enough that
a plan takes milliseconds and large enough that every parallel layout fits."""

from __future__ import annotations


def node_gpt(layers: int, global_batch: int) -> list[str]:
    """The overrides of a GPT of `layers` blocks trained on batches of `global_batch`."""
    return [
        "model=gpt",
        "model.preset=null",
        f"model.layers={layers}",
        "model.hidden=512",
        "model.heads=8",
        "model.vocab=1024",
        "train.seq_len=128",
        "cluster=dgx_a100",
        "cluster.nodes=1",
        f"train.global_batch={global_batch}",
        "logger=none",
    ]
