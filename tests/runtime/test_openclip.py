"""The contrastive models train as OpenCLIP (open_clip_torch 3.3) trains them by default,
checked against OpenCLIP's rules restated here: open_clip_torch cannot be a test dependency
on a CPU-only torch (it requires torchvision, whose only wheels on the package index are
built for CUDA and fail to load beside torch's CPU build).

- open_clip/loss.py: ClipLoss, the mean of the image->text and text->image cross-entropies
  of logit_scale * cosine similarities; CoCaLoss, clip_loss_weight * ClipLoss plus
  caption_loss_weight * CrossEntropyLoss(ignore_index=pad_id) over the caption's next
  tokens; open_clip_train's defaults weigh them caption 2 : contrastive 1, pad_id 0.
- open_clip_train/main.py: no weight decay where `p.ndim < 2 or "bn" in n or "ln" in n
  or "bias" in n or "logit_scale" in n`.
- open_clip_train/train.py: after each optimizer step, logit_scale.clamp_(0, math.log(100)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from src.config import ContrastiveSpec, DeepSpeedSpec, OptimizerSpec
from src.models.registry import build_model
from src.runtime.modules.contrastive import IGNORE, CaptionHead, ContrastiveLoss
from src.runtime.modules.parallel import TP
from src.runtime.modules.units import build_units
from src.runtime.optimizer import build_optimizer, parameter_groups


def openclip_clip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    image, text = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
    labels = torch.arange(image.shape[0])
    logits = logit_scale * image @ text.T
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def openclip_coca_loss(image, text, logit_scale, caption_logits, labels, caption_weight=2.0, clip_weight=1.0, pad_id=0):
    caption = nn.CrossEntropyLoss(ignore_index=pad_id)(caption_logits.permute(0, 2, 1), labels)
    return clip_weight * openclip_clip_loss(image, text, logit_scale) + caption_weight * caption


def openclip_exempt(name: str, param: nn.Parameter) -> bool:
    return param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def _tiny(name: str) -> nn.ModuleDict:
    model = build_model({"name": name, "scale": "tiny"})
    return build_units(model, 0, {}, {u.name: set(range(u.num_layers)) for u in model.units})


def test_the_defaults_are_openclip_s() -> None:
    assert ContrastiveSpec() == ContrastiveSpec(logit_scale_max=100.0, caption_loss_weight=2.0, contrastive_loss_weight=1.0, pad_id=0)


def test_the_contrastive_loss_is_openclip_s() -> None:
    torch.manual_seed(0)
    image, text = torch.randn(6, 8), torch.randn(6, 8)
    loss = ContrastiveLoss()
    ours = loss((0, image), (0, text), image, text) / 6  # the summed loss over the batch's rows
    assert torch.allclose(ours, openclip_clip_loss(image, text, loss.logit_scale.exp()), rtol=1e-6)


def test_coca_s_weighted_losses_with_padding_are_openclip_s() -> None:
    torch.manual_seed(0)
    batch, length, hidden, vocab = 6, 7, 16, 11
    image, text = torch.randn(batch, 8), torch.randn(batch, 8)
    caption = torch.randint(1, vocab, (batch, length + 1))
    for row in range(batch):
        caption[row, length + 1 - row :] = 0  # padding of every length
    x = torch.randn(batch, length, hidden)
    head, contrastive = CaptionHead(hidden, vocab, TP(), 2.0, 0), ContrastiveLoss(1.0)
    ours = head({"x": x, "targets": caption[:, 1:]})["loss"] + contrastive((0, image), (0, text), image, text) / batch
    logits = head.proj(head.ln(x))
    expected = openclip_coca_loss(image, text, contrastive.logit_scale.exp(), logits, caption[:, 1:])
    assert torch.allclose(ours, expected, rtol=1e-6)


def test_coca_s_caption_loss_split_over_micro_batches_adds_up_to_one_process_s() -> None:
    """Micro-batches holding different amounts of padding: each takes the step's scored
    tokens per sample, and the shares (each over the micro-batches) add up to the whole
    batch's mean, as OpenCLIP takes it in one process."""
    torch.manual_seed(1)
    batch, length, hidden, vocab = 8, 6, 16, 11
    targets = torch.randint(1, vocab, (batch, length))
    targets[:, -1] = IGNORE  # no token follows the last position
    targets[:3, 2:] = 0  # the first micro-batch's captions are short
    x = torch.randn(batch, length, hidden)
    head = CaptionHead(hidden, vocab, TP(), 2.0, 0)
    whole = head({"x": x, "targets": targets})["loss"]
    head.scored_per_sample = float(((targets != IGNORE) & (targets != 0)).sum()) / batch
    parts = [head({"x": x[i : i + 4], "targets": targets[i : i + 4]})["loss"] / 2 for i in (0, 4)]
    assert torch.allclose(sum(parts), whole, rtol=1e-6)


def test_biases_norms_and_the_logit_scale_take_no_weight_decay() -> None:
    for name in ("clip", "coca"):
        units = _tiny(name)
        decayed, exempt = (set(map(id, group["params"])) for group in parameter_groups(units, OptimizerSpec()))
        expected = {id(p) for n, p in units.named_parameters() if openclip_exempt(n, p)}
        assert exempt == expected and not decayed & exempt
        assert decayed | exempt == {id(p) for p in units.parameters()}
        everything = parameter_groups(units, OptimizerSpec(no_decay=()))
        assert not everything[1]["params"]


def test_an_update_decays_only_the_decayed_group() -> None:
    units = _tiny("clip")
    optimizer = build_optimizer(units, DeepSpeedSpec(optimizer=OptimizerSpec(lr=0.1, weight_decay=0.5)), ContrastiveSpec())
    before = {n: p.detach().clone() for n, p in units.named_parameters()}
    for p in units.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for n, p in units.named_parameters():
        assert torch.equal(p, before[n]) == openclip_exempt(n, p), n


def test_the_logit_scale_is_clamped_after_each_step() -> None:
    units = _tiny("clip")
    scale = units["interaction"][0].logit_scale
    sgd = DeepSpeedSpec(optimizer=OptimizerSpec(type="SGD", lr=10.0))

    def updated(optimizer: torch.optim.Optimizer, grad: float) -> float:
        with torch.no_grad():
            scale.fill_(math.log(1 / 0.07))
        scale.grad = torch.full_like(scale, grad)
        optimizer.step()
        return float(scale.detach())

    clamped = build_optimizer(units, sgd, ContrastiveSpec())
    assert updated(clamped, -1.0) == float(torch.tensor(math.log(100)))  # +10: beyond ln 100
    assert updated(clamped, 100.0) == 0.0  # -1000: below 0 (a scale of 1)
    free = build_optimizer(units, sgd, ContrastiveSpec(logit_scale_max=None))
    assert updated(free, -1.0) > math.log(100)
