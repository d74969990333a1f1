"""Runs one rank's instruction list with real tensors: the very Program the simulator prices.

Every Work boundary is a detach point: a forward Work's inputs become leaves, so its
backward Work runs alone (through the unit's DeepSpeed engine, with the surrogate loss
sum(output · incoming gradient), which gives exact gradients) and leaves the gradient of
its inputs for whoever produced them: the previous local Work, a pipeline peer (Send), or
an upstream unit (CoCa's text decoder hands the image tokens' gradient back to the ViT).

Communication: pipeline Send/Recv are real point-to-point transfers; a BatchSync gathers
the features of the contrastive batch with an all-gather that carries gradients. TP
collectives run inside the parallel layers and DP collectives inside DeepSpeed, so the
Program's tp/dp instructions are markers here (their time is measured where it happens);
a collective of any other kind has no tensor to carry and is refused up front.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from src.errors import ConfigError
from src.models.spec import ModelSpec
from src.program import BatchSync, Collective, Compute, Instruction, Plan, Recv, Send, Wait
from src.runtime.comm import CLOCK
from src.runtime.gather import gather_with_grad
from src.runtime.groups import ProcessGroups
from src.runtime.timing import StepTimer

State = dict[str, torch.Tensor]
# Outputs whose gradient a later instruction supplies, by name.
HANDED_ON = ("x", "feature", "tokens")


@dataclass
class _Saved:
    """What a forward Work leaves for its backward."""

    leaves: State
    outputs: State
    x_from_peer: bool
    memory_from: str | None


@dataclass
class _StepState:
    boundary: dict[tuple, State] = field(default_factory=dict)   # (unit, mb, chunk, layer) -> input of next local Work
    saved: dict[tuple, _Saved] = field(default_factory=dict)
    finals: dict[tuple, State] = field(default_factory=dict)     # (unit, mb) -> the unit's outputs
    grads: dict[tuple, torch.Tensor] = field(default_factory=dict)
    received: deque = field(default_factory=deque)
    product: torch.Tensor | None = None                           # what the next Send carries
    handles: dict[str, Any] = field(default_factory=dict)
    sends: list = field(default_factory=list)
    loss: float = 0.0
    holds_loss: bool = False
    stepped: set = field(default_factory=set)


class Executor:
    def __init__(self, plan: Plan, model: ModelSpec, rank: int, units: torch.nn.ModuleDict,
                 engines: dict[str, Any], groups: ProcessGroups, batch_for: Callable[[str, int], State]) -> None:
        self.plan, self.model, self.rank = plan, model, rank
        self.program = plan.program
        rank_program = self.program.class_of(rank)
        self.instructions: list[Instruction] = rank_program.instructions
        self.pipelined = rank_program.pipelined
        self.units, self.engines, self.groups, self.batch_for = units, engines, groups, batch_for
        self.batch_syncs = sum(isinstance(i, BatchSync) for i in self.instructions)
        self._check()

    def _check(self) -> None:
        after_sync = False
        for instruction in self.instructions:
            if isinstance(instruction, Collective) and instruction.kind not in ("tp", "dp"):
                # The reduce-scatter right after a batch-sync is its gather's backward.
                if not (after_sync and instruction.kind == "interaction"):
                    raise ConfigError(f"the real backend cannot run a standalone {instruction.op} of kind "
                                      f"{instruction.kind} on group {instruction.group}: no tensor of the model "
                                      f"travels in it")
            after_sync = isinstance(instruction, BatchSync)

    # ---- one step ---------------------------------------------------------------------
    def run_step(self, timer: StepTimer) -> tuple[float, bool]:
        """Run the instruction list once; returns (this rank's loss, whether it holds one)."""
        self.s = _StepState()
        for index, instruction in enumerate(self.instructions):
            start = time.perf_counter()
            CLOCK.take()
            category = self._run(index, instruction)
            timer.record(instruction, start, time.perf_counter(), category, CLOCK.take())
        for work in self.s.sends:
            work.wait()
        return self.s.loss, self.s.holds_loss

    def _run(self, index: int, instruction: Instruction) -> str:
        if isinstance(instruction, Compute):
            work = instruction.work
            if work.phase == "fwd":
                self._forward(instruction)
            elif work.phase == "bwd":
                self._backward(instruction)
            elif work.phase == "optimizer":
                self._optimizer(work.unit)
            else:
                raise ConfigError(f"the real backend does not run {work.phase} Work yet ({work.unit})")
            return "compute"
        if isinstance(instruction, BatchSync):
            self._batch_sync(instruction)
            return "compute"
        if isinstance(instruction, Send):
            self._send(instruction)
            return f"comm_{instruction.kind}"
        if isinstance(instruction, Recv):
            self._recv(index, instruction)
            return "wait"
        if isinstance(instruction, Wait):
            self.s.handles.pop(instruction.handle).wait()
            return "wait"
        return "marker"  # tp/dp collectives: done inside the layers and DeepSpeed

    # ---- forward and backward -----------------------------------------------------------
    def _microbatches(self, unit: str) -> int:
        return self.plan.unit(unit).num_microbatches

    def _inputs(self, compute: Compute) -> tuple[State, bool, str | None]:
        """The state a forward Work starts from, whether its x came from a peer, and which
        upstream unit's token states it cross-attends to."""
        work, j = compute.work, compute.microbatch
        state = dict(self.batch_for(work.unit, j))
        memory_from = None
        for producer, consumer in self.model.flows:
            if consumer == work.unit and "tokens" in self.s.finals.get((producer, j), {}):
                state["memory"], memory_from = self.s.finals[(producer, j)]["tokens"], producer
        if work.layers[0] == 0:
            return state, False, memory_from
        local = self.s.boundary.pop((work.unit, j, compute.chunk, work.layers[0]), None)
        if local is not None:
            return {**state, **local}, False, memory_from
        if not self.s.received:
            raise ConfigError(f"rank {self.rank}: forward of {work.unit} layers {work.layers} mb {j} has no input")
        return {**state, "x": self.s.received.popleft()}, True, memory_from

    def _forward(self, compute: Compute) -> None:
        work, j = compute.work, compute.microbatch
        layers = self.units[work.unit]
        state, from_peer, memory_from = self._inputs(compute)
        trains = self.model.needs_backward(work.unit)
        leaves = {k: state[k].detach().requires_grad_(trains) for k in ("x", "memory") if k in state}
        state.update(leaves)
        with torch.set_grad_enabled(trains):
            for i in range(*work.layers):
                state = layers[i](state)
        if "loss" in state:
            self.s.loss += float(state["loss"].detach()) / self._microbatches(work.unit)
            self.s.holds_loss = True
        if trains:
            self.s.saved[(work.unit, j, compute.chunk, work.layers)] = _Saved(leaves, state, from_peer, memory_from)
        if work.layers[1] == self.model.unit(work.unit).num_layers:
            self.s.finals[(work.unit, j)] = state
        else:
            self.s.boundary[(work.unit, j, compute.chunk, work.layers[1])] = {"x": state["x"]}
            self.s.product = state["x"]

    def _backward(self, compute: Compute) -> None:
        work, j = compute.work, compute.microbatch
        saved = self.s.saved.pop((work.unit, j, compute.chunk, work.layers))
        end = work.layers[1]
        terms = []
        if end < self.model.unit(work.unit).num_layers:
            grad = self.s.grads.pop((work.unit, j, compute.chunk, end), None)
            if grad is None:
                grad = self.s.received.popleft()
            terms.append((saved.outputs["x"] * grad).sum())
        else:
            for name in ("feature", "tokens"):
                grad = self.s.grads.pop((work.unit, j, name), None)
                if grad is not None:
                    terms.append((saved.outputs[name] * grad).sum())
            if "loss" in saved.outputs:
                terms.append(saved.outputs["loss"] / self._microbatches(work.unit))
        self.engines[work.unit].backward(sum(terms), scale_wrt_gas=False)
        x = saved.leaves.get("x")
        if x is not None and x.grad is not None:
            if saved.x_from_peer:
                self.s.product = x.grad
            else:
                self.s.grads[(work.unit, j, compute.chunk, work.layers[0])] = x.grad
        memory = saved.leaves.get("memory")
        if memory is not None and memory.grad is not None and self.model.needs_backward(saved.memory_from):
            self.s.grads[(saved.memory_from, j, "tokens")] = memory.grad

    def _optimizer(self, unit: str) -> None:
        engine = self.engines[unit]
        if id(engine) not in self.s.stepped:  # units sharing an engine step once
            self.s.stepped.add(id(engine))
            engine.step()

    # ---- the interaction ----------------------------------------------------------------
    def _batch_sync(self, sync: BatchSync) -> None:
        towers = [p for p, c in self.model.flows if c == sync.work.unit]
        local: dict[str, torch.Tensor] = {}
        leaves: dict[str, torch.Tensor] = {}
        for tower in towers:
            features = torch.cat([self.s.finals[(tower, j)]["feature"] for j in sync.microbatches])
            leaves[tower] = features.detach().requires_grad_(self.model.needs_backward(tower))
            local[tower] = leaves[tower]
        gathered, offset = dict(local), 0
        if sync.gather is not None:
            ranks = self.program.group_for(sync.gather.group, self.rank)
            group = self.groups.get(ranks)
            for tower in towers:
                gathered[tower] = gather_with_grad(local[tower], group, len(ranks))
            offset = ranks.index(self.rank) * local[towers[0]].shape[0]
        image, text = towers  # the contrastive pair, in model order (vision, text)
        loss = self.units[sync.work.unit][0](local[image], local[text], gathered[image], gathered[text], offset)
        self.s.loss += float(loss.detach()) / self.batch_syncs
        self.s.holds_loss = True
        self.engines[sync.work.unit].backward(loss / self.batch_syncs, scale_wrt_gas=False)
        for tower in towers:
            if leaves[tower].grad is not None:
                sizes = [self.s.finals[(tower, j)]["feature"].shape[0] for j in sync.microbatches]
                for j, grad in zip(sync.microbatches, leaves[tower].grad.split(sizes)):
                    self.s.grads[(tower, j, "feature")] = grad

    # ---- point to point -----------------------------------------------------------------
    def _send(self, send: Send) -> None:
        if self.s.product is None:
            raise ConfigError(f"rank {self.rank}: Send {send.key} has nothing to send")
        peer = self.program.peer_for(self.rank, send.dst)
        self.s.sends.append(dist.isend(self.s.product.detach().contiguous(), peer))
        self.s.product = None

    def _recv(self, index: int, recv: Recv) -> None:
        peer = self.program.peer_for(self.rank, recv.src)
        buffer = torch.empty(self._incoming_shape(index, recv))
        if recv.blocking:
            dist.recv(buffer, peer)
        else:
            self.s.handles[recv.handle] = dist.irecv(buffer, peer)
        self.s.received.append(buffer)

    def _incoming_shape(self, index: int, recv: Recv) -> tuple[int, ...]:
        """A pipeline message is the token states (samples, seq, hidden) at the boundary
        of the next Work of this rank."""
        for instruction in self.instructions[index + 1:]:
            if isinstance(instruction, Compute):
                unit = self.model.unit(instruction.work.unit)
                return (instruction.work.samples, unit.seq_len, unit.hidden)
        raise ConfigError(f"rank {self.rank}: Recv {recv.key} is followed by no compute")
