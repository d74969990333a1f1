"""Runs one rank's instruction list with real tensors: the very Program the simulator prices.

Every Work boundary is a detach point: a forward Work's inputs become leaves, so its
backward Work runs alone (through the unit's DeepSpeed engine, with the surrogate loss
sum(output · incoming gradient), which gives exact gradients) and leaves the gradient of
its inputs for whoever produced them: the previous local Work, a pipeline peer (Send), or
an upstream unit (CoCa's text decoder hands the image tokens' gradient back to the ViT).

Gradient scale: DeepSpeed averages a unit's gradients over its replicas, so every unit's
backward is run on (its dp) x (its replica's share of the loss); what passes between units
of different dp (DistMM's towers: features, CoCa's image tokens) is rescaled on the way.

Communication: pipeline Send/Recv are real point-to-point transfers; a BatchSync gathers
the features of the contrastive batch with an all-gather that carries gradients (a rank
holding both towers) or exchanges them with the other tower's ranks (DistMM's separate
towers, runtime.exchange); broker Send/Recv carry one tower's tokens to another's
cross-attention (runtime.broker). TP collectives run inside the parallel layers and DP
collectives inside DeepSpeed (ZeRO-0's all-reduce at the optimizer instruction), so the
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
from src.program import BatchSync, Collective, Compute, Instruction, Plan, Recv, Send, Wait, Work
from src.runtime.broker import Broker
from src.runtime.comm import CLOCK, all_reduce
from src.runtime.engines import reduce_gradients
from src.runtime.exchange import Layout, layout, sync_gradients
from src.runtime.gather import gather_with_grad
from src.runtime.groups import ProcessGroups
from src.runtime.placement import placements
from src.runtime.roster import Roster
from src.runtime.timing import StepTimer
from src.strategies.distmm_programs import CrossInput

State = dict[str, torch.Tensor]
# What a Work hands to other instructions besides its token states, by name.
PRODUCTS = ("feature", "tokens")


@dataclass
class _Saved:
    """What a forward Work leaves for its backward."""

    leaves: State
    outputs: State
    x_from_peer: bool
    memory_from: str | None
    memory_link: CrossInput | None  # the memory came from another rank (broker)


@dataclass
class _StepState:
    boundary: dict[tuple, State] = field(default_factory=dict)   # (unit, mb, chunk, layer) -> input of next local Work
    saved: dict[tuple, _Saved] = field(default_factory=dict)
    finals: dict[tuple, State] = field(default_factory=dict)     # (unit, mb) -> the unit's features and tokens
    grads: dict[tuple, torch.Tensor] = field(default_factory=dict)
    cross_grads: dict[tuple, torch.Tensor] = field(default_factory=dict)  # (consumer, mb) -> tokens' gradient
    received: deque = field(default_factory=deque)
    product: torch.Tensor | None = None                           # what the next pipeline Send carries
    last: Compute | None = None                                   # the last compute, which a broker Send follows
    handles: dict[str, Any] = field(default_factory=dict)
    sends: list = field(default_factory=list)
    loss: float = 0.0
    stepped: set = field(default_factory=set)


def towers_of(model: ModelSpec, sync: BatchSync) -> list[str]:
    return [p for p, c in model.flows if c == sync.work.unit]


def links(plan: Plan, model: ModelSpec, rank: int, global_batch: int) -> tuple[Broker | None, dict[str, Layout]]:
    """What ties `rank` to the units on other ranks (separate towers: the broker and the
    row layout of each batch-sync group where it holds one tower only), after checking
    that the executor can run its instruction list. Pure: the backend runs it for every
    class before any worker starts, so a Program it cannot run is refused in one line."""
    instructions = plan.program.instructions_for(rank)
    after_sync = False
    for instruction in instructions:
        if isinstance(instruction, Collective) and instruction.kind not in ("tp", "dp"):
            # The reduce-scatter right after a batch-sync is its gather's backward.
            if not (after_sync and instruction.kind == "interaction"):
                raise ConfigError(f"the real backend cannot run a standalone {instruction.op} of kind "
                                  f"{instruction.kind} on group {instruction.group}: no tensor of the model "
                                  f"travels in it")
        after_sync = isinstance(instruction, BatchSync)
    if not any(u.details.get("placement") == "separate" for u in plan.units):
        return None, {}
    roster, places = Roster(plan), placements(plan, rank)
    layouts: dict[str, Layout] = {}
    for sync in (i for i in instructions if isinstance(i, BatchSync) and i.gather is not None):
        towers = towers_of(model, sync)
        held = [t for t in towers if t in places]
        if len(held) == len(towers) or sync.gather.group in layouts:
            continue
        feature = next(i for i, layer in enumerate(model.unit(held[0]).layers) if layer.name == "projection")
        if feature not in places[held[0]].layers:
            raise ConfigError(f"rank {rank} runs a batch-sync of {held[0]} whose feature (layer {feature}) is "
                              f"computed on another pipeline stage; the real backend carries only token states "
                              f"between stages")
        layouts[sync.gather.group] = layout(plan, model, roster, plan.program.group_for(sync.gather.group, rank),
                                            rank)
    return Broker(plan, model, roster, rank, global_batch), layouts


class Executor:
    def __init__(self, plan: Plan, model: ModelSpec, rank: int, units: torch.nn.ModuleDict,
                 engines: dict[str, Any], groups: ProcessGroups, batch_for: Callable[[str, int], State],
                 global_batch: int) -> None:
        self.plan, self.model, self.rank = plan, model, rank
        self.program = plan.program
        rank_program = self.program.class_of(rank)
        self.instructions: list[Instruction] = rank_program.instructions
        self.pipelined = rank_program.pipelined
        # A loss computed by every rank of the class (each replica's, repeated over TP) is
        # reported as the mean over the class: each rank adds its 1/len share.
        self.share = 1.0 / len(rank_program.ranks)
        self.units, self.engines, self.groups, self.batch_for = units, engines, groups, batch_for
        self.places = placements(plan, rank)
        self.batch_syncs = sum(isinstance(i, BatchSync) for i in self.instructions)
        self.broker, self.layouts = links(plan, model, rank, global_batch)

    def _dp(self, unit: str) -> int:
        return len(self.places[unit].dp_ranks)

    # ---- one step ---------------------------------------------------------------------
    def run_step(self, timer: StepTimer) -> float:
        """Run the instruction list once; returns this rank's share of the step's loss
        (the shares of all ranks add up to it)."""
        self.s = _StepState()
        for index, instruction in enumerate(self.instructions):
            start = time.perf_counter()
            CLOCK.take()
            category = self._run(index, instruction)
            timer.record(instruction, start, time.perf_counter(), category, CLOCK.take())
        pending = self.broker.start_step() if self.broker else []
        for work in self.s.sends + [w for w, _ in pending]:
            work.wait()
        return self.s.loss

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
            self.s.last = instruction
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

    def _inputs(self, compute: Compute) -> tuple[State, bool, str | None, CrossInput | None]:
        """The state a forward Work starts from, whether its x came from a peer, which
        upstream unit's token states it cross-attends to, and over which broker link."""
        work, j = compute.work, compute.microbatch
        state = dict(self.batch_for(work.unit, j))
        memory_from = None
        for producer, consumer in self.model.flows:
            if consumer == work.unit and "tokens" in self.s.finals.get((producer, j), {}):
                state["memory"], memory_from = self.s.finals[(producer, j)]["tokens"], producer
        link = self.broker.consumes(work.unit, work.layers) if self.broker else None
        if link is not None:
            state["memory"], memory_from = self.broker.memory(link, j), link.producer
        if work.layers[0] == 0:
            return state, False, memory_from, link
        local = self.s.boundary.pop((work.unit, j, compute.chunk, work.layers[0]), None)
        if local is not None:
            return {**state, **local}, False, memory_from, link
        if not self.s.received:
            raise ConfigError(f"rank {self.rank}: forward of {work.unit} layers {work.layers} mb {j} has no input")
        return {**state, "x": self.s.received.popleft()}, True, memory_from, link

    def _forward(self, compute: Compute) -> None:
        work, j = compute.work, compute.microbatch
        layers = self.units[work.unit]
        state, from_peer, memory_from, link = self._inputs(compute)
        trains = self.model.needs_backward(work.unit)
        leaves = {k: state[k].detach().requires_grad_(trains) for k in ("x", "memory") if k in state}
        state.update(leaves)
        with torch.set_grad_enabled(trains):
            for i in range(*work.layers):
                state = layers[i](state)
        if "loss" in state:
            self.s.loss += float(state["loss"].detach()) / self._microbatches(work.unit) * self.share
        if trains:
            self.s.saved[(work.unit, j, compute.chunk, work.layers)] = _Saved(leaves, state, from_peer, memory_from,
                                                                               link)
        # A Work's inputs never carry features or tokens: those in its state are its own.
        products = {k: state[k] for k in PRODUCTS if k in state}
        if products:
            self.s.finals.setdefault((work.unit, j), {}).update(products)
        if work.layers[1] < self.model.unit(work.unit).num_layers:
            self.s.boundary[(work.unit, j, compute.chunk, work.layers[1])] = {"x": state["x"]}
            self.s.product = state["x"]

    def _product_grad(self, work: Work, j: int, name: str) -> torch.Tensor | None:
        """The gradient of a feature or tokens this Work produced, at this unit's scale."""
        link = self.broker.produces(work.unit, work.layers) if self.broker and name == "tokens" else None
        if link is not None:
            return self.broker.grad(link, j) * self._dp(work.unit)
        return self.s.grads.pop((work.unit, j, name), None)

    def _backward(self, compute: Compute) -> None:
        work, j = compute.work, compute.microbatch
        saved = self.s.saved.pop((work.unit, j, compute.chunk, work.layers))
        terms = []
        if work.layers[1] < self.model.unit(work.unit).num_layers:
            grad = self.s.grads.pop((work.unit, j, compute.chunk, work.layers[1]), None)
            if grad is None:
                grad = self.s.received.popleft()
            terms.append((saved.outputs["x"] * grad).sum())
        for name in PRODUCTS:
            grad = self._product_grad(work, j, name) if name in saved.outputs else None
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
            if saved.memory_link is not None:  # the loss's own gradient: the producer rescales it
                self.s.cross_grads[(work.unit, j)] = memory.grad / self._dp(work.unit)
            else:
                self.s.grads[(saved.memory_from, j, "tokens")] = memory.grad

    def _optimizer(self, unit: str) -> None:
        engine = self.engines[unit]
        if id(engine) not in self.s.stepped:  # units sharing an engine step once
            self.s.stepped.add(id(engine))
            reduce_gradients(engine)
            engine.step()

    # ---- the interaction ----------------------------------------------------------------
    def _batch_sync(self, sync: BatchSync) -> None:
        if sync.gather is not None and sync.gather.group in self.layouts:
            self._separate_sync(sync)
            return
        towers = towers_of(self.model, sync)
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
        module = self.units[sync.work.unit][0]
        loss = module(local[image], local[text], gathered[image], gathered[text], offset) / local[image].shape[0]
        self.s.loss += float(loss.detach()) / self.batch_syncs * self.share
        self.engines[sync.work.unit].backward(loss / self.batch_syncs, scale_wrt_gas=False)
        for tower in towers:
            if leaves[tower].grad is not None:
                self._scatter(sync, tower, leaves[tower].grad)

    def _separate_sync(self, sync: BatchSync) -> None:
        """One tower's features here, the other's on other ranks (runtime.exchange): the
        interaction's parameters get the gradient of the whole batch-sync on every rank,
        the features that of the whole loss, scaled to the tower's replicas."""
        where = self.layouts[sync.gather.group]
        tower, towers = where.me.tower, towers_of(self.model, sync)
        group = self.groups.get(self.program.group_for(sync.gather.group, self.rank))
        features = torch.cat([self.s.finals[(tower, j)]["feature"] for j in sync.microbatches])
        module = self.units[sync.work.unit][0]
        loss, param_grads, feature_grad = sync_gradients(module, features, tower == towers[0], where, group,
                                                         sync.work.contrastive_batch * self.batch_syncs)
        self.s.loss += loss
        params = [p for p in module.parameters() if p.requires_grad]
        self.engines[sync.work.unit].backward(sum((p * g).sum() for p, g in zip(params, param_grads)),
                                              scale_wrt_gas=False)
        if not self.model.needs_backward(tower):
            return
        place = self.places[tower]
        if place.tp > 1:  # TP peers scored different rows of the same features
            all_reduce(feature_grad, self.groups.get(place.tp_ranks), "tp")
        self._scatter(sync, tower, feature_grad * self._dp(tower))

    def _scatter(self, sync: BatchSync, tower: str, grad: torch.Tensor) -> None:
        sizes = [self.s.finals[(tower, j)]["feature"].shape[0] for j in sync.microbatches]
        for j, part in zip(sync.microbatches, grad.split(sizes)):
            self.s.grads[(tower, j, "feature")] = part

    # ---- point to point -----------------------------------------------------------------
    def _send(self, send: Send) -> None:
        if send.kind == "broker":
            self._broker_send(send)
            return
        if self.s.product is None:
            raise ConfigError(f"rank {self.rank}: Send {send.key} has nothing to send")
        peer = self.program.peer_for(self.rank, send.dst)
        self.s.sends.append(dist.isend(self.s.product.detach().contiguous(), peer))
        self.s.product = None

    def _broker_send(self, send: Send) -> None:
        """After a forward, the tokens it produced; after a backward, its memory's gradient."""
        last = self.s.last
        work = last.work if last is not None else None
        if self.broker is not None and work is not None and work.phase == "fwd":
            link = self.broker.produces(work.unit, work.layers)
            if link is not None:
                self.broker.send_tokens(link, last.microbatch, self.s.finals[(work.unit, last.microbatch)]["tokens"])
                return
        if self.broker is not None and work is not None and work.phase == "bwd":
            link = self.broker.consumes(work.unit, work.layers)
            if link is not None:
                self.broker.send_grad(link, last.microbatch, self.s.cross_grads.pop((work.unit, last.microbatch)))
                return
        raise ConfigError(f"rank {self.rank}: broker Send {send.key} follows no Work that hands anything on")

    def _recv(self, index: int, recv: Recv) -> None:
        if recv.kind == "broker":
            self._broker_recv(index, recv)
            return
        peer = self.program.peer_for(self.rank, recv.src)
        buffer = torch.empty(self._incoming_shape(index, recv))
        if recv.blocking:
            dist.recv(buffer, peer)
        else:
            self.s.handles[recv.handle] = dist.irecv(buffer, peer)
        self.s.received.append(buffer)

    def _broker_recv(self, index: int, recv: Recv) -> None:
        """Receive what the next compute reads from another tower (kept for it)."""
        compute = self._next_compute(index, recv)
        work = compute.work
        consumes = self.broker.consumes(work.unit, work.layers) if self.broker else None
        produces = self.broker.produces(work.unit, work.layers) if self.broker else None
        if work.phase == "fwd" and consumes is not None:
            self.broker.memory(consumes, compute.microbatch)
        elif work.phase == "bwd" and produces is not None:
            self.broker.grad(produces, compute.microbatch)
        else:
            raise ConfigError(f"rank {self.rank}: broker Recv {recv.key} precedes no Work that reads it")

    def _next_compute(self, index: int, recv: Recv) -> Compute:
        for instruction in self.instructions[index + 1:]:
            if isinstance(instruction, Compute):
                return instruction
        raise ConfigError(f"rank {self.rank}: Recv {recv.key} is followed by no compute")

    def _incoming_shape(self, index: int, recv: Recv) -> tuple[int, ...]:
        """A pipeline message is the token states (samples, seq, hidden) at the boundary
        of the next Work of this rank."""
        work = self._next_compute(index, recv).work
        unit = self.model.unit(work.unit)
        return (work.samples, unit.seq_len, unit.hidden)
