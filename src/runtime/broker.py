"""Tower-to-tower inputs between separate towers (CoCa: the text decoder cross-attends to
the image tokens): which rows travel between which ranks.

The Program says when: the producer's last stage sends after each forward, the
consumer's cross-attention stage receives before the forward that needs the tokens, and
the gradient goes back the same way. It writes this for the first rank of each class, as
if replicas paired up one to one; towers with different replicas and micro-batches do
not: a consumer micro-batch takes rows of several producer micro-batches (fan-in) or a
part of one (fan-out). So rows are routed by sample: a piece is the overlap of one
producer micro-batch with one consumer micro-batch (same step positions on both sides,
runtime.inputs), sent by the producer replica's first TP rank to every TP rank of the
consumer replica (and its gradient back likewise). Between two ranks, pieces are sent and
received in the order of their samples (both schedules run micro-batches in order), so
plain point-to-point order matches them, as NCCL needs (it has no tags). A rank receives a micro-batch's pieces at the
Program's Recv before it, or, where the Program received them at another micro-batch's
Recv, when the compute needs them (timed as broker communication either way).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from src.errors import ConfigError
from src.models.spec import ModelSpec
from src.program import Plan
from src.runtime.comm import CLOCK
from src.runtime.inputs import first_sample
from src.runtime.roster import Roster
from src.strategies.distmm_programs import CrossInput, cross_inputs


@dataclass(frozen=True)
class Piece:
    first: int            # position of its first sample in the step's batch
    rows: int
    producer: tuple[int, int]   # (replica, micro-batch)
    consumer: tuple[int, int]
    at_producer: int      # first row within the producer's micro-batch
    at_consumer: int


@dataclass
class _Step:
    memory: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    sends: list = field(default_factory=list)


class Broker:
    def __init__(self, plan: Plan, model: ModelSpec, roster: Roster, rank: int, global_batch: int) -> None:
        self.plan, self.model, self.roster, self.rank, self.batch = plan, model, roster, rank, global_batch
        separate = [u.unit for u in plan.units
                    if u.details.get("placement") == "separate" and u.unit != model.interaction]
        self.links: list[CrossInput] = []
        for link in cross_inputs(model, separate):
            if self._seat(link.producer, self._last(link.producer)) or self._seat(link.consumer, link.layer):
                self.links.append(link)
            crossing = [i for i, layer in enumerate(model.unit(link.consumer).layers)
                        if any(k.name.startswith("xattn_") for k in layer.kernels)]
            consumer = self._seats(link.consumer)
            if any(i in s.layers for s in consumer for i in crossing) and not any(link.layer in s.layers
                                                                                 for s in consumer):
                raise ConfigError(f"rank {rank} computes cross-attention layers of {link.consumer} but not layer "
                                  f"{link.layer}, where the Program delivers {link.producer}'s tokens")
        self.s = _Step()

    # ---- who holds what ---------------------------------------------------------------------
    def _last(self, unit: str) -> int:
        return self.model.unit(unit).num_layers - 1

    def _seats(self, unit: str):
        return [s for s in self.roster.seats.get(unit, []) if s.rank == self.rank]

    def _seat(self, unit: str, layer: int):
        return next((s for s in self._seats(unit) if layer in s.layers), None)

    def consumes(self, unit: str, layers: tuple[int, int]) -> CrossInput | None:
        """The link whose tokens a Work of `unit` over `layers` reads on this rank."""
        return next((l for l in self.links if l.consumer == unit and layers[0] <= l.layer < layers[1]
                     and self._seat(unit, l.layer)), None)

    def produces(self, unit: str, layers: tuple[int, int]) -> CrossInput | None:
        return next((l for l in self.links if l.producer == unit and layers[1] - 1 == self._last(unit)
                     and self._seat(unit, self._last(unit))), None)

    def _pieces(self, link: CrossInput, producer: tuple[int, int] | None = None,
                consumer: tuple[int, int] | None = None) -> list[Piece]:
        """The pieces of one producer micro-batch, or of one consumer micro-batch."""
        p_plan, c_plan = self.plan.unit(link.producer), self.plan.unit(link.consumer)
        out = []
        for pd in range(p_plan.dp):
            for pj in range(p_plan.num_microbatches):
                if producer is not None and (pd, pj) != producer:
                    continue
                p0 = first_sample(p_plan, self.batch, pd, pj)
                for cd in range(c_plan.dp):
                    for cj in range(c_plan.num_microbatches):
                        if consumer is not None and (cd, cj) != consumer:
                            continue
                        c0 = first_sample(c_plan, self.batch, cd, cj)
                        lo, hi = max(p0, c0), min(p0 + p_plan.micro_batch, c0 + c_plan.micro_batch)
                        if lo < hi:
                            out.append(Piece(lo, hi - lo, (pd, pj), (cd, cj), lo - p0, lo - c0))
        return sorted(out, key=lambda p: p.first)

    # ---- per step -----------------------------------------------------------------------------
    def start_step(self) -> list:
        """Forget the last step; returns its pending sends, to wait for."""
        pending, self.s = self.s.sends, _Step()
        return pending

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        self.s.sends.append((dist.isend(tensor, dst), tensor))

    def send_tokens(self, link: CrossInput, microbatch: int, tokens: torch.Tensor) -> None:
        seat = self._seat(link.producer, self._last(link.producer))
        if seat.tp_index:
            return  # its TP peer 0 sends the replica's tokens
        for piece in self._pieces(link, producer=(seat.replica, microbatch)):
            rows = tokens[piece.at_producer:piece.at_producer + piece.rows]
            for dst in self.roster.holders(link.consumer, link.layer, piece.consumer[0]):
                self._isend(rows, dst.rank)

    def send_grad(self, link: CrossInput, microbatch: int, grad: torch.Tensor) -> None:
        seat = self._seat(link.consumer, link.layer)
        if seat.tp_index:
            return
        for piece in self._pieces(link, consumer=(seat.replica, microbatch)):
            rows = grad[piece.at_consumer:piece.at_consumer + piece.rows]
            for dst in self.roster.holders(link.producer, self._last(link.producer), piece.producer[0]):
                self._isend(rows, dst.rank)

    def memory(self, link: CrossInput, microbatch: int) -> torch.Tensor:
        """The producer's tokens of the samples of this rank's consumer micro-batch."""
        key = (link.consumer, microbatch)
        if key not in self.s.memory:
            seat = self._seat(link.consumer, link.layer)
            source = self.model.unit(link.producer)
            parts = []
            for piece in self._pieces(link, consumer=(seat.replica, microbatch)):
                src = self.roster.holders(link.producer, self._last(link.producer), piece.producer[0])[0].rank
                parts.append(self._recv((piece.rows, source.seq_len, source.hidden), src))
            self.s.memory[key] = torch.cat(parts)
        return self.s.memory[key]

    def grad(self, link: CrossInput, microbatch: int) -> torch.Tensor:
        """The gradient of this rank's producer micro-batch's tokens (as the consumer sent it)."""
        key = (link.producer, microbatch)
        if key not in self.s.grads:
            seat = self._seat(link.producer, self._last(link.producer))
            source = self.model.unit(link.producer)
            parts = []
            for piece in self._pieces(link, producer=(seat.replica, microbatch)):
                src = self.roster.holders(link.consumer, link.layer, piece.consumer[0])[0].rank
                parts.append(self._recv((piece.rows, source.seq_len, source.hidden), src))
            self.s.grads[key] = torch.cat(parts)
        return self.s.grads[key]

    def _recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        buffer = torch.empty(shape)
        with CLOCK.timed("broker"):
            dist.recv(buffer, src)
        return buffer
