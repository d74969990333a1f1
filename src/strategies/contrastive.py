"""A contrastive interaction's instructions: who scores which rows of a batch against what.

The interaction unit (CLIP's loss) scores query rows of each tower against the whole
contrastive batch of the other tower (the keys): images against all texts, texts against
all images. Its Compute reads, per tower T, the payload `T.q` (the rows this rank scores,
placed at their rows of the batch) and `T.k` (every row, for the other tower's queries),
named in the interaction's own numbering of contrastive batches; it writes their
gradients. How they get there is the planner's choice:

- colocated towers (Megatron-LM's and ZeRO's baselines): every rank all-gathers the
  features over its data-parallel group (keys) and copies its own rows into its queries;
  the keys' gradients come back by a reduce-scatter, the queries' by the copy reversed;
- separate towers (DistMM): a route sends each rank's scored rows to every rank of the
  other tower (its keys) and to itself (its queries); the gradient route returns every
  row's gradient, summed over whoever scored against it, to every TP rank holding it.
"""
from __future__ import annotations

from dataclasses import dataclass

from src.cluster import ClusterSpec
from src.models.flows import feature_boundary
from src.models.spec import ModelSpec
from src.program import Collective, Compute, Instruction, Message, Payload, Recv, Send, Table, Work
from src.strategies.layout import table


def queries(interaction: str, tower: str, batch: int) -> Payload:
    return Payload(interaction, 0, batch, f"{tower}.q")


def keys(interaction: str, tower: str, batch: int) -> Payload:
    return Payload(interaction, 0, batch, f"{tower}.k")


def feature(model: ModelSpec, tower: str, microbatch: int) -> Payload:
    return Payload(tower, feature_boundary(model.unit(tower)), microbatch, "feature")


def interaction_compute(model: ModelSpec, reads: tuple[Payload, ...], batch: int, rows: int,
                        contrastive_batch: int) -> Compute:
    """Score `rows` query rows against the contrastive batch, forward and backward:
    `reads` are the queries and keys this rank holds; it writes their gradients."""
    inter = model.unit(model.interaction)
    work = Work(inter.name, "interaction", rows, (0, inter.num_layers), contrastive_batch=contrastive_batch)
    trained = tuple(p.gradient() for p in reads if model.needs_backward(tower_of(p)))
    return Compute(work, microbatch=batch, inputs=reads, outputs=trained)


def tower_of(payload: Payload) -> str:
    """The tower whose features an interaction payload holds."""
    return payload.tensor.rsplit(".", 1)[0]


@dataclass(frozen=True)
class Holder:
    """A rank that scores rows of one tower: rows [start, end) of the contrastive batch,
    its features' micro-batches covering them (micro-batch, first row within the batch,
    rows), and `lead`: the rank of its replica that exchanges for the replica's TP
    ranks (which hold the same features)."""

    rank: int
    tower: str
    start: int
    end: int
    microbatches: tuple[tuple[int, int, int], ...]
    lead: int


def _pieces(holder: Holder, start: int, end: int) -> list[tuple[int, int, int]]:
    """(micro-batch, first row within it, rows) of the holder's features covering rows
    [start, end) of the batch."""
    out = []
    for microbatch, first, count in holder.microbatches:
        lo, hi = max(start, first), min(end, first + count)
        if lo < hi:
            out.append((microbatch, lo - first, hi - lo))
    return out


def local_queries(model: ModelSpec, batch: int, holders: list[Holder], act_bytes: int,
                  with_keys: bool = False) -> list[Message]:
    """Each holder copies its scored rows from its features into its queries (and, when
    it holds the whole batch alone, into its keys)."""
    inter = model.interaction
    out = []
    for h in holders:
        elems = model.unit(h.tower).output_elems
        for microbatch, at, rows in _pieces(h, h.start, h.end):
            first = next(f for m, f, _ in h.microbatches if m == microbatch) + at
            piece = feature(model, h.tower, microbatch).part(at, at + rows)
            names = (queries, keys) if with_keys else (queries,)
            out += [Message(h.rank, h.rank, piece, name(inter, h.tower, batch).part(first, first + rows),
                            rows * elems * act_bytes) for name in names]
    return out


def exchange_size(holders: list[Holder]) -> int:
    """How many messages `exchange` makes of one contrastive batch, without making them:
    every piece of every holder goes to each lead of the other towers and comes back."""
    leads: dict[str, set[int]] = {}
    for h in holders:
        leads.setdefault(h.tower, set()).add(h.lead)
    total = 0
    for h in holders:
        others = sum(len(ranks) for tower, ranks in leads.items() if tower != h.tower)
        total += len(_pieces(h, h.start, h.end)) * (2 * others + 2)
    return total


def exchange(model: ModelSpec, batch: int, holders: list[Holder], act_bytes: int) -> tuple[list[Message], list[Message]]:
    """Separate towers: (forward messages, gradient messages) of one contrastive batch.

    Forward: every scorer copies its rows into its queries, and sends them to the lead
    of every replica of the other towers (whose TP ranks then share them: a broadcast).
    Backward: a replica's lead (its TP ranks' key gradients already summed) returns each
    row's key gradient to the lead of the row's replica, and every scorer returns its
    query gradient there too; the lead sums them (and shares the sum with its TP ranks)."""
    inter = model.interaction
    forward = local_queries(model, batch, holders, act_bytes)
    backward: list[Message] = []
    leads = {}
    for h in holders:
        leads.setdefault(h.tower, set()).add(h.lead)
    for h in holders:
        elems = model.unit(h.tower).output_elems
        others = sorted(lead for tower, ranks in leads.items() if tower != h.tower for lead in ranks)
        for microbatch, at, rows in _pieces(h, h.start, h.end):
            first = next(f for m, f, _ in h.microbatches if m == microbatch) + at
            piece = feature(model, h.tower, microbatch).part(at, at + rows)
            nbytes = rows * elems * act_bytes
            key_rows = keys(inter, h.tower, batch).part(first, first + rows)
            forward += [Message(h.rank, lead, piece, key_rows, nbytes) for lead in others]
            backward += [Message(lead, h.lead, key_rows.gradient(), piece.gradient(), nbytes) for lead in others]
            backward.append(Message(h.rank, h.lead, queries(inter, h.tower, batch).part(first, first + rows).gradient(),
                                    piece.gradient(), nbytes))
    return forward, backward


def gathered_batch(model: ModelSpec, towers: list[str], microbatch: int, group: str | None, rows: int,
                   route: str, rows_scored: int, contrastive_batch: int, act_bytes: int) -> list[Instruction]:
    """Colocated towers' interaction for one micro-batch: all-gather the features over
    `group` (rows of the whole contrastive batch), copy the own rows into the queries
    over the local `route`, score, reduce-scatter the keys' gradients back (of the towers
    that train), and copy the queries' gradients back. Without a group (one replica) the
    keys are copied too."""
    inter = model.interaction
    trained = [t for t in towers if model.needs_backward(t)]
    feats = tuple(feature(model, t, microbatch) for t in towers)
    copied = (queries, keys) if group is None else (queries,)
    out: list[Instruction] = []
    if group is not None:
        volume = sum(model.unit(t).output_elems for t in towers) * rows * act_bytes
        out.append(Collective("all_gather", group, volume, "interaction", inputs=feats,
                              outputs=tuple(keys(inter, t, microbatch) for t in towers)))
    out += [Send(route, f) for f in feats]
    out += [Recv(route, name(inter, t, microbatch)) for t in towers for name in copied]
    reads = tuple(name(inter, t, microbatch) for t in towers for name in (queries, keys))
    out.append(interaction_compute(model, reads, microbatch, rows_scored, contrastive_batch))
    if group is not None and trained:
        volume = sum(model.unit(t).output_elems for t in trained) * rows * act_bytes
        out.append(Collective("reduce_scatter", group, volume, "interaction",
                              inputs=tuple(keys(inter, t, microbatch).gradient() for t in trained),
                              outputs=tuple(feature(model, t, microbatch).gradient() for t in trained)))
    out += [Send(f"{route}.grad", name(inter, t, microbatch).gradient()) for t in trained for name in copied]
    out += [Recv(f"{route}.grad", feature(model, t, microbatch).gradient()) for t in trained]
    return out


def local_routes(cluster: ClusterSpec, name: str, messages: list[Message]) -> list[Table]:
    """The local query copy and its gradient's way back (no traffic: src == dst)."""
    forward = table(cluster, name, "interaction", messages)
    return [forward, forward.transposed(f"{name}.grad")]
