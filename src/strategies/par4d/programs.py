"""The Par4D Program for one grid: Algorithm 1 per FC, its four overlaps, data parallelism.

Every rank runs the same list (one rank class): per micro-batch the forward, layer by
layer and FC by FC, then the backward in reverse; then the data-parallel all-reduce of the
unique weight shards and the optimizer step. Per FC (par4d.layout.FC, axes a/b = x/y, or
y/x when transposed):

  forward   all-gather Ŵ over z (the k·n/(a·b) block), GEMM, all-reduce O over b
  backward  [full recompute, a block: gather Ŵ again unless cached, re-run the forward and
            its all-reduce over b; a layer full recomputation does not re-run keeps the
            forward's Ŵ] input-gradient GEMM, all-reduce dI over a, weight-gradient GEMM,
            reduce-scatter dW over z

Overlaps (§IV), each one switchable:
  all_reduce      (A) the all-reduce over a is issued asynchronously and waited after the
                  weight-gradient GEMM, which it overlaps;
  reduce_scatter  (B) reduce-scatters are asynchronous and waited once the micro-batch's
                  whole backward is done;
  all_gather      (C) each weight all-gather is issued while the previous FC computes
                  (topological order, recomputation included), and waited before its GEMM;
  cache           (D) under full recomputation the forward's gathered weights of the first
                  `cached_layers` blocks stay in memory, so their recompute needs no gather.
Without an overlap the collective blocks the compute stream where it is issued. Each axis
has one communication stream (NCCL runs a communicator's collectives in order).

How the weights are gathered (`Par4DSettings.gathers`):
  paper      as §IV describes it: one prefetch chain (C) through the forward and the
             recomputation in the order the weights are used, the gathered W kept for the
             backward (Algorithm 1).
  lightning  as AxoNN's Lightning strategy runs LitGPT (axonn c5ef65d, 2024-07-09, through
             release 0.2.0): a gather is prefetched only by the use of the one before it in
             a fixed order, the model's registration order forward (LitGPT registers its
             output head before its blocks) and its reverse backward; a weight that is not
             the prefetched one is gathered on the spot, the compute stream waiting; each
             FC's backward gathers its W again (only the shard is saved); nothing is cached.
             Each forward and backward ends by waiting for what is in flight.

What Algorithm 1 leaves out but a transformer on the grid needs (runtime.modules.gpt3d
runs exactly these): a LayerNorm over the hidden width, split over its FC's input axis b,
all-reduces its rows' statistics over b forward and backward; the embedding table, its
rows split over x, all-reduces its lookups over x; the loss over a vocabulary split over
x all-reduces its rows' maxima and then their sums of exponentials and target logits
over x; the parameters the grid replicates over z (biases, norms) sum their gradients
over z before the data-parallel all-reduce. A residual block's skip projection whose
output lies over the other axis than the block's (par4d.layout.FC.resplit) all-gathers
its output over its column axis forward and its output's gradient over its row axis
backward, each rank keeping its slice; a replicated last layer all-gathers its split input
(again under full recomputation); the slices FCs read of a replicated layer's output (a
U-Net's stem, its timestep embedding) have their gradients all-gathered back over the
FC's row axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from src.batch_layout import BatchLayout
from src.cluster import ClusterSpec
from src.costmodel.memory import element_bytes, grad_bytes, weight_bytes
from src.models.spec import ModelSpec
from src.program import Collective, Compute, Instruction, Phase, Program, RankProgram, TensorGrid, UnitPlan, Wait, Work
from src.strategies.builders.emit import range_io
from src.strategies.builders.layout import axis_group
from src.strategies.par4d.layout import FC, Grid, LayerLayout
from src.strategies.builders.stages import Segment

STATS_BYTES = 2 * 4  # a row's two fp32 statistics (a norm's sum and sum of squares; the loss's sum of exponentials and target logit)


def _normalises_hidden(name: str) -> bool:
    """A transformer's LayerNorm (its statistics span the hidden width the grid splits);
    a U-Net's group norms keep their channel groups whole on a rank."""
    return name.startswith("ln") or name == "final_norm"


@dataclass(frozen=True)
class Par4DSettings:
    micro_batch: int  # samples per data-parallel replica per micro-batch
    recompute: str  # none | selective | full
    overlap: frozenset[str]
    cached_layers: int = 0  # layers whose gathered weights the recompute reuses (D)
    gathers: str = "paper"  # paper | lightning: how the weights are gathered (module docstring)


@dataclass(frozen=True)
class _Gather:
    """One all-gather of weights over z: for layer `layer`'s kernel range `item`."""

    layer: int
    item: int
    bytes: float
    handle: str


def _weight_gather(group: str, gather: _Gather, handle: str | None = None) -> Collective:
    """A z all-gather of `gather`'s weights: issued ahead under `handle` and waited later
    (AxoNN's prefetch, into one tensor), or where it is needed, blocking, into a list of the
    shards then concatenated (AxoNN's `_gather`)."""
    if handle is None:
        return Collective("all_gather", group, gather.bytes, "tp", stream="z", listed=True)
    return Collective("all_gather", group, gather.bytes, "tp", stream="z", blocking=False, handle=handle)


class _Chain:
    """The paper's prefetch (C): the gathers in the order the weights are used, each waited
    before its GEMM with the next one issued then; without (C) each gather blocks."""

    def __init__(self, group: str, sequence: list[_Gather], overlap: bool, issued: set[str]) -> None:
        self.group, self.sequence, self.overlap, self.issued = group, sequence, overlap, issued
        self.position = {g.handle: i for i, g in enumerate(sequence)}

    def need(self, gather: _Gather) -> list[Instruction]:
        if not self.overlap or gather.handle not in self.position:
            return [_weight_gather(self.group, gather)]
        out: list[Instruction] = []
        index = self.position[gather.handle]
        for ahead in self.sequence[index : index + 2]:
            if ahead.handle not in self.issued:
                self.issued.add(ahead.handle)
                out.append(_weight_gather(self.group, ahead, ahead.handle))
        out.append(Wait(gather.handle))
        return out


class _ModuleOrder:
    """AxoNN's weight cache and its prefetch iterator (gathers=lightning): using the weight
    in the cache waits for it and lets the iterator issue the next of its order; any other
    weight is gathered on the spot."""

    def __init__(self, group: str, prefix: str) -> None:
        self.group, self.prefix = group, prefix
        self.order: list[_Gather] = []
        self.next = self.issued = 0
        self.held: dict[tuple[int, int], str] = {}

    def start(self, order: list[_Gather]) -> list[Instruction]:
        """A new iterator over `order`, which issues its first gather at once."""
        self.order, self.next = order, 0
        return self._advance()

    def _advance(self) -> list[Instruction]:
        if self.next >= len(self.order):
            return []
        gather = self.order[self.next]
        self.next += 1
        key = (gather.layer, gather.item)
        if key in self.held:
            return []
        handle = f"{self.prefix}.{self.issued}"
        self.issued += 1
        self.held[key] = handle
        return [_weight_gather(self.group, gather, handle)]

    def need(self, gather: _Gather) -> list[Instruction]:
        handle = self.held.pop((gather.layer, gather.item), None)
        if handle is None:
            return [_weight_gather(self.group, gather)]
        return [Wait(handle), *self._advance()]

    def close(self) -> list[Instruction]:
        """The context's end synchronizes the device: what is in flight is waited, the cache emptied."""
        out: list[Instruction] = [Wait(handle) for handle in self.held.values()]
        self.held.clear()
        return out


class Par4DEmitter:
    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        precision: str,
        program: Program,
        grid: Grid,
        layouts: list[LayerLayout],
        settings: Par4DSettings,
        unit: str,
    ) -> None:
        self.model, self.grid, self.layouts, self.cfg, self.unit = model, grid, layouts, settings, unit
        self.spec = model.unit(unit)
        self.act_bytes, self.weight_bytes = element_bytes(precision), weight_bytes(precision, cluster.amp)
        self.grad_bytes = grad_bytes(precision)
        mesh = grid.mesh()
        self.groups = {axis: axis_group(program, cluster, axis, mesh, axis, mesh.ranks[0]) for axis in ("x", "y", "z", "dp")}
        self.cached = {lay.index for lay in layouts if self._gathers(lay) and self._recomputed(lay)}
        self.cached = set(sorted(self.cached)[: settings.cached_layers]) if "cache" in settings.overlap else set()
        self._issued: set[str] = set()
        self._pending_rs: list[str] = []

    # ---- sizes -----------------------------------------------------------------------------
    def _degree(self, axis: str) -> int:
        return getattr(self.grid, axis)

    def _group(self, axis: str) -> str:
        """The group of an axis a collective runs over (one of degree > 1)."""
        group = self.groups[axis]
        assert group is not None, f"a collective over {axis} on grid {self.grid.label()}, whose G_{axis} is 1"
        return group

    def _gathers(self, layout: LayerLayout) -> bool:
        return self.grid.z > 1 and layout.params > 0

    def _recomputed(self, layout: LayerLayout) -> bool:
        """Whether the layer's forward runs again in its backward: under full recomputation,
        a block's (LayerSpec.block). The layers around the blocks (an embedding, a head) run
        once and keep their gathered W for their backward, as Algorithm 1 keeps it (line 5)
        and the real backend's grid layer saves it."""
        return self.cfg.recompute == "full" and self.spec.layers[layout.index].block

    def _weight_bytes(self, layout: LayerLayout, item: int) -> float:
        """Bytes of the weight block range `item` of a layer gathers."""
        fc = layout.fcs[item]
        if fc is not None:
            return fc.k * fc.n / (self.grid.x * self.grid.y) * self.weight_bytes
        return layout.gathered_params(self.grid) * self.weight_bytes if item == len(layout.fcs) - 1 else 0.0

    def _rows(self, fc: FC) -> float:
        return fc.m * self.cfg.micro_batch / self.grid.z

    def _gather_list(self, layouts: list[LayerLayout], j: int, phase: str) -> list[_Gather]:
        out = []
        for layout in layouts:
            if not self._gathers(layout):
                continue
            for item in range(len(layout.fcs)):
                nbytes = self._weight_bytes(layout, item)
                if nbytes:
                    out.append(_Gather(layout.index, item, nbytes, f"ag.{phase}.mb{j}.L{layout.index}.{item}"))
        return out

    # ---- one micro-batch ---------------------------------------------------------------------
    def _recompute_gathers(self, j: int) -> list[_Gather]:
        recomputed = [lay for lay in reversed(self.layouts) if self._recomputed(lay)]
        return [g for g in self._gather_list(recomputed, j, "re") if g.layer not in self.cached]

    def microbatch(self, j: int, last: bool) -> list[Instruction]:
        if self.cfg.gathers == "lightning" and "all_gather" in self.cfg.overlap and self.grid.z > 1:
            return self._lightning_microbatch(j)
        # Gathers in the order they are needed, into the next micro-batch's first: the
        # prefetch (C) walks this list one ahead.
        sequence = self._gather_list(self.layouts, j, "fwd") + self._recompute_gathers(j)
        if not last:
            sequence += self._gather_list(self.layouts, j + 1, "fwd")[:1]
        chain = _Chain(self._group("z") if self.grid.z > 1 else "", sequence, "all_gather" in self.cfg.overlap, self._issued)
        out: list[Instruction] = []
        for layout in self.layouts:
            out += self._forward_layer(layout, j, chain)
        for layout in reversed(self.layouts):
            out += self._backward_layer(layout, j, chain)
        return out + self._wait_reduce_scatters()

    def _lightning_microbatch(self, j: int) -> list[Instruction]:
        """The micro-batch as AxoNN's Lightning strategy runs it: the forward under one
        iterator in registration order; the backward under the forward's (which issues its
        first gather) replaced by one in the reverse order."""
        fcs = [g for g in self._gather_list(self.layouts, j, "order") if self.layouts[g.layer].fcs[g.item] is not None]
        head = [g for g in fcs if g.layer == self.layouts[-1].index]
        order = head + [g for g in fcs if g.layer != self.layouts[-1].index]
        forward = _ModuleOrder(self._group("z"), f"ag.fwd.mb{j}")
        out = forward.start(order)
        for layout in self.layouts:
            out += self._forward_layer(layout, j, forward)
        out += forward.close()
        backward = _ModuleOrder(self._group("z"), f"ag.bwd.mb{j}")
        out += backward.start(order) + backward.start(order[::-1])
        for layout in reversed(self.layouts):
            out += self._backward_layer(layout, j, backward)
        out += backward.close()
        return out + self._wait_reduce_scatters()

    def _wait_reduce_scatters(self) -> list[Instruction]:
        out: list[Instruction] = [Wait(h) for h in self._pending_rs]
        self._pending_rs = []
        return out

    def _work(self, layout: LayerLayout, phase: Phase, item: int, recompute: str = "none") -> Work:
        return Work(
            self.unit,
            phase,
            self.cfg.micro_batch,
            (layout.index, layout.index + 1),
            sharding=layout.sharding,
            recompute=recompute,
            kernels=layout.ranges[item],
        )

    def _forward_layer(self, layout: LayerLayout, j: int, gathers: _Chain | _ModuleOrder) -> list[Instruction]:
        segment = Segment(self.unit, (layout.index, layout.index + 1))
        needed = {g.item: g for g in self._gather_list([layout], j, "fwd")}
        out: list[Instruction] = []
        last = len(layout.fcs) - 1
        out += self._input_gather(layout)
        for item, fc in enumerate(layout.fcs):
            if item in needed:
                out += gathers.need(needed[item])
            out += self._norm_stats(layout, item)
            inputs, outputs = range_io(self.model, segment, "fwd", j, item == 0, item == last)
            out.append(Compute(self._work(layout, "fwd", item), microbatch=j, inputs=inputs, outputs=outputs))
            out += self._output_collectives(fc)
            out += self._vocabulary_all_reduces(layout, item, fc)
        return out

    def _kernel_names(self, layout: LayerLayout, item: int) -> list[str]:
        kernels = self.spec.layers[layout.index].kernels
        start, end = layout.ranges[item] or (0, len(kernels))
        return [k.name for k in kernels[start:end]]

    def _norm_stats(self, layout: LayerLayout, item: int) -> list[Instruction]:
        """The statistics all-reduces of the LayerNorms in kernel range `item`, over the
        axis splitting their FC's input columns (one per norm, forward or backward)."""
        fc = layout.fcs[item]
        if fc is None:
            return []
        b = fc.axes()[1]
        group = self.groups[b]
        if group is None:
            return []
        nbytes = self._rows(fc) * STATS_BYTES
        norms = sum(_normalises_hidden(name) for name in self._kernel_names(layout, item))
        return [Collective("all_reduce", group, nbytes, "tp", stream=b) for _ in range(norms)]

    def _vocabulary_all_reduces(self, layout: LayerLayout, item: int, fc: FC | None) -> list[Instruction]:
        """An embedding table's lookups summed over x (its rows split there); the loss
        over a vocabulary split over its FC's output axis: rows' maxima, then their sums of
        exponentials and target logits."""
        names = self._kernel_names(layout, item)
        rows_group = self.groups["x"]
        if "lookup" in names and fc is None and rows_group is not None:
            tokens = self.cfg.micro_batch * self.spec.seq_len / self.grid.z
            return [Collective("all_reduce", rows_group, tokens * self.spec.hidden / self.grid.y * self.act_bytes, "tp", stream="x")]
        if "loss" not in names or fc is None:
            return []
        a = fc.axes()[0]
        group = self.groups[a]
        if group is None:
            return []
        rows = self._rows(fc)
        return [
            Collective("all_reduce", group, rows * 4, "tp", stream=a),
            Collective("all_reduce", group, rows * STATS_BYTES, "tp", stream=a),
        ]

    def _output_collectives(self, fc: FC | None) -> list[Instruction]:
        """The all-reduce of an FC's partial output over b; a re-split skip projection's
        output then all-gathered over a (the layer keeps its slice over b)."""
        if fc is None:
            return []
        a, b = fc.axes()
        out: list[Instruction] = []
        group = self.groups[b]
        if group is not None:
            out.append(Collective("all_reduce", group, self._rows(fc) * fc.n / self._degree(a) * self.act_bytes, "tp", stream=b))
        return out + self._resplit(fc, a)

    def _input_gather(self, layout: LayerLayout) -> list[Instruction]:
        """A replicated last layer's input (what full recomputation keeps of it: its
        input), split over the previous FC's output axis, all-gathered whole."""
        if layout.gather_input is None:
            return []
        nbytes = self.spec.layers[layout.index].activations.checkpoint * self.cfg.micro_batch / self.grid.z
        return [Collective("all_gather", self._group(layout.gather_input), nbytes, "tp", stream=layout.gather_input)]

    def _resplit(self, fc: FC, axis: str) -> list[Instruction]:
        """A skip projection's output (forward, over its column axis) or its gradient
        (backward, over its row axis) all-gathered whole before the slice is taken."""
        group = self.groups[axis]
        if not fc.resplit or group is None:
            return []
        return [Collective("all_gather", group, self._rows(fc) * fc.n * self.act_bytes, "tp", stream=axis)]

    def _backward_layer(self, layout: LayerLayout, j: int, gathers: _Chain | _ModuleOrder) -> list[Instruction]:
        out: list[Instruction] = []
        recompute = self.cfg.recompute
        if self._recomputed(layout):
            # The layer's forward runs again (priced inside its backward Works): its weights
            # gathered again unless cached, its output all-reduces again.
            out += self._input_gather(layout)
            if layout.index not in self.cached:
                for gather in self._gather_list([layout], j, "re"):
                    out += gathers.need(gather)
            for fc in layout.fcs:
                out += self._output_collectives(fc)
        out += self._output_grad_gather(layout)
        segment = Segment(self.unit, (layout.index, layout.index + 1))
        for item in reversed(range(len(layout.fcs))):
            fc = layout.fcs[item]
            if fc is not None:
                out += self._resplit(fc, fc.axes()[1])
            out += self._backward_gather(layout, item, j, gathers)
            inputs, outputs = range_io(self.model, segment, "bwd", j, item == 0, item == len(layout.fcs) - 1)
            out.append(Compute(self._work(layout, "bwd_input", item, recompute), microbatch=j, inputs=inputs, outputs=outputs))
            out += self._norm_stats(layout, item)
            handle = None
            if fc is not None:
                a, b = fc.axes()
                group = self.groups[a]
                if group is not None:
                    nbytes = self._rows(fc) * fc.k / self._degree(b) * self.act_bytes
                    if "all_reduce" in self.cfg.overlap:
                        handle = f"ar.mb{j}.L{layout.index}.{item}"
                        out.append(Collective("all_reduce", group, nbytes, "tp", stream=a, blocking=False, handle=handle))
                    else:
                        out.append(Collective("all_reduce", group, nbytes, "tp", stream=a))
                out.append(Compute(self._work(layout, "bwd_weight", item), microbatch=j))
            if handle:
                out.append(Wait(handle))
            if fc is not None:
                out += self._embedding_grad_gather(fc)
            out += self._reduce_scatter(layout, item, j)
        return out

    def _backward_gather(self, layout: LayerLayout, item: int, j: int, gathers: _Chain | _ModuleOrder) -> list[Instruction]:
        """gathers=lightning: an FC's backward gathers its W again (AxoNN saves the shard)."""
        if self.cfg.gathers != "lightning" or layout.fcs[item] is None or not self._gathers(layout):
            return []
        return gathers.need(_Gather(layout.index, item, self._weight_bytes(layout, item), f"ag.bwd.mb{j}.L{layout.index}.{item}"))

    def _output_grad_gather(self, layout: LayerLayout) -> list[Instruction]:
        """A replicated first layer's output gradient, sliced over the axis the next FC
        reads it over, all-gathered whole before its backward."""
        if layout.scatter_output is None:
            return []
        kernel = next(k for k in self.spec.layers[layout.index].kernels if k.kind == "gemm" and k.has_weight)
        nbytes = kernel.m * self.cfg.micro_batch / self.grid.z * kernel.n * self.act_bytes
        return [Collective("all_gather", self._group(layout.scatter_output), nbytes, "tp", stream=layout.scatter_output)]

    def _embedding_grad_gather(self, fc: FC) -> list[Instruction]:
        """An FC reading its slice of a whole embedding: the slice's gradient all-gathered
        over its row axis."""
        b = fc.axes()[1]
        group = self.groups[b]
        if not fc.embedding_input or group is None:
            return []
        return [Collective("all_gather", group, self._rows(fc) * fc.k * self.act_bytes, "tp", stream=b)]

    def _reduce_scatter(self, layout: LayerLayout, item: int, j: int) -> list[Instruction]:
        if not self._gathers(layout) or self.spec.frozen:
            return []
        nbytes = self._weight_bytes(layout, item)
        if not nbytes:
            return []
        if "reduce_scatter" not in self.cfg.overlap:
            return [Collective("reduce_scatter", self._group("z"), nbytes, "tp", stream="z")]
        handle = f"rs.mb{j}.L{layout.index}.{item}"
        self._pending_rs.append(handle)
        return [Collective("reduce_scatter", self._group("z"), nbytes, "tp", stream="z", blocking=False, handle=handle)]

    # ---- the end of the iteration -------------------------------------------------------------
    def tail(self) -> list[Instruction]:
        """The data-parallel all-reduce of each rank's unique weight shard, then the
        optimizer step on it."""
        params = self.spec.trainable_params() / self.grid.tensor
        if params == 0:
            return []
        out: list[Instruction] = []
        if self.groups["z"] is not None:
            # Biases and norms, split over x or y (priced as over y), replicated over z.
            replicated = (
                sum(
                    max(lay.params - sum(fc.k * fc.n for fc in lay.fcs if fc is not None), 0)
                    for lay in self.layouts
                    if any(fc is not None for fc in lay.fcs)
                )
                / self.grid.y
            )
            if replicated:
                out.append(Collective("all_reduce", self.groups["z"], replicated * self.grad_bytes, "tp", stream="z"))
        if self.groups["dp"] is not None:
            out.append(Collective("all_reduce", self.groups["dp"], params * self.grad_bytes, "dp", stream="dp"))
        out.append(Compute(Work(self.unit, "optimizer", 0, (0, self.spec.num_layers), sharding=self.grid.sharding())))
        return out

    def gathered_params(self) -> float:
        """Weights held gathered at the peak: every layer's when the backward reuses the
        forward's (Algorithm 1 keeps W: no full recomputation, or a layer it does not re-run),
        else the cached layers' plus the two recomputed ones in flight (the one computing and
        the one prefetched); under gathers=lightning two layers' (priced whole, an upper bound
        on the FCs in use and in flight)."""
        layouts = [lay for lay in self.layouts if self._gathers(lay)]
        if self.cfg.gathers == "lightning":
            # Nothing kept: the one in use and the one in flight.
            return 2 * max((lay.gathered_params(self.grid) for lay in layouts), default=0.0)
        kept = sum(lay.gathered_params(self.grid) for lay in layouts if lay.index in self.cached or not self._recomputed(lay))
        regathered = [lay.gathered_params(self.grid) for lay in layouts if self._recomputed(lay)]
        return kept + 2 * max(regathered, default=0.0)


def par4d_program(
    model: ModelSpec,
    cluster: ClusterSpec,
    precision: str,
    global_batch: int,
    grid: Grid,
    layouts: list[LayerLayout],
    settings: Par4DSettings,
    unit: str,
) -> tuple[Program, UnitPlan]:
    program = Program(world_size=grid.devices, classes=[])
    emitter = Par4DEmitter(model, cluster, precision, program, grid, layouts, settings, unit)
    batch = BatchLayout(global_batch, grid.dp, settings.micro_batch)
    microbatches = batch.microbatches
    instructions: list[Instruction] = []
    for j in range(microbatches):
        instructions += emitter.microbatch(j, last=j == microbatches - 1)
    instructions += emitter.tail()
    program.classes.append(RankProgram(ranks=tuple(range(grid.devices)), instructions=instructions, label="all ranks", units=(unit,)))
    spec = model.unit(unit)
    plan = UnitPlan(
        unit=unit,
        mesh=grid.mesh(),
        micro_batch=settings.micro_batch,
        num_microbatches=microbatches,
        batch_per_replica=batch.per_replica,
        stage_layers=((0, spec.num_layers),),
        sample_groups=batch.sample_groups,
        recompute=settings.recompute,
        gathered_params=emitter.gathered_params(),
        grid=TensorGrid(
            layers=tuple(layout.placement() for layout in layouts),
            overlaps=tuple(sorted(settings.overlap)),
            cached_layers=tuple(sorted(emitter.cached)),
            gathers=settings.gathers,
        ),
        details={
            "grid": grid.label(),
            "grid_x": grid.x,
            "grid_y": grid.y,
            "grid_z": grid.z,
            "overlap": sorted(settings.overlap),
            "cached_layers": len(emitter.cached),
            "gathers": settings.gathers,
        },
    )
    return program, plan
