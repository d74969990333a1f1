"""The interface of an optimizer the harness runs itself in a DeepSpeed engine's place (a
tensor grid's, runtime.grid_engine; the plan's distributed optimizer, runtime.dist_optimizer).

It answers what the executor, the step's metrics and the checkpoints ask of a DeepSpeed
engine (`optimizer`, `lr_scheduler`, `step`, `zero_grad`, `get_global_grad_norm`,
`save_checkpoint`, `load_checkpoint`), so none of them asks which engine it holds, and it
differs in two ways the executor relies on: it reduces its own gradients (the executor runs
a plain autograd backward for it and points no DeepSpeed reduction at it), and each rank
keeps its own state, one file per rank under the engine's checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class OwnEngine:
    """Subclasses set `module`, `params` (the trained parameters), `optimizer` and
    `lr_scheduler`, and add what else their state holds (`_extra_state`)."""

    module: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def get_global_grad_norm(self) -> float | None:
        """The last step's gradient norm over its data- and tensor-parallel groups, as a
        DeepSpeed engine's; None where it takes none (runtime.step_metrics records grad_norm
        null)."""
        return None

    def _extra_state(self) -> dict[str, torch.Tensor]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what `_extra_state` saved."""

    def save_checkpoint(self, directory: str, tag: str, save_latest: bool = False) -> None:
        path = Path(directory) / tag
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            **self._extra_state(),
        }
        torch.save(state, path / f"rank{dist.get_rank()}.pt")

    def load_checkpoint(
        self, directory: str, tag: str, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = False
    ) -> tuple[str | None, dict]:
        path = Path(directory) / tag / f"rank{dist.get_rank()}.pt"
        if not path.exists():
            return None, {}
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["module"])
        self._load_extra_state(state)
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        if load_lr_scheduler_states and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        return str(path), {}
