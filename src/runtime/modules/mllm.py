"""The layers where an MLLM's units meet (src/models/mllm.py): the projectors, the LLM's
embedding that takes the encoder's image tokens, and its head that hands token states on
to the generator.

What crosses from one unit to the next (a chain flow) travels flattened, one row per
sequence (PayloadStore.row_shape: the unit's output_elems); the receiver reshapes it. A
consumer binds it under its producer's name (flows.chain_key), and its layer that reads
it is built knowing from whom.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from src.models.flows import chain_key
from src.data.interleaved_mllm import slot_token_mask
from src.runtime.modules.blocks import State, next_token_loss, packed_lengths, with_images
from src.runtime.modules.generator import COND
from src.runtime.modules.parallel import TP, ColumnParallelLinear, RowParallelLinear
from src.runtime.modules.sequence import split_sequence, unsplit_sequence


class Projector(nn.Module):
    """LLaVA's two-layer GELU MLP on every token, Megatron-TP (fc1 by columns, fc2 by rows).
    input: the ViT's patch tokens (its CLS dropped) become LLM-wide image tokens, handed
    on flattened; output: the LLM's handed-on states become the U-Net's condition
    (generator.COND, which its cross-attention reads). `sequence`: the LLM's length, the
    row an input projector hands each sequence's images on in under interleaved data."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, tp: TP, role: str, source: str | None = None, sequence: int = 0) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(d_in, d_hidden, tp)
        self.fc2 = RowParallelLinear(d_hidden, d_out, tp)
        self.d_in, self.role, self.source, self.sequence = d_in, role, source, sequence

    def forward(self, state: State) -> State:
        lengths = packed_lengths(state)
        if self.role == "input" and lengths is not None:  # images packed: every token but each image's CLS
            ends = torch.tensor(lengths, dtype=torch.long, device=state["x"].device).cumsum(0)
            keep = torch.ones(state["x"].shape[1], dtype=torch.bool, device=state["x"].device)
            keep[ends - torch.tensor(lengths, dtype=torch.long, device=ends.device)] = False
            tokens = state["x"][:, keep]
        elif self.role == "input":
            tokens = state["x"][:, 1:]
        else:
            assert self.source is not None, "an output projector reads the unit chained into it"
            inputs = state[chain_key(self.source)]
            tokens = inputs.reshape(
                inputs.shape[0], inputs.shape[1:].numel() // self.d_in, self.d_in
            )  # none where a share has no rows
        out = self.fc2(F.gelu(self.fc1(tokens)))
        slots = state.get("image_slots")  # interleaved sequences: images by slot (data.interleaved_mllm)
        if self.role == "input":
            if lengths is not None:  # the tokens of each image it ran at their places in its sequence, the rest zero
                mask = slot_token_mask(state["image_sides"], state["image_slots"], self.sequence)
                out = out.new_zeros(mask.shape + out.shape[-1:]).index_put((mask,), out[0])
            return {**state, "x": out.flatten(1)}
        if slots is not None:  # every image a sequence holds is generated under its condition
            out = out[slots.nonzero()[:, 0]]
        # The U-Net's layers hand the condition on (generator.handed_on); 'x' is what a plan
        # that runs each layer alone hands the next, whose U-Net starts from its own input.
        return {**state, COND: out, "x": out}


class MultimodalEmbedding(nn.Module):
    """Token embedding (rotary positions come later, in attention); the sequence's first
    positions hold the image tokens of the encoders chained in (`sources`, in flow order).
    Under sequence parallelism each TP rank keeps its part of the tokens."""

    def __init__(self, vocab: int, hidden: int, sources: tuple[str, ...], tp: TP) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.sources, self.tp = sources, tp

    def forward(self, state: State) -> State:
        return {**state, "x": split_sequence(with_images(self.tokens(state["ids"]), state, self.sources), self.tp)}


class ConditioningHead(nn.Module):
    """Llama's final RMSNorm and untied, bias-free output layer with the next-token loss;
    the normed states of the last `hand_on` positions go on to the generator as 'x'. Under
    sequence parallelism it reads the whole sequence."""

    def __init__(self, hidden: int, vocab: int, hand_on: int, tp: TP) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)
        self.hand_on, self.tp = hand_on, tp

    def forward(self, state: State) -> State:
        x = self.norm(unsplit_sequence(state["x"], self.tp))
        out = {**state, "loss": next_token_loss(self.proj(x), state)}
        if self.hand_on:
            out["x"] = x[:, -self.hand_on :].flatten(1)
        return out
