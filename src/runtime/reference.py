"""The single-process reference: the same modules, data, optimizer and schedule in a plain loop.

What every parallel plan must reproduce: with the same seed, initial weights and global
batch, its losses equal these (the loss-equality tests, within float reduction order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from src.batch_layout import BatchLayout
from src.config import ContrastiveSpec, DeepSpeedSpec
from src.models.spec import ModelSpec
from src.runtime.device import computing
from src.runtime.inputs import Batches, StepSamples, dataset_for
from src.runtime.loss_scale import LossScale, unscale_and_check
from src.runtime.modules.units import build_units, unit_layers
from src.runtime.optimizer import build_optimizer, build_scheduler
from src.models.flows import chain_key, flows_of, unit_order

CPU = torch.device("cpu")


@dataclass(frozen=True)
class ReferenceStep:
    loss: float
    lr: float  # the learning rate the step's update used
    grad_norm: float | None  # the gradients' global norm before clipping (None: an fp16 step skipped)


def reference_losses(*args: Any, **kwargs: Any) -> list[float]:
    """reference_steps' losses."""
    return [step.loss for step in reference_steps(*args, **kwargs)]


def reference_steps(
    model: ModelSpec,
    seed: int,
    global_batch: int,
    steps: int,
    deepspeed: DeepSpeedSpec = DeepSpeedSpec(),
    data: str = "synthetic",
    contrastive_batch: int | None = None,
    precision: str = "fp32",
    content: str = "uniform",
    contrastive: ContrastiveSpec = ContrastiveSpec(),
) -> list[ReferenceStep]:
    """`steps` steps' losses, learning rates and gradient norms. The contrastive loss is the mean over the step's
    consecutive slices of `contrastive_batch` samples (default: the whole batch), each
    scored against itself only, as the parallel plans' batch-syncs score them. `precision`:
    the GEMMs' (runtime.device.computing); `content`: an MLLM's (inputs.dataset_for);
    `deepspeed` and `contrastive`: backend.deepspeed's and backend.contrastive's settings
    (gradient clipping here clips the whole model's norm, as one engine does)."""
    rbs = contrastive_batch or global_batch
    units = build_units(model, seed, {}, {u.name: set(range(u.num_layers)) for u in model.units}, contrastive=contrastive)
    params = [p for p in units.parameters() if p.requires_grad]
    optimizer = build_optimizer(units, deepspeed, contrastive)
    scheduler = build_scheduler(optimizer, deepspeed.scheduler, steps)
    whole = BatchLayout(global_batch, micro_batch=global_batch)  # one micro-batch: no plan splits the batch here
    batches = Batches(
        StepSamples(
            model,
            dataset_for(model, seed, data, content=content),
            global_batch,
            {u.name: (whole, 0) for u in model.units},
        )
    )
    scale = LossScale.of(deepspeed.fp16) if precision == "fp16" else None  # runtime.loss_scale's rule
    done = []
    for step in range(steps):
        batches.start_step(step)
        finals: dict[str, dict[str, torch.Tensor]] = {}
        loss = torch.zeros(())
        for name in unit_order(model):
            if name == model.interaction:
                vision, text = (p for p, c in model.flows if c == name)
                for a, b in zip(finals[vision]["feature"].split(rbs), finals[text]["feature"].split(rbs)):
                    with computing(CPU, precision):
                        loss = loss + unit_layers(units, name)[0]((0, a), (0, b), a, b).float() / global_batch
                continue
            state = dict(batches(name, 0))
            for producer, consumer in model.flows:
                if consumer == name and "tokens" in finals.get(producer, {}):
                    state["memory"] = finals[producer]["tokens"]
            for flow in flows_of(model):
                if flow.consumer == name and flow.kind == "chain":
                    state[chain_key(flow.producer)] = finals[flow.producer][flow.tensor]
            with torch.set_grad_enabled(model.needs_backward(name)), computing(CPU, precision):
                for layer in unit_layers(units, name):
                    state = layer(state)
            finals[name] = state
            if "loss" in state:
                loss = loss + state["loss"].float()
        optimizer.zero_grad()
        (loss if scale is None else loss * scale.scale).backward()
        overflow = scale is not None and bool(unscale_and_check(params, scale.scale, CPU).item())
        lr, norm = float(optimizer.param_groups[0]["lr"]), None
        if not overflow:
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            if deepspeed.gradient_clipping > 0:
                torch.nn.utils.clip_grads_with_norm_(params, deepspeed.gradient_clipping, norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        if scale is not None:
            scale.update(overflow)
        done.append(ReferenceStep(float(loss.detach()), lr, None if norm is None else float(norm)))
    return done
