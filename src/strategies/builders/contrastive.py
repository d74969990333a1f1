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
- separate towers (DistMM): each rank copies the rows it scores into its queries; one
  all-to-all over every scorer of every tower sends them to every scorer of the other
  towers (its keys), placed at their rows of the batch (ranks send unequal numbers of
  rows: the towers have different replica counts and TP degrees); the reverse all-to-all
  returns each row's key gradients to the rank scoring that row, summed there, and a
  route gives the row's gradient to every TP rank holding it. Both collectives are
  O(devices) to emit and to price, where point-to-point messages from every scorer to
  every replica of the other tower were O(devices squared).
"""

from __future__ import annotations

from dataclasses import dataclass

from src.cluster import ClusterSpec
from src.models.flows import feature_boundary
from src.models.spec import ModelSpec
from src.program import Collective, Compute, Instruction, Message, Payload, Recv, Send, Table, Work
from src.strategies.builders.layout import table


def queries(interaction: str, tower: str, batch: int) -> Payload:
    return Payload(interaction, 0, batch, f"{tower}.q")


def keys(interaction: str, tower: str, batch: int) -> Payload:
    return Payload(interaction, 0, batch, f"{tower}.k")


def interaction_of(model: ModelSpec) -> str:
    """The unit scoring the towers' features (the planners refuse models without one)."""
    assert model.interaction is not None, f"model {model.name} has no interaction unit"
    return model.interaction


def feature(model: ModelSpec, tower: str, microbatch: int) -> Payload:
    return Payload(tower, feature_boundary(model.unit(tower)), microbatch, "feature")


def interaction_compute(model: ModelSpec, reads: tuple[Payload, ...], batch: int, rows: int, contrastive_batch: int) -> Compute:
    """Score `rows` query rows against the contrastive batch, forward and backward:
    `reads` are the queries and keys this rank holds; it writes their gradients."""
    inter = model.unit(interaction_of(model))
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
    rows), and `lead`: the first rank of its replica, which names the replica: its TP
    ranks hold the same features."""

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


def local_queries(model: ModelSpec, batch: int, holders: list[Holder], act_bytes: int, with_keys: bool = False) -> list[Message]:
    """Each holder copies its scored rows from its features into its queries (and, when
    it holds the whole batch alone, into its keys)."""
    inter = interaction_of(model)
    out = []
    for h in holders:
        elems = model.unit(h.tower).output_elems
        for microbatch, at, rows in _pieces(h, h.start, h.end):
            first = next(f for m, f, _ in h.microbatches if m == microbatch) + at
            piece = feature(model, h.tower, microbatch).part(at, at + rows)
            names = (queries, keys) if with_keys else (queries,)
            out += [
                Message(h.rank, h.rank, piece, name(inter, h.tower, batch).part(first, first + rows), rows * elems * act_bytes)
                for name in names
            ]
    return out


def batch_sync_features(
    model: ModelSpec, group: str, tower: str, towers: list[str], batch: int, holders: list[Holder], act_bytes: int
) -> Collective:
    """Separate towers, forward: one all-to-all over every scorer of every tower. Each
    sends its query rows (as many as it scores, possibly none) to every scorer of the
    other towers, which place them at their rows of that tower's keys: each receives the
    other modality's whole batch only, half of what a gather of both modalities moves
    (DistMM §5.3: non-colocated placement "halves the communication volume of modality
    interaction"). Priced as the real backend runs it (src/runtime/batch_rows.py): every
    piece padded to the longest, one to each scorer."""
    inter = interaction_of(model)
    return Collective(
        "all_to_all",
        group,
        padded_exchange_bytes(model, holders, towers, act_bytes),
        "interaction",
        inputs=(queries(inter, tower, batch),),
        outputs=tuple(keys(inter, t, batch) for t in towers if t != tower),
    )


def batch_sync_gradients(
    model: ModelSpec, group: str, tower: str, towers: list[str], batch: int, holders: list[Holder], act_bytes: int
) -> Collective | None:
    """Separate towers, backward: the all-to-all reversed. Each rank returns the gradients
    of the other towers' keys it scored against (of the towers that train) to the rows'
    scorers, which sum what arrives for their rows into the gradient their own scoring
    gave them; the pieces padded to the longest scorer's rows of a trained tower. None if
    no tower trains."""
    inter = interaction_of(model)
    trained = [t for t in towers if model.needs_backward(t)]
    if not trained:
        return None
    mine = (queries(inter, tower, batch).gradient(),) if tower in trained else ()
    return Collective(
        "all_to_all",
        group,
        padded_exchange_bytes(model, holders, trained, act_bytes),
        "interaction",
        inputs=tuple(keys(inter, t, batch).gradient() for t in trained if t != tower),
        outputs=mine,
    )


def padded_exchange_bytes(model: ModelSpec, holders: list[Holder], moved: list[str], act_bytes: int) -> float:
    """Each rank's buffer in a batch-sync all-to-all as the real backend sends it: one
    piece per scorer, every piece as long as the most rows of a tower in `moved` that any
    scorer holds (gloo's all-to-all takes equal pieces only)."""
    longest = max(((h.end - h.start) * model.unit(h.tower).output_elems for h in holders if h.tower in moved), default=0)
    return len(holders) * longest * act_bytes


def query_gradients(model: ModelSpec, batch: int, holders: list[Holder], act_bytes: int) -> list[Message]:
    """Separate towers, backward: each holder returns its query rows' gradient (summed by
    the reduce-scatter) to its features, on itself and on every TP peer of its replica
    (they hold the same features, so they need every row's gradient)."""
    inter = interaction_of(model)
    peers: dict[int, list[int]] = {}
    for h in holders:
        peers.setdefault(h.lead, []).append(h.rank)
    out = []
    for h in holders:
        if not model.needs_backward(h.tower):
            continue
        elems = model.unit(h.tower).output_elems
        for microbatch, at, rows in _pieces(h, h.start, h.end):
            first = next(f for m, f, _ in h.microbatches if m == microbatch) + at
            sent = queries(inter, h.tower, batch).part(first, first + rows).gradient()
            received = feature(model, h.tower, microbatch).part(at, at + rows).gradient()
            out += [Message(h.rank, peer, sent, received, rows * elems * act_bytes) for peer in peers[h.lead]]
    return out


def gathered_batch(
    model: ModelSpec,
    towers: list[str],
    microbatch: int,
    group: str | None,
    rows: int,
    route: str,
    rows_scored: int,
    contrastive_batch: int,
    act_bytes: int,
) -> list[Instruction]:
    """Colocated towers' interaction for one micro-batch: all-gather the features over
    `group` (rows of the whole contrastive batch), copy the own rows into the queries
    over the local `route`, score, reduce-scatter the keys' gradients back (of the towers
    that train), and copy the queries' gradients back. Without a group (one replica) the
    keys are copied too."""
    inter = interaction_of(model)
    trained = [t for t in towers if model.needs_backward(t)]
    feats = tuple(feature(model, t, microbatch) for t in towers)
    copied = (queries, keys) if group is None else (queries,)
    out: list[Instruction] = []
    if group is not None:
        volume = sum(model.unit(t).output_elems for t in towers) * rows * act_bytes
        out.append(
            Collective(
                "all_gather", group, volume, "interaction", inputs=feats, outputs=tuple(keys(inter, t, microbatch) for t in towers)
            )
        )
    out += [Send(route, f) for f in feats]
    out += [Recv(route, name(inter, t, microbatch)) for t in towers for name in copied]
    reads = tuple(name(inter, t, microbatch) for t in towers for name in (queries, keys))
    out.append(interaction_compute(model, reads, microbatch, rows_scored, contrastive_batch))
    if group is not None and trained:
        volume = sum(model.unit(t).output_elems for t in trained) * rows * act_bytes
        out.append(
            Collective(
                "reduce_scatter",
                group,
                volume,
                "interaction",
                inputs=tuple(keys(inter, t, microbatch).gradient() for t in trained),
                outputs=tuple(feature(model, t, microbatch).gradient() for t in trained),
            )
        )
    out += [Send(f"{route}.grad", name(inter, t, microbatch).gradient()) for t in trained for name in copied]
    out += [Recv(f"{route}.grad", feature(model, t, microbatch).gradient()) for t in trained]
    return out


def local_routes(cluster: ClusterSpec, name: str, messages: list[Message]) -> list[Table]:
    """The local query copy and its gradient's way back (no traffic: src == dst)."""
    forward = table(cluster, name, "interaction", messages)
    return [forward, forward.transposed(f"{name}.grad")]
