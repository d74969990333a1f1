"""What a real run's step records beside its loss and time (metrics.jsonl and W&B): the
learning rate its update used, the model's gradient norm, the loss scale, samples and
tokens per second, peak memory. Each rank reads its own engines; the session adds the
ranks' shares up in the collectives it runs after every step anyway.
"""

from __future__ import annotations

import math
import resource
from typing import Any

import torch

from src.models.spec import ModelSpec
from src.runtime.optimizer import norm_share


def distinct(engines: dict[str, Any]) -> list[Any]:
    """Each engine of this rank once (units that share an engine name it each)."""
    return list({id(engine): engine for engine in engines.values()}.values())


def learning_rate(engines: dict[str, Any]) -> float | None:
    """The learning rate the next update of this rank's engines uses (one schedule for all);
    None where this rank trains nothing."""
    for engine in distinct(engines):
        groups = engine.optimizer.param_groups
        return float(groups[0]["lr"])
    return None


def gradient_norm_share(engines: dict[str, Any]) -> tuple[float, bool]:
    """This rank's share of the model's squared gradient norm after its step, and whether
    every engine of this rank took its norm (an engine of our own takes none)."""
    share, known = 0.0, True
    for engine in distinct(engines):
        norm = engine.get_global_grad_norm()
        if norm is None:
            known = False
            continue
        groups = engine.mpu
        share += norm_share(float(norm), groups.get_data_parallel_world_size(), groups.get_model_parallel_world_size())
    return share, known


def gradient_norm(total_share: float, unknown_ranks: float, skipped: bool) -> float | None:
    """The model's gradient norm from the ranks' shares; None where a step was skipped
    (fp16 overflow: no engine updated) or some rank's engine takes no norm."""
    if skipped or unknown_ranks > 0 or not math.isfinite(total_share):
        return None
    return math.sqrt(total_share)


def tokens_per_sample(model: ModelSpec) -> int | None:
    """The tokens of a sample's token sequences: each unit that embeds tokens (a text tower,
    an LLM, image tokens included) counts its sequence; None for a model with none (a U-Net)."""
    counted = [unit.seq_len for unit in model.units if any(layer.name == "embedding" for layer in unit.layers)]
    return sum(counted) if counted else None


def start_memory_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_peak_gib(device: torch.device) -> float:
    """A GPU's peak allocated memory since start_memory_peak; on a CPU the process's peak
    resident set so far (the kernel keeps no per-step peak)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
