"""Megatron-LM's distributed optimizer (ZeRO-1) where the plan issues its collectives, in a
DeepSpeed engine's place.

A unit whose plan reduce-scatters its gradients and all-gathers its parameters itself (DP
collectives naming its layers, Collective.grads_of) steps here: an LLM sharing its ranks with
encoders, whose reduce-scatter runs under the encoders' backward and whose all-gather under
the next step's encoder forwards; and Megatron-LM's own --overlap-grad-reduce (each layer's
gradients reduce-scattered as the last micro-batch's backward finishes them) and
--overlap-param-gather (each layer's parameters gathered before its first forward of the
next step). Its trainable parameters lie in buckets, Megatron-LM's contiguous buffers: one
for all of them where the plan reduces and gathers them whole, one per layer where it goes
layer by layer (Megatron-LM's buckets, which the simulator prices as layers). Each bucket is
padded to a multiple of the data-parallel replicas, each replica owns a contiguous slice of
every bucket and keeps the AdamW states of its slices only (its master shard: the slices side
by side):

- reduce-scatter: a bucket's gradients, flattened, reduced over the replicas, each keeping
  its slice averaged as DeepSpeed averages (gloo has no reduce-scatter: an all-reduce whose
  rank keeps its part, as elsewhere); a step's buckets the plan did not reduce are reduced
  at its optimizer step;
- step: the run's optimizer (backend.deepspeed.optimizer, its learning-rate schedule) on
  the shard, the very update a whole optimizer makes there (it is elementwise). A bucket
  holds its decayed parameters first and those exempt from decay (no_decay) after them, so
  a slice is at most two pieces, one parameter group each;
- all-gather: every replica's slices of the buckets gathered, copied into the parameters.

Each collective starts where its instruction stands and, asynchronous, is finished at the
plan's Wait (Pending.finish); the forward after that Wait reads the gathered parameters.
A checkpoint holds each rank's parameters, shard, optimizer states and schedule
(runtime.own_engine's files, which runtime.checkpoint saves as a DeepSpeed engine's); the
parameters a step's forward will gather are gathered before it is saved, as Megatron-LM
forces its parameter sync before a checkpoint (DistributedDataParallel.disable_forward_pre_hook).
At each step it takes the gradient norm over its data- and tensor-parallel groups (each
replica's slices, a parameter split over TP counted on each rank, a replicated one once), as
a DeepSpeed engine reports its own, and clips by the model's (backend.deepspeed.gradient_clipping):
its own where it holds every trained parameter, else its own reduced over the pipeline's
stages (runtime.clipping says where; ParallelGroups.pp).
Under fp16 the executor takes the loss scale off what it reduced before the overflow check
(`unscale`), and a step that overflowed anywhere drops it (`zero_grad`).
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
from src.runtime.optimizer import (
    build_scheduler,
    clip_to,
    mark_tensor_parallel,
    new_optimizer,
    over_stages,
    parameter_groups,
    squared_norm,
    tp_count,
)
from src.runtime.own_engine import OwnEngine

SHARDED = ("reduce_scatter", "all_gather")  # the distributed optimizer's collectives a plan may issue itself


def named_ranges(instructions: list) -> dict[str, dict[str, list[tuple[int, int]]]]:
    """Per unit, the layer ranges the distributed-optimizer collectives of `instructions`
    name, by op."""
    named: dict[str, dict[str, list[tuple[int, int]]]] = {}
    reduced = [(i.op, i.grads_of) for i in instructions if isinstance(i, Collective) and i.grads_of is not None]
    for op, (unit, layers) in reduced:
        if op in SHARDED:
            named.setdefault(unit, {o: [] for o in SHARDED})[op].append(layers)
    # A whole gradient all-reduced for a sharded optimizer is its reduction (DeepSpeed's pipeline
    # engine; emit.dp_grad_op); elsewhere a named all-reduce is plain data parallelism's.
    for op, (unit, layers) in reduced:
        if op == "all_reduce" and unit in named:
            named[unit]["reduce_scatter"].append(layers)
    return named


def sharded_units(plan: Plan, rank: int) -> dict[str, bool]:
    """The units whose distributed optimizer `rank`'s instructions run (their DP
    reduce-scatter or all-gather names their layers), each with whether it goes layer by
    layer (a bucket per layer) rather than whole."""
    named = named_ranges(plan.program.class_of(rank).instructions)
    return {unit: any(len(ranges) > 1 for ranges in ops.values()) for unit, ops in named.items()}


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


@dataclass
class _Bucket:
    """Parameters reduced and gathered together: a flat buffer of `shard` elements a
    replica, of which this replica owns [first, first + shard), held at `offset` of its
    master shard; `counted`: which ranges of that slice hold which parameter's elements, each
    with what its squared norm counts for (optimizer.tp_count; the padding none)."""

    layers: range  # the unit's layers it holds the parameters of
    params: list[nn.Parameter]  # decayed first, then exempt
    decayed: int  # elements of the decayed ones
    shard: int
    first: int
    offset: int
    counted: list[tuple[int, int, float]]
    current: bool = True  # the parameters hold the master's values (gathered since the last step)

    @property
    def size(self) -> int:
        return sum(p.numel() for p in self.params)


def _counted(params: list[nn.Parameter], first: int, shard: int, tp: int) -> list[tuple[int, int, float]]:
    """The ranges of the slice [first, first + shard) of `params` side by side that each
    parameter's elements fill, relative to the slice, with its tp_count."""
    out, at = [], 0
    for param in params:
        start, end = max(at, first), min(at + param.numel(), first + shard)
        if start < end:
            out.append((start - first, end - first, tp_count(param, tp)))
        at += param.numel()
    return out


class DistributedOptimizer(OwnEngine):
    def __init__(
        self,
        module: nn.ModuleList,
        groups: ParallelGroups,
        settings: DeepSpeedSpec,
        contrastive: ContrastiveSpec,
        steps: int,
        layerwise: bool = False,
    ) -> None:
        """`module`: the unit's layers (None where another rank holds one); `layerwise`: a
        bucket per layer, else one for all."""
        ranks = groups.dp_ranks
        self.module, self.group, self.replicas = module, groups.dp, len(ranks)
        self.mpu = groups  # as a DeepSpeed engine's (runtime.engines.point_reduction_at reads them)
        self.max_norm = settings.gradient_clipping
        mark_tensor_parallel(module)
        spec = settings.optimizer
        held = [(index, layer) for index, layer in enumerate(module) if layer is not None]
        parts = (
            [(range(index, index + 1), layer) for index, layer in held]
            if layerwise
            else [(range(held[0][0], held[-1][0] + 1), module)]
        )
        replica = ranks.index(dist.get_rank())
        self.buckets: list[_Bucket] = []
        offset = 0
        for layers, part in parts:
            decayed, exempt = (group["params"] for group in parameter_groups(part, spec))
            size = sum(p.numel() for p in decayed + exempt)
            if not size:
                continue
            shard, params = -(-size // self.replicas), decayed + exempt
            counted = _counted(params, replica * shard, shard, groups.get_model_parallel_world_size())
            self.buckets.append(_Bucket(layers, params, sum(p.numel() for p in decayed), shard, replica * shard, offset, counted))
            offset += shard
        self.params = [p for bucket in self.buckets for p in bucket.params]
        self.device = self.params[0].device
        self.master = torch.cat([self._slice(b, self._flat(b, [p.detach() for p in b.params])) for b in self.buckets]).float()
        # Each slice's decayed piece and its exempt piece: parameters viewing the master shard.
        pieces: tuple[list[nn.Parameter], list[nn.Parameter]] = ([], [])
        self.pieces: list[tuple[nn.Parameter, nn.Parameter]] = []
        for bucket in self.buckets:
            mine = self.master[bucket.offset : bucket.offset + bucket.shard]
            split = min(max(bucket.decayed - bucket.first, 0), bucket.shard)
            pair = (nn.Parameter(mine[:split]), nn.Parameter(mine[split:]))
            self.pieces.append(pair)
            for kept, piece in zip(pieces, pair):
                if piece.numel():
                    kept.append(piece)
        extras: list[dict] = [{}, {"weight_decay": 0.0}]
        groups_of = [{"params": kept, **extra} for kept, extra in zip(pieces, extras) if kept]
        self.optimizer = new_optimizer(spec, groups_of)
        self.lr_scheduler = build_scheduler(self.optimizer, settings.scheduler, steps)
        self._reduced: dict[int, Pending] = {}  # bucket index -> its reduction this step
        self._grads: dict[int, torch.Tensor] = {}  # bucket index -> this replica's slice of its reduced gradients
        self._global_grad_norm: float | None = None

    def _flat(self, bucket: _Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
        """A bucket's tensors side by side in one buffer of every replica's slice, zero-padded."""
        flat = torch.zeros(bucket.shard * self.replicas, dtype=torch.float32, device=self.device)
        torch.cat([t.reshape(-1).float() for t in tensors], out=flat[: bucket.size])
        return flat

    @staticmethod
    def _slice(bucket: _Bucket, flat: torch.Tensor) -> torch.Tensor:
        return flat[bucket.first : bucket.first + bucket.shard]

    def _of(self, layers: tuple[int, int] | None) -> list[int]:
        """The buckets holding the parameters of `layers` (None: all)."""
        if layers is None:
            return list(range(len(self.buckets)))
        start, end = layers
        return [i for i, b in enumerate(self.buckets) if b.layers.start < end and start < b.layers.stop]

    def reduce_scatter(self, layers: tuple[int, int] | None = None) -> Pending:
        """Start reducing the gradients of `layers` (None: all) in one collective; once
        finished, this replica's slices hold their mean."""
        return self._reduce(self._of(layers))

    def all_gather(self, layers: tuple[int, int] | None = None) -> Pending:
        """Start gathering every replica's slices of the buckets of `layers` (None: all) in
        one collective; once finished, their parameters hold them."""
        return self._gather(self._of(layers))

    def _reduce(self, chosen: list[int]) -> Pending:
        buckets = [self.buckets[i] for i in chosen]
        if not buckets:  # layers without trained parameters (the checks let no plan name them)
            return Pending(None, lambda: None)
        flat = torch.cat([self._flat(b, [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]) for b in buckets])
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def keep() -> None:
            at = 0
            for i, bucket in zip(chosen, buckets):
                grad = self._slice(bucket, flat[at : at + bucket.shard * self.replicas]).div_(self.replicas)
                decayed, exempt = self.pieces[i]
                decayed.grad, exempt.grad = grad[: decayed.numel()], grad[decayed.numel() :]
                self._grads[i] = grad
                at += bucket.shard * self.replicas

        pending = Pending(work, keep)
        self._reduced.update(dict.fromkeys(chosen, pending))
        return pending

    def _gather(self, chosen: list[int]) -> Pending:
        buckets = [self.buckets[i] for i in chosen]
        if not buckets:
            return Pending(None, lambda: None)
        local = torch.cat([self.master[b.offset : b.offset + b.shard] for b in buckets])
        out = torch.empty(local.numel() * self.replicas, dtype=self.master.dtype, device=self.master.device)
        work = dist.all_gather(list(out.chunk(self.replicas)), local.detach(), group=self.group, async_op=True)

        def copy() -> None:
            per_replica = out.view(self.replicas, -1)  # each replica's slices, bucket after bucket
            at = 0
            with torch.no_grad():
                for bucket in buckets:
                    whole = per_replica[:, at : at + bucket.shard].reshape(-1)[: bucket.size]
                    for param, piece in zip(bucket.params, whole.split([p.numel() for p in bucket.params])):
                        param.copy_(piece.view_as(param))
                    bucket.current = True
                    at += bucket.shard

        return Pending(work, copy)

    def step(self) -> None:
        """AdamW on this replica's shard, from the reduced gradients (the buckets the plan
        did not reduce reduced here in one collective, those it did not wait for waited for)."""
        left = [i for i in range(len(self.buckets)) if i not in self._reduced]
        if left:
            self._reduce(left)
        for pending in self._reduced.values():
            pending.finish()
        self._reduced = {}
        self._global_grad_norm = self._norm()
        if self.max_norm > 0:
            model_norm = over_stages(self._global_grad_norm, self.mpu.pp, self.device)
            clip_to(self.max_norm, model_norm, list(self._grads.values()))
        self._grads = {}
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.zero_grad()
        for bucket in self.buckets:
            bucket.current = False

    def unscale(self, scale: float) -> None:
        """fp16: take the loss scale off the gradients the plan reduced before the executor
        took it off the parameters' (the rest are reduced from those at the step)."""
        for i, pending in self._reduced.items():
            pending.finish()
            self._grads[i].mul_(1.0 / scale)

    def zero_grad(self) -> None:
        """Drop the step's gradients, reduced or not (an fp16 step that overflowed anywhere)."""
        for pending in self._reduced.values():
            pending.finish()
        self._reduced, self._grads = {}, {}
        for pair in self.pieces:
            for piece in pair:
                piece.grad = None
        super().zero_grad()

    def _norm(self) -> float:
        """The reduced gradients' norm over the data-parallel group (each replica its slices)
        and the tensor-parallel one (each parameter counted as optimizer.tp_count says)."""
        views = [self._grads[i][start:end] for i, b in enumerate(self.buckets) for start, end, _ in b.counted]
        counted = [count for b in self.buckets for _, _, count in b.counted]
        total = squared_norm(views, counted) if views else torch.zeros((), dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.group)
        if self.mpu.tp is not None:
            dist.all_reduce(total, group=self.mpu.tp)
        return float(total.sqrt())

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def save_checkpoint(self, directory: str, tag: str, save_latest: bool = False) -> None:
        stale = [i for i, b in enumerate(self.buckets) if not b.current]
        if stale:  # what the next forward would gather: the saved parameters are the updated ones
            self._gather(stale).finish()
        super().save_checkpoint(directory, tag, save_latest)

    def _extra_state(self) -> dict[str, torch.Tensor]:
        return {"master": self.master.detach()}

    def _load_extra_state(self, state: dict) -> None:
        with torch.no_grad():
            self.master.copy_(state["master"])
