"""Routes between units of different sizes.

- A bridge between two units of random (dp, tp) sends every row of every producer payload
  exactly once, to the rank that consumes it, with the samples it must carry; its
  gradient route is its transpose; the simulator puts exactly the route's bytes on links.
- A batch-sync's collectives and local routes (DistMM's separate towers), carried out as
  the runtime does (runtime.batch_rows) with its payload store, give each feature the
  gradient of one contrastive loss over the whole batch (the oracle), with uneven TP row
  splits.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from src.batch_layout import BatchLayout
from src.mesh import Mesh
from src.models.registry import build_model
from src.program import Payload, Program, RankProgram, Recv, Send
from src.runtime.modules.contrastive import ContrastiveLoss
from src.runtime.store import PayloadStore
from src.sim.engine import simulate
from src.strategies.builders.bridge import Side, bridge, pieces
from src.strategies.builders.contrastive import (
    Holder,
    batch_sync_features,
    batch_sync_gradients,
    feature,
    keys,
    local_queries,
    queries,
    query_gradients,
)
from tests.sim.test_sim_programs import MODEL, PRECISION, make_cluster

CLUSTER = make_cluster(nodes=32, devices_per_node=4)
ROW_BYTES = 1000.0


def _random_sides(seed: int) -> tuple[Side, Side, int]:
    rng = random.Random(seed)
    dp_a, tp_a, dp_b, tp_b = (rng.randint(1, 8) for _ in range(4))
    groups = rng.choice([1, 2])
    batch = groups * math.lcm(dp_a, dp_b) * rng.choice([1, 2, 3])

    def side(dp: int, tp: int, offset: int, unit: str) -> Side:
        share = batch // groups // dp
        micro_batch = rng.choice([d for d in range(1, share + 1) if share % d == 0])
        mesh = Mesh.contiguous((("tp", tp), ("dp", dp)), offset)
        return Side(mesh, BatchLayout(batch, dp, micro_batch, groups), Payload("encoder", 1, 0))

    src = side(dp_a, tp_a, 0, "encoder")
    return src, side(dp_b, tp_b, src.mesh.size, "llm"), batch


@pytest.mark.parametrize("seed", range(20))
def test_bridge_sends_every_row_once_to_where_it_is_consumed(seed):
    src, dst, batch = _random_sides(seed)
    forward, backward = bridge(CLUSTER, "enc>llm", "broker", src, dst, ROW_BYTES)
    # Every sample of the step leaves exactly one producer row and lands on exactly one consumer row.
    sent: dict[int, int] = {}
    landed: dict[int, int] = {}
    leads_a = {src.lead(d): d for d in range(src.batch.dp)}
    leads_b = {dst.lead(d): d for d in range(dst.batch.dp)}
    for message in forward.messages():
        assert message.src in leads_a and message.dst in leads_b  # only a replica's lead sends or receives
        pd, cd = leads_a[message.src], leads_b[message.dst]
        p0 = src.batch.first_sample(pd, message.sent.microbatch)
        c0 = dst.batch.first_sample(cd, message.received.microbatch)
        (a, b), (c, d) = message.sent.rows, message.received.rows
        assert b - a == d - c > 0 and message.bytes == (b - a) * ROW_BYTES
        for row in range(b - a):
            assert p0 + a + row == c0 + c + row  # the same sample on both sides
            sent[p0 + a + row] = sent.get(p0 + a + row, 0) + 1
            landed[c0 + c + row] = landed.get(c0 + c + row, 0) + 1
    assert sent == landed == {sample: 1 for sample in range(batch)}
    # The gradient route is the transpose, message by message.
    back = {(m.dst, m.src, m.received.value(), m.sent.value(), m.received.rows, m.sent.rows) for m in backward.messages()}
    fwd = {(m.src, m.dst, m.sent.value(), m.received.value(), m.sent.rows, m.received.rows) for m in forward.messages()}
    assert back == fwd and all(m.sent.grad and m.received.grad for m in backward.messages())
    assert len(pieces(src, dst)) == len(list(forward.messages()))


@pytest.mark.parametrize("seed", range(6))
def test_the_simulator_prices_exactly_the_routes_messages(seed):
    src, dst, batch = _random_sides(seed)
    forward, _ = bridge(CLUSTER, "enc>llm", "broker", src, dst, ROW_BYTES)
    world = src.mesh.size + dst.mesh.size
    program = Program(world_size=world, classes=[])
    program.add_route(forward)
    for rank in range(world):
        instructions = []
        if rank in (src.lead(d) for d in range(src.batch.dp)):
            instructions = [Send("enc>llm", src.at(j)) for j in range(src.batch.microbatches)]
        elif rank in (dst.lead(d) for d in range(dst.batch.dp)):
            instructions = [Recv("enc>llm", dst.at(j)) for j in range(dst.batch.microbatches)]
        program.classes.append(RankProgram(ranks=(rank,), instructions=instructions, label=f"r{rank}"))
    timeline = simulate(program, MODEL, CLUSTER, PRECISION)
    assert timeline.p2p_bytes == pytest.approx(sum(m.bytes for m in forward.messages()))
    assert timeline.p2p_bytes == pytest.approx(batch * ROW_BYTES)


# ---- the batch-sync's routes against one contrastive loss ---------------------------------
CLIP = build_model({"name": "clip", "scale": "tiny"})
RBS = 6


def _holders() -> list[Holder]:
    """Vision: 2 replicas of 3 rows, each split over 2 TP ranks (2 + 1 rows); text: one
    replica of all 6 rows on one rank. One micro-batch per replica."""
    out = []
    for replica in range(2):
        lead = 2 * replica
        for t, (start, end) in enumerate(((0, 2), (2, 3))):
            out.append(Holder(2 * replica + t, "vision", 3 * replica + start, 3 * replica + end, ((0, 3 * replica, 3),), lead))
    out.append(Holder(4, "text", 0, 6, ((0, 0, 6),), 4))
    return out


def test_batch_sync_collectives_give_the_gradients_of_one_contrastive_loss():
    generator = torch.Generator().manual_seed(1)
    dim = CLIP.unit("vision").output_elems
    images, texts = torch.randn(RBS, dim, generator=generator), torch.randn(RBS, dim, generator=generator)
    holders = _holders()
    towers = ["vision", "text"]
    stores = {h.rank: PayloadStore() for h in holders}
    for h in holders:  # each rank holds its replica's features (TP peers hold the same)
        rows = images[h.microbatches[0][1] : h.microbatches[0][1] + 3] if h.tower == "vision" else texts
        stores[h.rank].put(feature(CLIP, h.tower, 0), rows)
    for m in local_queries(CLIP, 0, holders, act_bytes=4):
        assert m.src == m.dst  # the rows a rank scores are its own
        stores[m.dst].put(m.received, stores[m.src].tensor(m.sent))
    exchanges = {h.rank: batch_sync_features(CLIP, "interaction", h.tower, towers, 0, holders, 4) for h in holders}
    for h in holders:  # the all-to-all: the other tower's query rows at their rows of this rank's keys
        (target,) = exchanges[h.rank].outputs
        for other in holders:
            (source,) = exchanges[other.rank].inputs
            if target.tensor == f"{other.tower}.k":
                start, rows = stores[other.rank].read(source)
                stores[h.rank].put(target.part(start, start + rows.shape[0]), rows)

    module = ContrastiveLoss()
    total, scale_grads = 0.0, []
    for h in holders:
        other = "text" if h.tower == "vision" else "vision"
        start, rows = stores[h.rank].read(queries("interaction", h.tower, 0))
        q = rows.clone().requires_grad_()
        k = stores[h.rank].tensor(keys("interaction", other, 0)).clone().requires_grad_()
        pair = ((start, q), None, None, k) if h.tower == "vision" else (None, (start, q), k, None)
        loss = module(*pair) / RBS
        module.zero_grad()
        loss.backward()
        total += float(loss.detach())
        scale_grads.append(module.logit_scale.grad.clone())
        stores[h.rank].put(queries("interaction", h.tower, 0).part(start, start + q.shape[0]).gradient(), q.grad)
        stores[h.rank].put(keys("interaction", other, 0).gradient(), k.grad)
    returns = {h.rank: batch_sync_gradients(CLIP, "interaction", h.tower, towers, 0, holders, 4) for h in holders}
    summed = {t: torch.zeros(RBS, dim) for t in towers}  # the reverse all-to-all: every key gradient ...
    for h in holders:
        for payload in returns[h.rank].inputs:
            summed[payload.tensor.split(".")[0]] += stores[h.rank].tensor(payload)
    for h in holders:  # ... back to its rows' scorer, summed there into its query gradient
        (target,) = returns[h.rank].outputs
        start, rows = stores[h.rank].read(target.value())
        stores[h.rank].put(target.part(start, start + rows.shape[0]), summed[h.tower][start : start + rows.shape[0]])
    for m in query_gradients(CLIP, 0, holders, act_bytes=4):
        stores[m.dst].put(m.received, stores[m.src].tensor(m.sent))

    oracle_images, oracle_texts = images.clone().requires_grad_(), texts.clone().requires_grad_()
    oracle = ContrastiveLoss()
    expected = oracle((0, oracle_images), (0, oracle_texts), oracle_images, oracle_texts) / RBS
    expected.backward()
    assert total == pytest.approx(float(expected.detach()), rel=1e-6)
    torch.testing.assert_close(sum(scale_grads), oracle.logit_scale.grad)
    for h in holders:  # every TP rank of a replica holds its features' whole gradient
        got = stores[h.rank].tensor(feature(CLIP, h.tower, 0).gradient())
        first = h.microbatches[0][1]
        expected_rows = oracle_images.grad[first : first + 3] if h.tower == "vision" else oracle_texts.grad
        torch.testing.assert_close(got, expected_rows)
