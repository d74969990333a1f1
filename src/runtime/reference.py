"""The single-process reference: the same modules, data and optimizer in a plain loop.

What every parallel plan must reproduce: with the same seed, initial weights and global
batch, its losses equal these (the loss-equality tests, within float reduction order).
"""

from __future__ import annotations


import torch

from src.models.spec import ModelSpec
from src.runtime.device import computing
from src.runtime.inputs import Batches, Batching, StepSamples, dataset_for
from src.runtime.loss_scale import LossScale, overflowed, unscale
from src.runtime.modules.units import build_units, unit_layers
from src.models.flows import chain_key, flows_of, unit_order

CPU = torch.device("cpu")


def reference_losses(
    model: ModelSpec,
    seed: int,
    global_batch: int,
    steps: int,
    lr: float,
    weight_decay: float = 0.0,
    data: str = "synthetic",
    contrastive_batch: int | None = None,
    eps: float = 1e-8,
    precision: str = "fp32",
    initial_loss_scale: float = 65536.0,
    content: str = "uniform",
) -> list[float]:
    """Losses of `steps` steps. The contrastive loss is the mean over the step's
    consecutive slices of `contrastive_batch` samples (default: the whole batch), each
    scored against itself only, as the parallel plans' batch-syncs score them. `precision`:
    the GEMMs' (runtime.device.computing); `content`: an MLLM's (inputs.dataset_for)."""
    rbs = contrastive_batch or global_batch
    units = build_units(model, seed, {}, {u.name: set(range(u.num_layers)) for u in model.units})
    params = [p for p in units.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=eps)
    whole = Batching(batch_per_replica=global_batch, micro_batch=global_batch, num_microbatches=1, sample_groups=1)
    batches = Batches(
        StepSamples(
            model,
            dataset_for(model, seed, data, content=content),
            global_batch,
            {u.name: whole for u in model.units},
            {u.name: 0 for u in model.units},
        )
    )
    scale = LossScale(initial_loss_scale) if precision == "fp16" else None  # runtime.loss_scale's rule
    losses = []
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
        if scale is None:
            loss.backward()
            optimizer.step()
        else:
            (loss * scale.scale).backward()
            overflow = overflowed(params)
            if not overflow:
                unscale(params, scale.scale)
                optimizer.step()
            scale.update(overflow)
        losses.append(float(loss.detach()))
    return losses
