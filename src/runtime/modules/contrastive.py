"""The contrastive loss (CLIP's symmetric InfoNCE) over a batch spread over ranks.

A rank scores the rows it holds (queries) against every row of the other modality in the
contrastive batch (keys): its images against all texts, its texts against all images.
It returns half the SUMMED cross-entropy of its rows, so the caller normalises by what
the whole batch has: a rank holding both modalities of its rows (data parallel) divides
by its rows and averages over ranks; a rank holding one modality (DistMM's separate
towers) divides by the contrastive batch, and the ranks' values add up to the loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ContrastiveLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
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
        return total / 2
