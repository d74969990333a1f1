"""Megatron-LM's distributed optimizer (ZeRO-1) where the plan issues its collectives, in a
DeepSpeed engine's place.

A unit whose plan reduce-scatters its gradients and all-gathers its parameters itself (DP
collectives naming its layers, Collective.grads_of: an LLM sharing its ranks with encoders, whose reduce-scatter
runs under the encoders' backward and whose all-gather under the next step's encoder
forwards, Megatron-LM's --overlap-param-gather) steps here. Its trainable parameters are
flattened into one buffer, Megatron-LM's and DeepSpeed's contiguous one, of which each
data-parallel replica owns a contiguous shard (the buffer padded to a multiple of the
replicas) and keeps the AdamW states of that shard only:

- reduce-scatter: the gradients, flattened, reduced over the replicas, each keeping its
  shard averaged as DeepSpeed averages (gloo has no reduce-scatter: an all-reduce whose
  rank keeps its part, as elsewhere);
- step: the run's optimizer (backend.deepspeed.optimizer, its learning-rate schedule) on
  the shard, the very update a whole optimizer makes there (it is elementwise). The buffer
  holds the decayed parameters first and those exempt from decay (no_decay) after them, so
  a shard is at most two pieces, one parameter group each;
- all-gather: every replica's shard to every replica, copied into the parameters.

Each collective starts where its instruction stands and, asynchronous, is finished at the
plan's Wait (Pending.finish); the forward after that Wait reads the gathered parameters.
A checkpoint holds each rank's parameters, shard, optimizer states and schedule
(runtime.own_engine's files, which runtime.checkpoint saves as a DeepSpeed engine's). It
takes no gradient norm (the step's record says so: grad_norm null), so it refuses nothing
more than the pipelines it serves already do (clipping over a pipeline is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from src.config import ContrastiveSpec, DeepSpeedSpec
from src.program import Collective, Plan
from src.runtime.engines import ParallelGroups
from src.runtime.optimizer import build_scheduler, new_optimizer, parameter_groups
from src.runtime.own_engine import OwnEngine

SHARDED = ("reduce_scatter", "all_gather")  # the distributed optimizer's collectives a plan may issue itself


def sharded_units(plan: Plan, rank: int) -> set[str]:
    """The units whose distributed optimizer `rank`'s instructions run (their DP
    reduce-scatter or all-gather names their layers)."""
    return {
        instruction.grads_of[0]
        for instruction in plan.program.class_of(rank).instructions
        if isinstance(instruction, Collective) and instruction.grads_of is not None and instruction.op in SHARDED
    }


@dataclass
class Pending:
    """A collective in flight and what finishes it once it has arrived (once: a finished
    one is finished)."""

    work: dist.Work | None
    then: Callable[[], None]
    done: bool = False

    def finish(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        self.then()
        self.done = True


class DistributedOptimizer(OwnEngine):
    def __init__(
        self, module: nn.Module, groups: ParallelGroups, settings: DeepSpeedSpec, contrastive: ContrastiveSpec, steps: int
    ) -> None:
        ranks = groups.dp_ranks
        self.module, self.group, self.replicas = module, groups.dp, len(ranks)
        self.mpu = groups  # as a DeepSpeed engine's (runtime.engines.point_reduction_at reads them)
        spec = settings.optimizer
        decayed, exempt = (group["params"] for group in parameter_groups(module, spec))
        self.params = decayed + exempt
        self.device = self.params[0].device
        self.sizes = [p.numel() for p in self.params]
        self.shard = -(-sum(self.sizes) // self.replicas)
        self.first = ranks.index(dist.get_rank()) * self.shard
        flat = self._flat([p.detach() for p in self.params])
        self.master = flat[self.first : self.first + self.shard].float().clone()
        # The shard's decayed piece and its exempt piece: parameters viewing the master shard.
        split = min(max(sum(p.numel() for p in decayed) - self.first, 0), self.shard)
        self.pieces = [nn.Parameter(self.master[:split]), nn.Parameter(self.master[split:])]
        extras: list[dict] = [{}, {"weight_decay": 0.0}]
        groups_of = [{"params": [piece], **extra} for piece, extra in zip(self.pieces, extras) if piece.numel()]
        self.optimizer = new_optimizer(spec, groups_of)
        self.lr_scheduler = build_scheduler(self.optimizer, settings.scheduler, steps)
        self._reduced: Pending | None = None

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors side by side in one buffer of every replica's shard, zero-padded."""
        flat = torch.zeros(self.shard * self.replicas, dtype=torch.float32, device=self.device)
        torch.cat([t.reshape(-1).float() for t in tensors], out=flat[: sum(self.sizes)])
        return flat

    def reduce_scatter(self) -> Pending:
        """Start reducing the gradients; once finished, this replica's shard holds their mean."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat(grads)
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def keep() -> None:
            grad = flat[self.first : self.first + self.shard].div_(self.replicas)
            split = self.pieces[0].numel()
            self.pieces[0].grad, self.pieces[1].grad = grad[:split], grad[split:]

        self._reduced = Pending(work, keep)
        return self._reduced

    def all_gather(self) -> Pending:
        """Start gathering every replica's shard; once finished, the parameters hold them."""
        out = torch.empty(self.shard * self.replicas, dtype=self.master.dtype, device=self.master.device)
        work = dist.all_gather(list(out.chunk(self.replicas)), self.master.detach(), group=self.group, async_op=True)

        def copy() -> None:
            with torch.no_grad():
                for param, piece in zip(self.params, out[: sum(self.sizes)].split(self.sizes)):
                    param.copy_(piece.view_as(param))

        return Pending(work, copy)

    def step(self) -> None:
        """AdamW on this replica's shard, from the reduced gradients (reduced here if the
        plan did not reduce them before, waited for if the plan did not wait)."""
        (self._reduced or self.reduce_scatter()).finish()
        self._reduced = None
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.zero_grad()

    def _extra_state(self) -> dict[str, torch.Tensor]:
        return {"master": self.master.detach()}

    def _load_extra_state(self, state: dict) -> None:
        with torch.no_grad():
            self.master.copy_(state["master"])
