"""One emitter for colocated units: every rank runs every unit, each unit with its own
tensor-parallel degree and data-parallel replicas over all ranks, no pipeline.

Megatron-LM's contrastive baseline (both towers, same TP and DP), DistMM's naive
placement (towers with their own TP) and pure data parallelism with ZeRO 0-3 are this
shape. Per micro-batch: the units' forwards in data-flow order, the interaction (a
contrastive loss over the gathered batch) if the model has one, the backwards in reverse;
then each unit's gradient reduction and optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass

from src.cluster import ClusterSpec
from src.costmodel.memory import element_bytes, grad_bytes
from src.mesh import Mesh, tensor_parallel
from src.models.spec import ModelSpec
from src.program import Collective, Instruction, Message, Program, RankProgram
from src.strategies.contrastive import Holder, gathered_batch, local_queries, local_routes
from src.strategies.emit import TPConfig, iteration_tail, segment_pass
from src.strategies.layout import axis_group
from src.models.flows import unit_order
from src.strategies.stages import Segment

QUERY_ROUTE = "interaction.queries"


@dataclass(frozen=True)
class ColocatedUnit:
    """A unit's layout over all ranks: a (tp, dp) mesh, its memory settings."""

    unit: str
    mesh: Mesh
    recompute: str
    zero_stage: int
    sequence_parallel: bool = False
    group_prefix: str = ""


class ColocatedEmitter:
    def __init__(self, model: ModelSpec, cluster: ClusterSpec, precision: str, program: Program,
                 units: list[ColocatedUnit]) -> None:
        self.model, self.cluster, self.program = model, cluster, program
        self.units = {u.unit: u for u in units}
        self.act_bytes, self.grad_bytes = element_bytes(precision), grad_bytes(precision)
        self.tp_group, self.dp_group = {}, {}
        for u in units:
            first = u.mesh.ranks[0]
            self.tp_group[u.unit] = axis_group(program, cluster, f"{u.group_prefix}tp", u.mesh, "tp", first)
            self.dp_group[u.unit] = axis_group(program, cluster, f"{u.group_prefix}dp", u.mesh, "dp", first)

    def _tp(self, unit: str) -> TPConfig:
        u = self.units[unit]
        return TPConfig(tensor_parallel(u.mesh.degree("tp"), u.sequence_parallel), self.tp_group[unit], u.recompute,
                        self.act_bytes)

    def _pass(self, unit: str, phase: str, samples: int, microbatch: int) -> list[Instruction]:
        """A unit's forward or backward; under ZeRO-3 with replicas, layer by layer, each
        after all-gathering that layer's parameters."""
        spec, u = self.model.unit(unit), self.units[unit]
        dp = u.mesh.degree("dp")
        if u.zero_stage < 3 or dp == 1:
            return segment_pass(self.model, Segment(unit, (0, spec.num_layers)), phase, samples, microbatch,
                                self._tp(unit))
        out: list[Instruction] = []
        layers = range(spec.num_layers)
        for layer in (layers if phase == "fwd" else reversed(layers)):
            params = spec.layers[layer].params / u.mesh.degree("tp")
            if params:
                out.append(Collective("all_gather", self.dp_group[unit], params * self.act_bytes, "dp"))
            out += segment_pass(self.model, Segment(unit, (layer, layer + 1)), phase, samples, microbatch,
                                self._tp(unit))
        return out

    def microbatch(self, microbatch: int, samples: dict[str, int], interaction: list[Instruction]) -> list[Instruction]:
        """One micro-batch: forwards, the interaction's instructions, backwards."""
        order = self.towers()
        out: list[Instruction] = []
        for unit in order:
            out += self._pass(unit, "fwd", samples[unit], microbatch)
        out += interaction
        for unit in reversed(order):
            if self.model.needs_backward(unit):
                out += self._pass(unit, "bwd", samples[unit], microbatch)
        return out

    def contrastive(self, microbatch: int, group: str | None, rows: int, rows_scored: int,
                    contrastive_batch: int) -> list[Instruction]:
        """The interaction of one micro-batch, gathering the batch's `rows` over `group`."""
        return gathered_batch(self.model, self.towers(), microbatch, group, rows, QUERY_ROUTE, rows_scored,
                              contrastive_batch, self.act_bytes)

    def towers(self) -> list[str]:
        return [u for u in unit_order(self.model) if u in self.units and u != self.model.interaction]

    def query_routes(self, batches: int, share: dict[str, int], micro_batch: dict[str, int],
                     with_keys: bool) -> None:
        """Every rank copies its replica's rows of each tower into its queries: replica d of
        a tower holds rows [d·share, (d+1)·share) of each contrastive batch, cut into
        micro-batches in order (and the keys too when no gather makes them)."""
        messages: list[Message] = []
        for batch in range(batches):
            holders = []
            for tower in self.towers():
                mesh, share_t, mb = self.units[tower].mesh, share[tower], micro_batch[tower]
                per_batch = share_t // mb
                for rank in mesh.ranks:
                    start = mesh.coords(rank).get("dp", 0) * share_t
                    pieces = tuple((batch * per_batch + i, start + i * mb, mb) for i in range(per_batch))
                    holders.append(Holder(rank, tower, start, start + share_t, pieces, rank))
            messages += local_queries(self.model, batch, holders, self.act_bytes, with_keys)
        for route in local_routes(self.cluster, QUERY_ROUTE, messages):
            self.program.add_route(route)

    def tail(self, pending: list[str] = ()) -> list[Instruction]:
        """Each unit's gradient reduction and optimizer step; units sharing a DP group
        reduce together."""
        out: list[Instruction] = []
        by_group: dict[tuple, list[str]] = {}
        for unit, u in self.units.items():
            by_group.setdefault((u.mesh, self.dp_group[unit]), []).append(unit)
        for (mesh, _), names in by_group.items():
            u = self.units[names[0]]
            segments = [Segment(n, (0, self.model.unit(n).num_layers)) for n in names]
            out += iteration_tail(self.model, segments, tensor_parallel(mesh.degree("tp")), self.dp_group[names[0]],
                                  mesh.degree("dp"), u.zero_stage, self.grad_bytes, self.act_bytes, pending)
        return out

    def rank_program(self, instructions: list[Instruction]) -> RankProgram:
        return RankProgram(ranks=tuple(range(self.program.world_size)), instructions=instructions,
                           label="all ranks", units=tuple(self.units))
