"""The contrastive loss (CLIP's symmetric InfoNCE) over a batch spread over ranks.

Each rank scores its local images against every text of the contrastive batch and its
local texts against every image; the mean of these local losses over ranks is exactly
the loss of one process holding the whole batch.
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

    def forward(self, image: torch.Tensor, text: torch.Tensor, all_image: torch.Tensor, all_text: torch.Tensor,
                offset: int) -> torch.Tensor:
        """image/text: this rank's rows; all_*: the whole contrastive batch, in which this
        rank's rows start at `offset`."""
        image, text = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
        all_image, all_text = F.normalize(all_image, dim=-1), F.normalize(all_text, dim=-1)
        scale = self.logit_scale.exp()
        labels = torch.arange(offset, offset + image.shape[0])
        return (F.cross_entropy(scale * image @ all_text.t(), labels)
                + F.cross_entropy(scale * text @ all_image.t(), labels)) / 2
