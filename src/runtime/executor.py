"""Runs one rank's instruction list with real tensors: the very Program the simulator prices.

Data flow is what the instructions name. A Compute reads its input payloads from the
rank's store and writes its outputs there; a Send sends the rows of a payload that the
route's table gives this rank, a Recv puts the rows it receives into its payload (summing
a gradient's rows that arrive twice); a Collective that carries payloads moves them (the
features of a contrastive batch gathered over replicas, or exchanged by rows between
the scorers of separate towers (runtime.batch_rows), a tensor shared over TP peers).
Collectives without payloads are a layer's own (TP, inside the parallel layers) or the
optimizer's (DP, inside DeepSpeed): their time is measured where they happen. Asynchronous
ones (ZeRO-3's prefetches and overlapped reduce-scatters) and their waits are DeepSpeed's
too: the plan's overlap_comm configures its engine to issue and wait for them. A DP
reduction that names its layers' gradients (`grads_of`) is the executor's own
(runtime.grad_reduce), and the unit's engine leaves them alone.

Every Compute is a detach point: a forward's inputs become leaves, so its backward runs
alone, from the forward's outputs seeded with their incoming gradients (the exact
gradients of the surrogate loss sum(output · incoming gradient)), and writes the
gradients of its inputs for whoever produced them.

Gradient scale: a gradient payload is always the gradient of the step's whole loss.
DeepSpeed averages a unit's parameter gradients over its data-parallel replicas, so a
unit's backward runs on (its dp) x (its part of the loss), and the input gradients it
writes are divided by its dp again; units of different dp then meet without rescaling.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from src.data.balance import dealt_images
from src.data.interleaved_mllm import dealt_slots, slot_token_mask, token_mask
from src.errors import ConfigError
from src.models.flows import chain_key
from src.mesh import ROWS
from src.models.spec import ModelSpec, UnitSpec
from src.program import Collective, Compute, Hop, Instruction, Message, Payload, Plan, Recv, Route, Send, Wait
from src.runtime.batch_rows import exchange_rows, placed_by_rows
from src.runtime.comm import BINS, CLOCK, all_reduce
from src.runtime.device import DTYPES, computing, synchronize
from src.runtime.engines import backward, point_reduction_at
from src.runtime.dist_optimizer import DistributedOptimizer, Pending
from src.runtime.own_engine import OwnEngine
from src.runtime.grad_reduce import GradBucket, start_reduction
from src.runtime.groups import ProcessGroups
from src.runtime.lifeline import LIFELINE
from src.runtime.loss_scale import LossScale, unscale_and_check
from src.runtime.modules.generator import handed_on
from src.runtime.modules.grid3d import ZSharded
from src.runtime.modules.parallel import tp_overlap
from src.runtime.modules.units import unit_layers
from src.runtime.placement import placements, tensor_replicas
from src.runtime.row_shares import Share
from src.runtime.store import PayloadStore, row_shape
from src.runtime.timing import StepTimer
from src.runtime.tp_bins import Binned, find_bins

State = dict[str, torch.Tensor]
BWD_INPUT, BWD_WEIGHT = "bwd_input", "bwd_weight"  # a backward split into its input- and weight-gradient GEMMs (a tensor grid's)


@dataclass
class _Saved:
    """What a forward leaves for its backward; `carried`: the leaves of the state a U-Net
    handed it from its layers before (_carried)."""

    leaves: dict[Payload, torch.Tensor]
    outputs: State
    carried: State = field(default_factory=dict)


@dataclass
class _StepState:
    store: PayloadStore = field(default_factory=PayloadStore)
    saved: dict[tuple, _Saved] = field(default_factory=dict)
    local: dict[tuple[str, Payload], list] = field(default_factory=dict)  # local messages, by route and payload
    pending: dict[str, tuple[str, list]] = field(default_factory=dict)  # handle -> (kind, posted receives)
    sends: list = field(default_factory=list)
    # A scattered transfer's flat chunk of a payload (_flat_part), held until the TP all-gather rebuilds it:
    # (the chunk, the whole payload's shape on the wire, the mask it was packed by).
    flat_parts: dict[Payload, tuple[torch.Tensor, tuple[int, ...], torch.Tensor | None]] = field(default_factory=dict)
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    stepped: set = field(default_factory=set)
    micro_steps: dict[int, list[int]] = field(default_factory=dict)  # engine -> its micro-batches in backward order
    markers: dict[str, str] = field(default_factory=dict)  # handle -> op of an asynchronous collective a layer or DeepSpeed runs
    reductions: dict[str, GradBucket | Pending] = field(default_factory=dict)  # handle -> DP collective in flight
    skip: bool | None = None  # fp16: whether the step overflowed (None: not decided yet)
    chunked: dict[tuple, list[Compute]] = field(default_factory=dict)  # a chunked pass -> its chunks so far
    ranged: dict[tuple, list[Compute]] = field(default_factory=dict)  # a layer pass in kernel ranges -> its ranges so far
    carried: dict[tuple, State] = field(default_factory=dict)  # (unit, micro-batch, chunk) -> what a U-Net pass hands the next
    carried_grads: dict[tuple, State] = field(default_factory=dict)  # their gradients, handed back the other way


def _marker() -> str:
    """An instruction whose work happens elsewhere: timed there, not here."""
    return "marker"


def _carried(state: State, grad: bool) -> State:
    """What a U-Net's layers hand on besides 'x' (generator.handed_on), as leaves of the next
    piece of a pass run in pieces (Computes a plan cuts it into, parts a backward cuts)."""
    return {key: value.detach().requires_grad_(grad) for key, value in handed_on(state).items()}


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    """A saved tensor kept as it is (autograd's own saving)."""
    return tensor


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    """A leaf's gradient: zero where its layers do not read it (a U-Net's VAE starts from
    the target image, not from the 'x' handed to its first layer)."""
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def _packed(rows: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """An encoder's hand-on under interleaved data travels as its real images' tokens only
    (`tokens`: each row's image-token positions, or which rows travel whole; None: the rows
    as they are)."""
    return rows if tokens is None else rows.reshape(tokens.shape + (-1,))[tokens]


def _unpacked(images: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """The rows back from their real images' tokens (or the rows that travelled), the other
    positions zero."""
    return images if tokens is None else images.new_zeros(tokens.shape + images.shape[1:]).index_put_((tokens,), images).flatten(1)


def input_key(work_unit: str, payload: Payload) -> str:
    """The module-state key a Compute's input payload binds to: the unit's own token
    states enter as 'x'; another unit's tokens are the cross-attention 'memory', its
    output 'x' enters under its producer's name (flows.chain_key)."""
    if payload.unit == work_unit and payload.tensor == "x":
        return "x"
    if payload.unit != work_unit and payload.tensor == "tokens":
        return "memory"
    if payload.unit != work_unit and payload.tensor == "x":
        return chain_key(payload.unit)  # a chain: the upstream unit's output is this unit's input (an MLLM's encoder to its LLM)
    raise ConfigError(f"the real backend has no module input for {payload} in a Work of unit {work_unit}")


class Executor:
    def __init__(
        self,
        plan: Plan,
        model: ModelSpec,
        rank: int,
        units: torch.nn.ModuleDict,
        engines: dict[str, Any],
        groups: ProcessGroups,
        batch_for: Callable[[str, int], State],
        device: torch.device,
        precision: str,
        loss_scale: LossScale | None = None,
        dealing: Mapping[str, int] | None = None,
    ) -> None:
        self.plan, self.model, self.rank, self.device = plan, model, rank, device
        self.precision, self.dtype = precision, DTYPES[precision]
        self.loss_scale = (loss_scale or LossScale(1.0)) if precision == "fp16" else None
        self.program = plan.program
        rank_program = self.program.class_of(rank)
        self.instructions: list[Instruction] = rank_program.instructions
        self.units, self.engines, self.groups, self.batch_for = units, engines, groups, batch_for
        # The units that deal each micro-batch's images out over their row shares (on interleaved
        # data: runtime.row_shares), and their shares.
        self.dealing = dict(dealing or {})
        self.places = placements(plan, rank)
        self.row_routes: dict[str, bool] = {}  # whether a route carries a replicated unit's shares of rows
        self.grids = list({id(m.grid): m.grid for m in units.modules() if isinstance(m, ZSharded)}.values())
        # Layers where a backward starts: a forward is cut there too, so a backward that runs
        # part of a forward's layers (overlap_grad_reduce's last micro-batch, layer by layer)
        # finds what its own part saved.
        self.cuts: dict[tuple[str, int, int], set[int]] = {}
        for instruction in self.instructions:
            if isinstance(instruction, Compute) and instruction.work.phase in ("bwd", BWD_INPUT):
                key = (instruction.work.unit, instruction.microbatch, instruction.chunk)
                self.cuts.setdefault(key, set()).add(instruction.work.layers[0])
        # Plan and model lookups a step repeats (each a search of their units).
        self.unit_plan = functools.cache(plan.unit)
        self.needs_backward = functools.cache(model.needs_backward)
        self.replicas = functools.cache(functools.partial(tensor_replicas, plan))
        self.runners = [self._runner(instruction) for instruction in self.instructions]
        # Passes with work in their TP bins, and how many TP collectives each pass issues.
        self.binned = find_bins(self.instructions)
        self.tp_collectives: dict[tuple[str, str, tuple[int, int]], int] = {}

    def _dp(self, unit: str) -> int:
        return self.places[unit].dp

    def _own_rows(self, unit: str, payload: Payload, tensor: torch.Tensor) -> Payload:
        """A payload a unit's pass makes, at the rows of the micro-batch this rank runs (a
        unit replicated over its TP group runs a share of them, or of their images, which it
        holds at their places in the whole micro-batch: runtime.row_shares)."""
        rows = self.places[unit].rows
        if unit in self.dealing or rows is None:
            return payload
        return payload.part(rows.start, rows.start + tensor.shape[0])

    def _own_input(self, unit: str, payload: Payload) -> Payload:
        """What a unit's pass reads of an input payload: a unit replicated over its TP group
        that shares the micro-batch's rows (not its images) reads its share's rows, where
        a scattered transfer delivered just those and where a broker's hand-off between
        units gave its group the whole micro-batch (DistTrain's)."""
        rows = self.places[unit].rows
        if rows is None or unit in self.dealing or payload.rows is not None:
            return payload
        return payload.part(rows.start, rows.stop)

    def _row_shape(self, payload: Payload) -> tuple[int, ...]:
        if payload.unit == self.model.interaction:
            return row_shape(self.model, payload)
        unit = self.unit_plan(payload.unit)
        return row_shape(self.model, payload, unit.mesh.degree("tp") if unit.sequence_parallel else 1)

    # ---- one step ---------------------------------------------------------------------
    def run_step(self, timer: StepTimer) -> float:
        """Run the instruction list once; returns this rank's share of the step's loss
        (the shares of all ranks add up to it)."""
        self.s = _StepState(loss=torch.zeros((), dtype=torch.float64, device=self.device))
        # Communication is timed inside instructions only: what each one took is taken
        # after it, and this drops what came before the step.
        CLOCK.take()
        at = LIFELINE.at_instruction  # where this rank is, for the driver to name if it stops
        index = 0
        while index < len(self.runners):
            if index in self.binned:
                index = self._run_binned(self.binned[index], timer)
                continue
            at(index)
            start = time.perf_counter()
            category = self.runners[index]()
            synchronize(self.device)
            timer.record(start, time.perf_counter(), category, CLOCK.take())
            index += 1
        LIFELINE.after_instructions()
        for work, _ in self.s.sends:
            work.wait()
        if self.loss_scale is not None and self.s.skip is None:  # a rank that steps no optimizer still agrees
            self._overflowed()
        return float(self.s.loss)

    def _run_binned(self, binned: Binned, timer: StepTimer) -> int:
        """A pass with work in its TP bins (runtime.tp_bins): the work runs, each instruction
        timed as its own, while the pass's last TP collective travels (runtime.comm.BINS);
        the pass's first run learns how many it issues and runs the work after it. The
        pass's span ends where its bins begin; the rest of the pass (that collective's wait
        and what follows it) is its first wait's. Returns the position after its waits."""
        compute = self.instructions[binned.compute]
        assert isinstance(compute, Compute), "a binned pass is a Compute"
        key = (compute.work.unit, compute.work.phase, compute.work.layers)
        at = LIFELINE.at_instruction
        start = time.perf_counter()
        resumed: list[float] = []

        def bins() -> None:
            synchronize(self.device)
            now = time.perf_counter()
            timer.record(start, now, "compute", CLOCK.take())
            for index in binned.markers:
                at(index)
                timer.record(now, now, self.runners[index](), {})
            # As between instructions: inside the pass's layer (an autograd Function's forward
            # or backward, under its autocast) gradients are off and casts on, and under full
            # recomputation its checkpoint would take the work's saved tensors for its own.
            with torch.enable_grad(), torch.autocast(self.device.type, enabled=False), saved_tensors_hooks(_as_is, _as_is):
                for index in binned.work:
                    at(index)
                    begin = time.perf_counter()
                    category = self.runners[index]()
                    synchronize(self.device)
                    timer.record(begin, time.perf_counter(), category, CLOCK.take())
            resumed.append(time.perf_counter())

        at(binned.compute)
        with BINS.armed(self.tp_collectives.get(key, 0) - 1, bins) as armed:
            self.runners[binned.compute]()
        self.tp_collectives[key] = armed.count
        if not resumed:
            bins()
        synchronize(self.device)
        end = time.perf_counter()
        for n, index in enumerate(binned.waits):
            at(index)
            category = self.runners[index]()
            timer.record(resumed[0] if n == 0 else end, end, "compute" if n == 0 else category, CLOCK.take() if n == 0 else {})
        return binned.waits.stop

    def _runner(self, instruction: Instruction) -> Callable[[], str]:
        """What runs `instruction` in a step and returns its timing category. Decided once
        here: the walk between two instructions runs cold after their work, so what a step
        repeats (the instruction's kind, its route, its messages) is not worked out again."""
        if isinstance(instruction, Compute):
            if instruction.work.phase == BWD_WEIGHT:
                return _marker  # its layer's backward pass (at the layer's bwd_input) computes the weight gradients too
            return functools.partial(self._compute, instruction)
        if isinstance(instruction, Collective):
            if instruction.grads_of is not None:
                return functools.partial(self._reduce_grads, instruction)
            if not (instruction.inputs or instruction.outputs):
                # A layer's (tp) or the optimizer's (dp) own: measured where it happens.
                return _marker if instruction.handle is None else functools.partial(self._mark, instruction.handle, instruction.op)
            return functools.partial(self._collective, instruction, f"comm_{instruction.kind}")
        if isinstance(instruction, Send):
            route = self.program.route(instruction.route)
            messages = route.sends(self.rank, instruction.payload)
            return functools.partial(self._send, instruction, route, messages, f"comm_{route.kind}")
        if isinstance(instruction, Recv):
            route = self.program.route(instruction.route)
            messages = route.receives(self.rank, instruction.payload)
            return functools.partial(self._recv, instruction, route, messages, f"wait:{route.kind}")
        if isinstance(instruction, Wait):
            return functools.partial(self._wait, instruction.handle)
        raise ConfigError(f"the real backend cannot run {instruction!r}")

    def _compute(self, instruction: Compute) -> str:
        if instruction.work.kernels is not None:
            ranged = self._kernel_pass(instruction)
            if ranged is None:
                return "marker"
            instruction = ranged
        phase = "bwd" if instruction.work.phase == BWD_INPUT else instruction.work.phase
        if instruction.work.chunks > 1:
            whole = self._whole_pass(instruction)
            if whole is None:
                return "marker"
            instruction = whole
        if phase == "fwd":
            with tp_overlap(instruction.work.chunks):
                self._forward(instruction)
        elif phase == "bwd":
            with tp_overlap(instruction.work.chunks):
                self._backward(instruction)
        elif phase == "interaction":
            self._interaction(instruction)
        elif phase == "optimizer":
            self._optimizer(instruction.work.unit)
        else:
            raise ConfigError(f"the real backend does not run {phase} Work ({instruction.work.unit})")
        return "compute"

    def _mark(self, handle: str, op: str) -> str:
        """An asynchronous collective a layer or DeepSpeed runs: its Wait finishes what it left."""
        self.s.markers[handle] = op
        return "marker"

    def _wait(self, handle: str) -> str:
        if handle in self.s.markers:
            if self.s.markers.pop(handle) == "reduce_scatter":
                for grid in self.grids:  # a tensor grid's weight-gradient reduce-scatters left in flight (overlap B)
                    grid.finish_pending()
            return "marker"
        if handle in self.s.reductions:
            self.s.reductions.pop(handle).finish()
            return "comm_dp"
        kind, posted = self.s.pending.pop(handle)
        self._finish_receives(posted)
        return f"wait:{kind}"

    def _kernel_pass(self, compute: Compute) -> Compute | None:
        """A layer's pass the plan splits into kernel ranges (a tensor grid's: one per FC, its
        collectives between them) runs once its ranges cover the layer's kernels: at its
        last range, with the inputs and outputs that all its ranges name. The layer's own
        collectives run inside it, where its modules issue them."""
        work = compute.work
        phase = "bwd" if work.phase == BWD_INPUT else work.phase
        key = (work.unit, phase, work.layers, compute.microbatch, compute.chunk)
        parts = self.s.ranged.setdefault(key, [])
        parts.append(compute)
        kernels = len(self.model.unit(work.unit).layers[work.layers[0]].kernels)
        if sum(c.work.kernels[1] - c.work.kernels[0] for c in parts if c.work.kernels is not None) < kernels:
            return None
        del self.s.ranged[key]  # a later pass of the same layer (a recomputed forward) starts afresh
        return replace(
            compute,
            work=replace(work, kernels=None),
            inputs=tuple(p for c in parts for p in c.inputs),
            outputs=tuple(p for c in parts for p in c.outputs),
        )

    def _whole_pass(self, compute: Compute) -> Compute | None:
        """A pass the plan runs as n row chunks, each chunk's TP collectives overlapped with
        the next chunk's GEMMs (StepCCL), its inputs at the first chunk and its outputs at
        the last: its layers run once, at the last chunk, with every TP layer cutting its
        GEMM in n row chunks and all-reducing each as it is done (runtime.modules.parallel).
        The earlier chunks' instructions (and the collectives between) are that run's."""
        key = (compute.work.unit, compute.work.phase, compute.work.layers, compute.microbatch, compute.chunk)
        first = self.s.chunked.setdefault(key, [])
        first.append(compute)
        if len(first) < compute.work.chunks:
            return None
        del self.s.chunked[key]  # a later pass of the same key (a recomputed forward) starts afresh
        return replace(compute, inputs=first[0].inputs)

    # ---- forward and backward -----------------------------------------------------------
    def _forward(self, compute: Compute) -> None:
        work, j = compute.work, compute.microbatch
        state = dict(self.batch_for(work.unit, j))
        leaves = {}
        for payload in compute.inputs:
            leaf = self.s.store.tensor(self._own_input(work.unit, payload)).detach().requires_grad_(self.needs_backward(payload.unit))
            leaves[payload] = leaf
            state[input_key(work.unit, payload)] = leaf
        trains = self.needs_backward(work.unit)
        piece = (work.unit, j, compute.chunk)
        carried = _carried(self.s.carried.pop(piece, {}), trains)
        state.update(carried)
        layers = unit_layers(self.units, work.unit)
        specs = self.model.unit(work.unit).layers
        # Full recomputation keeps each block's input only and re-runs the block in backward
        # (LayerSpec.block); the layers around the blocks keep their activations.
        full = trains and self.unit_plan(work.unit).recompute == "full"
        cuts = self.cuts.get((work.unit, j, compute.chunk), set()) if trains else set()
        start = work.layers[0]
        with torch.set_grad_enabled(trains), computing(self.device, self.precision):
            for i in range(*work.layers):
                if i in cuts and i != start:
                    # The part's token states (and what a U-Net carries) become the next
                    # part's leaves. Other leaves (a cross-attention memory) stay shared: the
                    # parts' backwards, last part first, add up their gradients before the
                    # first part hands them on.
                    self.s.saved[(work.unit, (start, i), j, compute.chunk)] = _Saved(leaves, state, carried)
                    x = state["x"].detach().requires_grad_()
                    carried = _carried(state, True)
                    leaves, state, start = {Payload(work.unit, i, j): x}, {**state, **carried, "x": x}, i
                state = checkpoint(layers[i], state, use_reentrant=False) if full and specs[i].block else layers[i](state)
        if "loss" in state:
            # This micro-batch's part of the step's loss: the mean over its replica's
            # micro-batches and over the replicas.
            share = state["loss"].float() / (self.unit_plan(work.unit).num_microbatches * self._dp(work.unit))
            state["loss_share"] = share
            self.s.loss += share.detach() / self.replicas(work.unit)
        for payload in compute.outputs:
            if payload.tensor not in state:
                raise KeyError(f"{work.unit} layers {work.layers} hand on no {payload.tensor!r} ({sorted(state)})")
            self.s.store.put(self._own_rows(work.unit, payload, state[payload.tensor]), state[payload.tensor])
        if handed := handed_on(state):
            self.s.carried[piece] = handed
        if trains:
            self.s.saved[(work.unit, (start, work.layers[1]), j, compute.chunk)] = _Saved(leaves, state, carried)

    def _backward(self, compute: Compute) -> None:
        work, j = compute.work, compute.microbatch
        if (work.unit, work.layers, j, compute.chunk) not in self.s.saved:
            for part in self._forward_parts(compute):
                self._backward(part)
            return
        saved = self.s.saved.pop((work.unit, work.layers, j, compute.chunk))
        piece = (work.unit, j, compute.chunk)
        # The backward starts from what the forward handed on, seeded with the incoming
        # gradients, and from this rank's share of the loss where the pass ends in it.
        starts = [(saved.outputs[grad.tensor], self.s.store.tensor(self._own_input(work.unit, grad))) for grad in compute.inputs]
        starts += [(saved.outputs[key], seed) for key, seed in self.s.carried_grads.pop(piece, {}).items()]
        if "loss_share" in saved.outputs:
            share = saved.outputs["loss_share"]
            starts.append((share, self._loss_seed(share)))
        # A stage of frozen layers that no trained layer or input gradient depends on (a
        # frozen ViT's stage under its trained projector's) has no backward: the cost model
        # prices it at 0. Autograd refuses to start from an output no gradient reaches.
        trained = [(end, seed) for end, seed in starts if end.requires_grad]
        if trained:
            self._backpropagate(work.unit, [end for end, _ in trained], [seed for _, seed in trained], j)
        for grad in compute.outputs:
            leaf = saved.leaves[grad.value()]
            self.s.store.put(self._own_rows(work.unit, grad, leaf), _grad(leaf) / self._dp(work.unit))
        grads = {key: leaf.grad / self._dp(work.unit) for key, leaf in saved.carried.items() if leaf.grad is not None}
        if grads:
            self.s.carried_grads[piece] = grads

    def _forward_parts(self, compute: Compute) -> list[Compute]:
        """A backward over the layers of several forwards (a micro-batch's encoder
        layers run forward one by one in the LLM's bubbles and backward as one stage pass)
        runs as their backwards, last first, each handing its input gradient to the one
        before through the store."""
        work, j = compute.work, compute.microbatch
        start, end = work.layers
        bounds = sorted(layers[0] for unit, layers, mb, chunk in self.s.saved if (unit, mb, chunk) == (work.unit, j, compute.chunk))
        bounds = [b for b in bounds if start <= b < end] + [end]
        if bounds[0] != start:
            raise ConfigError(f"rank {self.rank}: backward of {work.unit} layers {work.layers} (micro-batch {j}) has no forward")
        parts = []
        for a, b in reversed(list(zip(bounds, bounds[1:]))):
            inputs = compute.inputs if b == end else (Payload(work.unit, b, j).gradient(),)
            outputs = compute.outputs if a == start else (Payload(work.unit, a, j).gradient(),)
            parts.append(replace(compute, work=replace(work, layers=(a, b)), inputs=inputs, outputs=outputs))
        return parts

    def _backpropagate(self, unit: str, ends: list[torch.Tensor], seeds: list[torch.Tensor], microbatch: int) -> None:
        """Gradients of sum(end . seed) (this rank's part of the step's loss) into the
        unit's parameters, at DeepSpeed's scale, and into the leaves."""
        dp = self._dp(unit)
        if dp != 1:
            seeds = [seed * dp for seed in seeds]
        engine = self.engines.get(unit)
        if engine is None or isinstance(engine, OwnEngine):  # which reduces its own gradients
            torch.autograd.backward(ends, seeds)
            return
        seen = self.s.micro_steps.setdefault(id(engine), [])
        if microbatch not in seen:
            seen.append(microbatch)
        backward(engine, ends, seeds, seen.index(microbatch))

    def _optimizer(self, unit: str) -> None:
        engine = self.engines[unit]
        if id(engine) in self.s.stepped:  # units sharing an engine step once
            return
        self.s.stepped.add(id(engine))
        if self.loss_scale is not None and (self._overflowed() if self.s.skip is None else self.s.skip):
            engine.zero_grad()
            return
        point_reduction_at(engine)
        engine.step()

    def _loss_seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a backward starts `loss` from: fp16's loss scale, else 1."""
        return torch.full_like(loss, self.loss_scale.scale if self.loss_scale is not None else 1.0)

    def _overflowed(self) -> bool:
        """fp16: whether any rank's gradients overflowed this step (every rank asks once,
        before its first optimizer step or at the end of its step). This rank's gradients are
        unscaled in the same pass (ZeRO-0 reduces them in the step: linear in them), and those
        the plan's distributed optimizer reduced before; a step that overflowed on any rank
        drops them."""
        assert self.loss_scale is not None, "only fp16 scales its loss"
        params = [p for p in self.units.parameters() if p.requires_grad]
        flag = unscale_and_check(params, self.loss_scale.scale, self.device)
        for engine in {id(e): e for e in self.engines.values()}.values():
            if isinstance(engine, DistributedOptimizer):  # what its plan reduced before
                engine.unscale(self.loss_scale.scale)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.s.skip = bool(flag.item())
        self.loss_scale.update(self.s.skip)
        return self.s.skip

    # ---- the interaction -----------------------------------------------------------------
    def _interaction(self, compute: Compute) -> None:
        """Score the query rows this rank holds against the other modality's batch: the
        loss's part is the rows' summed cross-entropy over the step's rows of all
        contrastive batches."""
        work = compute.work
        towers = [p for p, c in self.model.flows if c == work.unit]
        queries: dict[str, tuple[int, torch.Tensor]] = {}
        keys: dict[str, torch.Tensor] = {}
        leaves = {}
        for payload in compute.inputs:
            tower, role = payload.tensor.rsplit(".", 1)
            start, tensor = self.s.store.read(payload)
            leaf = tensor.detach().requires_grad_(self.needs_backward(tower))
            leaves[payload] = leaf
            if role == "q":
                queries[tower] = (start, leaf)
            else:
                if leaf.shape[0] != work.contrastive_batch:
                    raise ConfigError(
                        f"rank {self.rank}: {payload} holds {leaf.shape[0]} rows, not the contrastive "
                        f"batch of {work.contrastive_batch}"
                    )
                keys[tower] = leaf
        image, text = towers  # the contrastive pair, in model order (vision, text)
        module = unit_layers(self.units, work.unit)[0]
        batches = self.unit_plan(work.unit).num_microbatches
        with computing(self.device, self.precision):
            loss = module(queries.get(image), queries.get(text), keys.get(image), keys.get(text))
        share = loss.float() / (work.contrastive_batch * batches)
        self.s.loss += share.detach() / self.replicas(work.unit)
        self._backpropagate(work.unit, [share], [self._loss_seed(share)], compute.microbatch)
        for grad in compute.outputs:
            leaf = leaves[next(p for p in leaves if p.tensor == grad.tensor)]
            start = self.s.store.read(grad.value())[0]
            self.s.store.put(grad.part(start, start + leaf.shape[0]), _grad(leaf) / self._dp(work.unit))

    # ---- collectives ----------------------------------------------------------------------
    def _reduce_grads(self, collective: Collective) -> str:
        """A DP collective of the parameters or gradients of the layers it names, now or
        (asynchronous) until its Wait: their gradients' all-reduce (Megatron-LM's overlapped
        buckets), or the unit's distributed optimizer's reduce-scatter or all-gather."""
        assert collective.grads_of is not None, "a gradient reduction names its layers"
        unit, (start, end) = collective.grads_of
        pending: GradBucket | Pending
        engine = self.engines.get(unit)
        if collective.op == "all_reduce" and not isinstance(engine, DistributedOptimizer):
            ranks = self.program.group_for(collective.group, self.rank)
            # The range's layers this rank holds (a virtual pipeline stage holds every pp-th range).
            layers = [layer for layer in unit_layers(self.units, unit)[start:end] if layer is not None]
            pending = start_reduction(layers, self.groups.get(ranks), len(ranks))
        else:
            assert isinstance(engine, DistributedOptimizer), "the plan's reduce-scatters and all-gathers are its optimizer's"
            named = (start, end)
            # Its reduction all-reduces the whole gradient and keeps this replica's slice (gloo has
            # no reduce-scatter): what a reduce-scatter asks, and an all-reduce under a sharded
            # optimizer (DeepSpeed's pipeline engine) too.
            pending = engine.all_gather(named) if collective.op == "all_gather" else engine.reduce_scatter(named)
        if collective.blocking or collective.handle is None:
            pending.finish()
        else:
            self.s.reductions[collective.handle] = pending
        return "comm_dp"

    def _collective(self, collective: Collective, category: str) -> str:
        ranks = self.program.group_for(collective.group, self.rank)
        group = self.groups.get(ranks)
        if placed_by_rows(collective, self.model.interaction):
            exchange_rows(self.model, self.s.store, collective, ranks, group, self.dtype, self.device)
            return category
        if len(collective.inputs) != len(collective.outputs):
            raise ConfigError(
                f"{collective.op} on {collective.group} pairs {len(collective.inputs)} inputs with {len(collective.outputs)} outputs"
            )
        for source, target in zip(collective.inputs, collective.outputs):
            dealer = self._dealer(source)
            if collective.op == "all_gather" and dealer is not None:
                self._gather_dealt(collective, source, target, dealer, ranks, group)
            elif collective.op == "all_gather" and source.whole in self.s.flat_parts:
                self._gather_flat(collective, source, target, ranks, group)
            elif collective.op == "all_gather":
                local = self.s.store.tensor(source).detach().to(self.dtype).contiguous()
                whole = self._gather_blocks(collective, local, ranks, group)
                # In place (a scattered pipeline transfer's parts become the whole payload), or into another payload.
                (self.s.store.replace if target.whole == source.whole else self.s.store.put)(target, whole)
            elif collective.op == "reduce_scatter":
                # gloo has no reduce-scatter: all-reduce, then keep this rank's rows.
                total = self.s.store.tensor(source).detach().to(self.dtype, copy=True)
                all_reduce(total, group, collective.kind)
                rows = total.shape[0] // len(ranks)
                index = ranks.index(self.rank)
                self.s.store.put(target, total[index * rows : (index + 1) * rows])
            elif collective.op == "all_reduce":
                start, total = self.s.store.read(source)
                total = total.detach().to(self.dtype, copy=True)
                all_reduce(total, group, collective.kind)
                self.s.store.replace(target.part(start, start + total.shape[0]), total)
            elif collective.op == "broadcast":
                self._broadcast(collective, source, target, ranks, group)
            else:
                raise ConfigError(f"the real backend does not carry payloads in a {collective.op}")
        return category

    def _gather_blocks(
        self, collective: Collective, local: torch.Tensor, ranks: tuple[int, ...], group: dist.ProcessGroup
    ) -> torch.Tensor:
        """The all-gather of each rank's block of a micro-batch's rows, in TP order: equal
        blocks, or a replicated unit's uneven shares (runtime.row_shares: the first ranks
        one row more, a rank past the rows none), padded to the largest as an all-gather
        takes equal parts and cut back to each rank's block."""
        rows = self._group_rows(ranks)
        if rows is not None and rows % len(ranks):
            blocks = [len(block) for block in dealt_images(rows, len(ranks))]
        else:
            blocks = [len(local)] * len(ranks)
        mine = blocks[ranks.index(self.rank)]
        if len(local) != mine:
            raise ConfigError(
                f"{collective.op} on {collective.group}: rank {self.rank} holds {len(local)} rows of its block of {mine}"
            )
        padded = local
        if mine < blocks[0]:
            padded = local.new_zeros((blocks[0],) + local.shape[1:])
            padded[:mine] = local
        parts = [torch.empty_like(padded) for _ in ranks]
        with CLOCK.timed(collective.kind):
            dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(parts, blocks)])

    def _group_rows(self, ranks: tuple[int, ...]) -> int | None:
        """The micro-batch's rows that a group of this rank's splits into its blocks: those of
        the unit whose TP group it is (or a replicated unit's group of row shares); None for
        another group, whose ranks each hold as many."""
        for unit in self.plan.units_on(self.rank):
            if ranks in (unit.mesh.group("tp", self.rank), unit.mesh.group(ROWS, self.rank)):
                return unit.micro_batch
        return None

    def _gather_flat(
        self, collective: Collective, source: Payload, target: Payload, ranks: tuple[int, ...], group: dist.ProcessGroup
    ) -> None:
        """The all-gather over TP that rebuilds a payload a scattered transfer delivered as
        flat chunks (_flat_part): the chunks in TP order, viewed as the payload on the wire
        and unpacked (an encoder's hand-on: its images' tokens back at their places)."""
        local, shape, mask = self.s.flat_parts.pop(source.whole)
        if local.numel():  # a micro-batch without an image has nothing to gather (every rank knows it)
            parts = [torch.empty_like(local) for _ in ranks]
            with CLOCK.timed(collective.kind):
                dist.all_gather(parts, local, group=group)
            local = torch.cat(parts)
        self.s.store.replace(target.whole, _unpacked(local.view(shape), mask))

    def _gather_dealt(
        self, collective: Collective, source: Payload, target: Payload, dealer: str, ranks: tuple[int, ...], group: dist.ProcessGroup
    ) -> None:
        """The all-gather over TP of a payload whose ranks hold the shares of a dealing unit's
        images (rank i share i, as a scattered transfer delivers them): each rank's images'
        tokens (or the rows that read them), padded to the most any rank holds (an all-gather
        takes equal parts), each placed at its images' places and added up (values of
        different images; gradients of a sequence whose images two shares ran add up)."""
        shares = self.dealing[dealer]  # the TP group's ranks: the dealing unit's row shares
        masks = [self._dealt_mask(source, dealer, Share(share, shares)) for share in range(shares)]
        counts = [int(mask.sum()) for mask in masks]
        local = _packed(self.s.store.tensor(source).detach().to(self.dtype), masks[ranks.index(self.rank)])
        parts = [local[:0]] * len(ranks)
        if max(counts):  # a micro-batch without an image has nothing to gather (every rank knows it from its batch)
            padded = local.new_zeros((max(counts),) + local.shape[1:])
            padded[: len(local)] = local
            parts = [torch.empty_like(padded) for _ in ranks]
            with CLOCK.timed(collective.kind):
                dist.all_gather(parts, padded, group=group)
        whole = torch.stack([_unpacked(part[:count], mask) for part, count, mask in zip(parts, counts, masks)]).sum(0)
        (self.s.store.replace if target.whole == source.whole else self.s.store.put)(target, whole)

    def _broadcast(
        self, collective: Collective, source: Payload, target: Payload, ranks: tuple[int, ...], group: dist.ProcessGroup
    ) -> None:
        """The group's first rank shares what it holds; the others size their buffer from
        the collective's bytes (its rows of the payload's row shape), or from their batch's
        images where only the real images' tokens travel."""
        tokens = self._image_tokens(source)
        if self.rank == ranks[0]:
            start, tensor = self.s.store.read(source)
            tensor = _packed(tensor.detach().to(self.dtype), tokens).contiguous()
        elif tokens is not None:
            start, tensor = 0, torch.empty(self._packed_shape(source, tokens), dtype=self.dtype, device=self.device)
        else:
            shape = self._row_shape(source)
            row_bytes = torch.Size(shape).numel() * torch.tensor([], dtype=self.dtype).element_size()
            start, tensor = 0, torch.empty((round(collective.bytes / row_bytes),) + shape, dtype=self.dtype, device=self.device)
        if len(tensor):  # a micro-batch without an image has nothing to share
            with CLOCK.timed(collective.kind):
                dist.broadcast(tensor, src=ranks[0], group=group)
        if self.rank != ranks[0]:
            tensor = _unpacked(tensor, tokens)
            self.s.store.put(target.part(start, start + tensor.shape[0]), tensor)

    # ---- point to point -----------------------------------------------------------------
    def _send(self, send: Send, route: Route, messages: tuple[Message, ...], category: str) -> str:
        """`messages`: what the route sends from this rank's rows of the payload."""
        for message in map(functools.partial(self._in_blocks, route), messages):
            if message.dst == self.rank and message.received == message.sent:
                continue  # it holds these rows under that name already (an encoder and the LLM colocated)
            flat = self._flat_part(message.sent, route)
            if flat is not None:  # every rank of the stage holds the whole payload
                index, parts = flat
                _, mask = self._whole_on_wire(send.payload, route)
                tensor = self._flat_chunks(_packed(self.s.store.tensor(send.payload.whole), mask), parts)[index]
            else:
                if self._dealt_share(message.sent, route) is not None:
                    held = message.sent.whole  # its share's images, wherever their sequences are in the micro-batch
                else:
                    held = message.sent if message.sent.rows is not None else send.payload
                tensor = _packed(self.s.store.tensor(held), self._wire_mask(message.sent, route) if message.dst != self.rank else None)
            if not len(tensor):
                continue  # no image: nothing travels (the receiver knows it from its own batch)
            tensor = tensor.detach().to(self.dtype).contiguous()
            if message.dst == self.rank:
                self.s.local.setdefault((route.name, message.received.whole), []).append((message, tensor.clone()))
            elif send.rendezvous:  # the stream waits until its receiver has it (DeepSpeed's pipeline p2p)
                with CLOCK.timed(route.kind):
                    dist.send(tensor, message.dst, group=self.groups.route(route.name))
            else:
                self.s.sends.append((dist.isend(tensor, message.dst, group=self.groups.route(route.name)), tensor))
        return category

    def _recv(self, recv: Recv, route: Route, messages: tuple[Message, ...], category: str) -> str:
        """`messages`: what the route delivers into this rank's rows of the payload."""
        posted: list[tuple[dist.Work | None, Payload, torch.Tensor, torch.Tensor | None, tuple[int, ...] | None]] = []
        for message in map(functools.partial(self._in_blocks, route), messages):
            if message.src == self.rank:
                continue
            rows = message.received.rows
            count = rows[1] - rows[0] if rows is not None else self.unit_plan(message.received.unit).micro_batch
            tokens = self._wire_mask(message.received, route)
            # A share of a dealing unit's images is held at their places in the whole micro-batch.
            target = message.received.whole if self._dealt_share(message.received, route) is not None else message.received
            inside = self._packed_inside(message.received)
            chunk = self._flat_part(message.received, route)
            flat: tuple[int, ...] | None = None  # the whole payload's shape on the wire, where a part is a flat chunk of it
            shape: tuple[int, ...]
            if chunk is not None:
                flat, tokens = self._whole_on_wire(message.received, route)
                target = message.received.whole
                shape = (self._flat_chunk_size(flat, chunk[1]),)
            elif inside is not None:  # between an encoder's stages: its real images' token states, packed
                shape = inside
            elif tokens is None:
                shape = (count,) + self._row_shape(message.received)
            else:
                shape = self._packed_shape(message.received, tokens)
            buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
            group = self.groups.route(route.name)
            if not len(buffer):
                posted.append((None, target, buffer, tokens, flat))  # no image: nothing travels, every slot stays empty
            elif recv.blocking:
                with CLOCK.timed(route.kind):
                    dist.recv(buffer, message.src, group=group)
                posted.append((None, target, buffer, tokens, flat))
            else:
                posted.append((dist.irecv(buffer, message.src, group=group), target, buffer, tokens, flat))
        for message, tensor in self.s.local.pop((route.name, recv.payload.whole), []):
            self.s.store.put(message.received, tensor)
        if recv.blocking:
            self._finish_receives(posted)
        else:
            assert recv.handle is not None, "an asynchronous receive names its handle"
            self.s.pending[recv.handle] = (route.kind, posted)
        return category

    def _finish_receives(self, posted: list) -> None:
        for work, target, buffer, tokens, flat in posted:
            if work is not None:
                work.wait()
            if flat is not None:
                self.s.flat_parts[target] = (buffer, flat, tokens)
            else:
                self.s.store.put(target, _unpacked(buffer, tokens))

    def _flat_part(self, payload: Payload, route: Route) -> tuple[int, int] | None:
        """(which, of how many) equal chunks of the flattened payload a part of a scattered
        transfer is, where the payload's rows do not divide into its parts (Megatron-LM's
        split_tensor_into_1d_equal_chunks; program.Hop names such a part by its index); None
        where a part is a block of rows or a dealing unit's share of images."""
        if not isinstance(route, Hop) or not route.scatter or route.rows % route.parts == 0 or payload.rows is None:
            return None
        if self._dealt_share(payload, route) is not None or self._shares_rows(route):
            return None
        return payload.rows[0] // route.block, route.parts

    def _shares_rows(self, route: Hop) -> bool:
        """Whether `route` carries a replicated unit's shares of rows (runtime.row_shares):
        a unit on either side that is replicated over its TP group and deals no images."""
        if route.name not in self.row_routes:
            units = (u for rank in (*route.a, *route.b) for u in self.plan.units_on(rank))
            self.row_routes[route.name] = any(u.row_shares > 1 and u.unit not in self.dealing for u in units)
        return self.row_routes[route.name]

    def _in_blocks(self, route: Route, message: Message) -> Message:
        """A part of a scattered transfer whose micro-batch a replicated unit's shares split
        unevenly (its TP group does not divide the rows): the block of rows share i runs
        (data.balance.dealt_images), which program.Hop names by its index i."""
        rows = message.sent.rows
        if rows is None or not isinstance(route, Hop) or route.rows % route.parts == 0 or not self._shares_rows(route):
            return message
        block = dealt_images(route.rows, route.parts)[rows[0] // route.block]
        return replace(
            message, sent=message.sent.part(block.start, block.stop), received=message.received.part(block.start, block.stop)
        )

    def _whole_on_wire(self, payload: Payload, route: Route) -> tuple[tuple[int, ...], torch.Tensor | None]:
        """The shape of a whole payload as it travels over `route`, and the mask it is packed
        by there (_wire_mask; None: as it is held)."""
        whole = payload.whole
        inside = self._packed_inside(whole)
        if inside is not None:
            return inside, None
        mask = self._wire_mask(whole, route)
        if mask is not None:
            return self._packed_shape(whole, mask), mask
        return (self.unit_plan(whole.unit).micro_batch,) + self._row_shape(whole), None

    @staticmethod
    def _flat_chunk_size(shape: tuple[int, ...], parts: int) -> int:
        numel = torch.Size(shape).numel()
        if numel % parts:
            raise ConfigError(f"a scattered transfer of shape {shape} does not split into {parts} equal chunks")
        return numel // parts

    @classmethod
    def _flat_chunks(cls, tensor: torch.Tensor, parts: int) -> torch.Tensor:
        """A payload's values as `parts` equal chunks, one a row (_flat_part)."""
        return tensor.reshape(parts, cls._flat_chunk_size(tuple(tensor.shape), parts))

    def _packed_shape(self, payload: Payload, mask: torch.Tensor) -> tuple[int, ...]:
        """What travels of a payload under `mask` (_wire_mask): the images' tokens of an
        encoder's hand-on, each of the LLM's width, or whole rows (a mask of rows)."""
        if mask.dim() == 1:
            return (int(mask.sum()),) + self._row_shape(payload)
        return (int(mask.sum()), self._consumer(payload.unit).hidden)

    def _consumer(self, unit: str) -> UnitSpec:
        """The unit `unit` hands its output on to along a chain (an MLLM's encoder: its LLM)."""
        return self.model.unit(next(c for p, c in self.model.flows if p == unit))

    def _packed_inside(self, payload: Payload) -> tuple[int, ...] | None:
        """The shape of a payload between an encoder's layers under interleaved data: its
        micro-batch's real images (the encoder runs on those only) packed along one row,
        each its patches and CLS, as the batch of this rank's stage says; None where rows
        are samples."""
        spec = self.model.unit(payload.unit)
        if not (spec.arch.reads_images and payload.tensor == "x" and 0 < payload.layer < spec.num_layers):
            return None
        sides = self.batch_for(payload.unit, payload.microbatch).get("patch_sides")
        return None if sides is None else (1, int((sides**2 + 1).sum()), spec.hidden)

    def _wire_mask(self, payload: Payload, route: Route) -> torch.Tensor | None:
        """What of a payload's rows travels over `route` (None: the rows as they are): a share
        of a dealing unit's images (_dealt_mask), or an encoder's real images' tokens."""
        dealt = self._dealt_share(payload, route)
        return self._image_tokens(payload) if dealt is None else self._dealt_mask(payload, *dealt)

    def _dealer(self, payload: Payload) -> str | None:
        """The unit that deals its images out over its row shares (runtime.row_shares) whose
        images a payload carries: what it hands on, or what it reads along a chain."""
        if not self.dealing or payload.tensor != "x" or payload.layer != self.model.unit(payload.unit).num_layers:
            return None
        chained = [payload.unit] + [c for p, c in self.model.flows if p == payload.unit]
        return next((unit for unit in chained if unit in self.dealing), None)

    def _dealt_share(self, payload: Payload, route: Route) -> tuple[str, Share] | None:
        """The dealing unit and the share whose images a part of a payload carries: a
        scattered transfer's rows share i stands for share i's images (runtime.row_shares).
        A broker's hand-off between units (DistTrain's) carries its sequences' rows as they
        are: a replicated sender gathers its shares before it (_gather_dealt), a replicated
        receiver's lead shares what it gets after it (_broadcast)."""
        dealer = self._dealer(payload)
        if dealer is None or payload.rows is None or route.kind == "broker":
            return None
        shares = self.dealing[dealer]
        block = max(1, self.unit_plan(dealer).micro_batch // shares)  # program.Hop's parts, by index where rows are fewer
        return dealer, Share(payload.rows[0] // block, shares)

    def _dealt_mask(self, payload: Payload, dealer: str, share: Share) -> torch.Tensor:
        """What carries `share`'s images of a payload's micro-batch: the tokens of its images
        at their places in their sequences (what the dealing unit hands on), or the
        sequences that hold them (what it reads), from the batch of a unit this rank runs."""
        unit = payload.unit if payload.unit in self.places else self._consumer(payload.unit).name
        sides = self.batch_for(unit, payload.microbatch)["image_sides"]
        slots = dealt_slots(sides > 0, share.index, share.count)
        if dealer == payload.unit:
            return slot_token_mask(sides, slots, self._consumer(payload.unit).seq_len)
        return slots.any(1)

    def _image_tokens(self, payload: Payload) -> torch.Tensor | None:
        """The image-token positions of a payload's rows where it is what an encoder hands on
        (or its gradient) under interleaved data: only its real images' tokens travel, as
        many as the batch of the unit this rank runs on those rows says (data.interleaved_mllm)."""
        spec = self.model.unit(payload.unit)
        if not (spec.arch.reads_images and payload.tensor == "x" and payload.layer == spec.num_layers):
            return None
        consumer = self._consumer(payload.unit)
        unit = payload.unit if payload.unit in self.places else consumer.name
        tokens = self.batch_for(unit, payload.microbatch).get("image_tokens")
        if tokens is None:
            return None
        if payload.rows is not None:
            tokens = tokens[payload.rows[0] : payload.rows[1]]
        return token_mask(tokens, consumer.seq_len)
