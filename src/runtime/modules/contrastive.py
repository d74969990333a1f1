"""The contrastive loss (CLIP's symmetric InfoNCE) over a batch spread over ranks, and
CoCa's captioning loss beside it, weighted as OpenCLIP weighs them (backend.contrastive).

A rank scores the rows it holds (queries) against every row of the other modality in the
contrastive batch (keys): its images against all texts, its texts against all images.
It returns half the SUMMED cross-entropy of its rows, so the caller normalises by what
the whole batch has: a rank holding both modalities of its rows (data parallel) divides
by its rows and averages over ranks; a rank holding one modality (towers on separate
ranks) divides by the contrastive batch, and the ranks' values add up to the loss.

CoCa's captioning head scores the caption tokens that are not padding (OpenCLIP's pad_id)
and takes their mean over the step: a micro-batch's summed cross-entropy over the step's
scored tokens per sample times its rows, so that any split of the step into micro-batches
and replicas adds up to the mean one process takes (`scored_per_sample`, set before each
step by the session where padding makes it vary; None: the micro-batch's own mean).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from src.runtime.modules.blocks import LMHead, State
from src.runtime.modules.parallel import TP
from src.runtime.modules.sequence import unsplit_sequence

IGNORE = -100  # cross_entropy's ignore_index: the targets no token follows


class ContrastiveLoss(nn.Module):
    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        self.weight = weight
        # CLIP's initial temperature; shape (1,), since DeepSpeed cannot broadcast a 0-dim parameter.
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(1 / 0.07)))

    def forward(
        self,
        image: tuple[int, torch.Tensor] | None,
        text: tuple[int, torch.Tensor] | None,
        all_image: torch.Tensor | None,
        all_text: torch.Tensor | None,
    ) -> torch.Tensor:
        """image/text: this rank's rows of a modality and where they start in the batch
        (None: it scores none); all_*: the whole contrastive batch of the modality its rows
        are scored against (needed only for the other modality of the rows it scores)."""
        scale = self.logit_scale.exp()
        total = scale.new_zeros(())
        for query, keys in ((image, all_text), (text, all_image)):
            if query is None:
                continue
            offset, rows = query
            assert keys is not None, "rows are scored against the other modality's batch"
            labels = torch.arange(offset, offset + rows.shape[0], device=rows.device)
            logits = scale * F.normalize(rows, dim=-1) @ F.normalize(keys, dim=-1).t()
            total = total + F.cross_entropy(logits, labels, reduction="sum")
        return total * (self.weight / 2)


def scored_targets(targets: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """Which caption targets a captioning loss scores: those a token follows that is not
    padding (`pad_id`; None: none is)."""
    keep = targets != IGNORE
    return keep if pad_id is None else keep & (targets != pad_id)


class CaptionHead(LMHead):
    """CoCa's captioning head: next-token cross-entropy over the caption tokens that are not
    `pad_id` (None: all of them), times `weight`."""

    def __init__(self, hidden: int, vocab: int, tp: TP, weight: float, pad_id: int | None) -> None:
        super().__init__(hidden, vocab, tp)
        self.weight, self.pad_id = weight, pad_id
        self.scored_per_sample: float | None = None

    def forward(self, state: State) -> State:
        logits = self.proj(self.ln(unsplit_sequence(state["x"], self.tp)))
        targets = state["targets"]
        scored = scored_targets(targets, self.pad_id)
        summed = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.masked_fill(~scored, IGNORE).reshape(-1), reduction="sum"
        )
        count = scored.sum() if self.scored_per_sample is None else self.scored_per_sample * targets.shape[0]
        return {**state, "loss": summed * self.weight / count}
