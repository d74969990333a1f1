"""One small hand-built Program per row of docs/design.md's table, simulated and checked
against a hand computation.

Every expected number below is derived by hand from the cost model's formulas with a toy
cluster chosen so the formulas are exact:

- compute: a GEMM (m x k)@(k x n) takes 2·m·n·k / peak seconds. The toy cluster has
  gemm_max_efficiency = 1 and gemm_half_dim = 0, so the saturation factor
  prod d/(d + 0) is exactly 1; kernel_overhead_s = 0; the HBM bandwidth is so large
  (1e18 B/s) that the memory-traffic bound never wins. Backward of a weight GEMM is an
  input-gradient GEMM plus a weight-gradient GEMM of the same FLOPs, so B = 2·F.
- communication (ring, alpha-beta, efficiency 1):
    all-reduce      2(g-1)·lat + 2(g-1)/g · S / bw
    all-gather/RS    (g-1)·lat +  (g-1)/g · S / bw
    send/recv            lat  +           S / bw
  bw is the intra-node bandwidth inside a node; across nodes it is
  min(intra, inter / sharing) (the node's NICs split among `sharing` rings).

Nothing here uses ComputeModel.work_time or CommModel to produce an expected value.
The builders are imported by tests/sim/test_sim_engine.py.
"""

from __future__ import annotations

import itertools

import pytest

from src.cluster import ClusterSpec, family_sharing
from src.costmodel.comm import CommModel
from src.models.layers import contrastive_layer, gemm
from src.models.spec import ActivationBytes, LayerSpec, ModelSpec, UnitSpec
from src.mesh import Mesh, Sharding, tensor_parallel
from src.program import Collective, Compute, Group, Hop, Message, Payload, Program, RankProgram, Recv, Send, Table, Wait, Work
from src.schedules.pipeline import one_f_one_b
from src.sim.engine import simulate
from src.timeline import BREAKDOWN_CATEGORIES

# ---- the toy hardware -------------------------------------------------------------------
PEAK = 1e12  # FLOP/s, bf16
INTRA_BW = 100e9  # B/s per device (NVLink)
INTRA_LAT = 1e-5  # s
INTER_BW = 40e9  # B/s per node (sum of its NICs)
INTER_LAT = 1e-4  # s
DEVICES_PER_NODE = 4
PRECISION = "bf16"
MS = 1e-3
REL = 1e-9


def make_cluster(nodes: int = 4, devices_per_node: int = DEVICES_PER_NODE, **overrides) -> ClusterSpec:
    fields = dict(
        name="toy",
        device="toy",
        nodes=nodes,
        devices_per_node=devices_per_node,
        peak_flops={"bf16": PEAK},
        memory_gib=80.0,
        memory_bandwidth=1e18,
        intra_bandwidth=INTRA_BW,
        intra_latency=INTRA_LAT,
        inter_bandwidth=INTER_BW,
        inter_latency=INTER_LAT,
        gemm_max_efficiency=1.0,
        gemm_half_dim=0.0,
        memory_efficiency=1.0,
        intra_efficiency=1.0,
        inter_efficiency=1.0,
        kernel_overhead_s=0.0,
        reserved_memory_gib=0.0,
        default_precision="bf16",
    )
    fields.update(overrides)
    return ClusterSpec(**fields)


CLUSTER = make_cluster()


# ---- hand formulas ----------------------------------------------------------------------
def gemm_s(m: float, n: float, k: float) -> float:
    return 2.0 * m * n * k / PEAK


def all_reduce_s(g: int, nbytes: float, bw: float, lat: float) -> float:
    return 2 * (g - 1) * lat + 2 * (g - 1) / g * nbytes / bw


def gather_s(g: int, nbytes: float, bw: float, lat: float) -> float:
    """all-gather and reduce-scatter"""
    return (g - 1) * lat + (g - 1) / g * nbytes / bw


def p2p_s(nbytes: float, bw: float, lat: float) -> float:
    return lat + nbytes / bw


# ---- the toy model: every layer is one or a few GEMMs of known shape ---------------------
def _layer(name: str, *kernels) -> LayerSpec:
    return LayerSpec(name=name, kernels=tuple(kernels), params=1_000_000, activations=ActivationBytes(), block=True)


def _unit(name: str, layers: tuple[LayerSpec, ...]) -> UnitSpec:
    return UnitSpec(name=name, layers=layers, hidden=1000, heads=8, seq_len=1000, output_elems=1000)


# llm: 2 layers, one column-parallel (1000 x 1000)@(1000 x 1000) GEMM per sample each.
LLM_LAYER = _layer("llm_block", gemm("fc", 1000, 1000, 1000, "n"))
# encoder: one layer of three GEMMs: k0 1000x1000x1000, k1 n=500, k2 1000x1000x1000.
ENC_LAYER = _layer("enc_block", gemm("k0", 1000, 1000, 1000, "n"), gemm("k1", 1000, 1000, 500, "n"), gemm("k2", 1000, 1000, 1000, "n"))
VISION_LAYER = _layer("vision_block", gemm("fc", 1000, 1000, 1000, "n"))
TEXT_LAYER = _layer("text_block", gemm("fc", 500, 1000, 1000, "n"))
EMBED = 100_000
# A column-parallel weight GEMM: on a Par4D grid it is an FC layer of Algorithm 1 (a kernel
# replicated on the tensor grid, split 'none', would only have its rows split over z).
FC_LAYER = _layer("par4d_fc", gemm("fc", 1000, 1000, 1000, "n"))

MODEL = ModelSpec(
    name="toy",
    units=(
        _unit("llm", (LLM_LAYER, LLM_LAYER)),
        _unit("encoder", (ENC_LAYER,)),
        _unit("vision", (VISION_LAYER,)),
        _unit("text", (TEXT_LAYER,)),
        _unit("contrastive", (contrastive_layer(EMBED),)),
        _unit("fc", (FC_LAYER,)),
    ),
    flows=(("vision", "contrastive"), ("text", "contrastive"), ("encoder", "llm")),
    interaction="contrastive",
)


def run(program: Program):
    return simulate(program, MODEL, CLUSTER, PRECISION)


def msg(key: str) -> Payload:
    """A payload standing for one message of a hand-built Program."""
    return Payload(key, 0, 0)


def link(program: Program, key: str, src: int, dst: int, nbytes: float, kind: str, sharing: int = 1) -> None:
    """A route of one message from `src` to `dst`, named and carrying `key`."""
    program.add_route(Table(key, kind, (Message(src, dst, msg(key), msg(key), nbytes),), sharing))


def send(key: str, **kwargs) -> Send:
    return Send(key, msg(key), **kwargs)


def recv(key: str, **kwargs) -> Recv:
    return Recv(key, msg(key), **kwargs)


def assert_breakdown(rank_timeline, iteration: float, **expected: float) -> None:
    """Every category named in `expected` has that value; every other one is 0; and the
    whole breakdown adds up to the iteration time."""
    bd = rank_timeline.breakdown
    assert set(bd) == set(BREAKDOWN_CATEGORIES)
    for cat in BREAKDOWN_CATEGORIES:
        want = expected.get(cat, 0.0)
        assert bd[cat] == pytest.approx(want, rel=REL, abs=1e-12), (rank_timeline.label, cat, bd)
    assert sum(bd.values()) == pytest.approx(iteration, rel=REL)


def timeline_of(timeline, label: str):
    for rank_timeline in timeline.ranks:
        if rank_timeline.label == label:
            return rank_timeline
    raise KeyError(label)


# =========================================================================================
# 1. Megatron-LM: 2-stage pipeline, 1F1B over 4 micro-batches, TP=2, DP=2
# =========================================================================================
MEG_TP, MEG_DP, MEG_PP, MEG_M, MEG_MB = 2, 2, 2, 4, 1
S_TP = 2e6  # bytes of one TP activation all-reduce (two per pass: count=2)
S_ACT = 2e6  # bytes of one pipeline activation / gradient message
S_DP = 4e6  # bytes of each stage's gradient all-reduce over DP
# 1F1B by hand (warm-up p-s-1 forwards, then one forward one backward, then drain).
MEG_ORDERS = {
    0: [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
    1: [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)],
}


def meg_rank(t: int, d: int, p: int) -> int:
    """Megatron's order: TP fastest, then DP, then PP. Stage 0 = ranks 0-3 (node 0),
    stage 1 = ranks 4-7 (node 1), so pipeline messages cross nodes."""
    return t + MEG_TP * (d + MEG_DP * p)


def meg_pp_sharing() -> int:
    pairs = [(meg_rank(t, d, 0), meg_rank(t, d, 1)) for d in range(MEG_DP) for t in range(MEG_TP)]
    return family_sharing(CLUSTER, pairs)


def _megatron_list(p: int, tp_group: str, dp_group: str, hop: str) -> list:
    out: list = []
    act = lambda j: Payload("llm", 1, j)  # noqa: E731 - the stage boundary's activation
    for kind, j in MEG_ORDERS[p]:
        if kind == "F":
            if p == 1:
                out.append(Recv(hop, act(j)))
            out.append(Compute(Work("llm", "fwd", MEG_MB, (p, p + 1), sharding=tensor_parallel(MEG_TP)), microbatch=j))
            out.append(Collective("all_reduce", tp_group, S_TP, "tp", stream="compute", count=2))
            if p == 0:
                out.append(Send(hop, act(j)))
        else:
            if p == 0:
                out.append(Recv(hop, act(j).gradient()))
            out.append(Compute(Work("llm", "bwd", MEG_MB, (p, p + 1), sharding=tensor_parallel(MEG_TP)), microbatch=j))
            out.append(Collective("all_reduce", tp_group, S_TP, "tp", stream="compute", count=2))
            if p == 1:
                out.append(Send(hop, act(j).gradient()))
    out.append(Collective("all_reduce", dp_group, S_DP, "dp"))
    return out


def build_megatron(per_rank: bool = True, s_act: float = S_ACT) -> Program:
    """per_rank=True: every one of the 8 ranks has its own instruction list (labels
    's{p}.t{t}.d{d}') and its own route to its pipeline peer. per_rank=False: one class
    per stage covering its 4 ranks (TP peers and DP replicas) and one route between the
    stages (labels 'stage {p}')."""
    program = Program(world_size=MEG_TP * MEG_DP * MEG_PP, classes=[])
    stage_ranks = [tuple(meg_rank(t, d, p) for d in range(MEG_DP) for t in range(MEG_TP)) for p in range(MEG_PP)]
    if not per_rank:
        program.add_route(Hop("hop", "pp", stage_ranks[0], stage_ranks[1], s_act, sharing=4))
    for p in range(MEG_PP):
        if per_rank:
            for d in range(MEG_DP):
                program.add_group(Group(f"tp.p{p}.d{d}", tuple(meg_rank(t, d, p) for t in range(MEG_TP))))
            for t in range(MEG_TP):
                program.add_group(Group(f"dp.p{p}.t{t}", tuple(meg_rank(t, d, p) for d in range(MEG_DP))))
            for d in range(MEG_DP):
                for t in range(MEG_TP):
                    hop = f"hop.t{t}.d{d}"
                    if p == 0:
                        program.add_route(Hop(hop, "pp", (meg_rank(t, d, 0),), (meg_rank(t, d, 1),), s_act, sharing=4))
                    program.classes.append(
                        RankProgram(
                            ranks=(meg_rank(t, d, p),),
                            label=f"s{p}.t{t}.d{d}",
                            units=("llm",),
                            pipelined=True,
                            instructions=_megatron_list(p, f"tp.p{p}.d{d}", f"dp.p{p}.t{t}", hop),
                        )
                    )
        else:
            program.add_group(
                Group(
                    f"tp.p{p}",
                    tuple(meg_rank(t, 0, p) for t in range(MEG_TP)),
                    family=tuple(tuple(meg_rank(t, d, p) for t in range(MEG_TP)) for d in range(MEG_DP)),
                )
            )
            program.add_group(
                Group(
                    f"dp.p{p}",
                    tuple(meg_rank(0, d, p) for d in range(MEG_DP)),
                    family=tuple(tuple(meg_rank(t, d, p) for d in range(MEG_DP)) for t in range(MEG_TP)),
                )
            )
            program.classes.append(
                RankProgram(
                    ranks=stage_ranks[p],
                    label=f"stage {p}",
                    units=("llm",),
                    pipelined=True,
                    instructions=_megatron_list(p, f"tp.p{p}", f"dp.p{p}", "hop"),
                )
            )
    return program


def megatron_expected() -> dict[str, float]:
    F = gemm_s(1000 * MEG_MB, 1000 / MEG_TP, 1000)  # 1 ms
    B = 2 * F  # dX + dW GEMMs
    t_tp = 2 * all_reduce_s(2, S_TP, INTRA_BW, INTRA_LAT)  # count=2, TP peers share a node
    # stage 0 on node 0, stage 1 on node 1: 4 pipeline pairs leave each node at once
    d = p2p_s(S_ACT, min(INTRA_BW, INTER_BW / 4), INTER_LAT)
    t_dp = all_reduce_s(2, S_DP, INTRA_BW, INTRA_LAT)  # DP replicas of a stage share a node
    return dict(F=F, B=B, t_tp=t_tp, d=d, t_dp=t_dp, Fp=F + t_tp, Bp=B + t_tp)


def test_megatron_orders_are_1f1b():
    assert [[(op.kind, op.microbatch) for op in order] for order in one_f_one_b(2, 4)] == [MEG_ORDERS[0], MEG_ORDERS[1]]


def test_megatron_1f1b_pipeline_tp_dp():
    e = megatron_expected()
    F, B, d, t_tp, t_dp, Fp, Bp = e["F"], e["B"], e["d"], e["t_tp"], e["t_dp"], e["Fp"], e["Bp"]
    assert F == pytest.approx(1 * MS) and d == pytest.approx(0.3 * MS) and d < Fp
    assert meg_pp_sharing() == 4
    m, p = MEG_M, MEG_PP
    # Classic 1F1B: (m + p - 1)(F' + B') with F', B' including their blocking TP
    # all-reduces. The critical path crosses the stage boundary 4 times (F0 0->1, B0 1->0,
    # F2 0->1, B3 1->0), each paying one message time d; then the DP all-reduce.
    iteration = (m + p - 1) * (Fp + Bp) + 4 * d + t_dp
    timeline = run(build_megatron(per_rank=True))
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)
    assert len(timeline.ranks) == 8
    for t in range(MEG_TP):
        for dd in range(MEG_DP):
            # Stage 0: waits for B0's gradient after F0, F1 (warm-up: (p-1)·B' plus the
            # message's way there), drains with B2, B3 waiting on stage 1 (cool-down:
            # (p-1)·F'); the three gradient messages it waits on are exposed pp comm.
            assert_breakdown(
                timeline_of(timeline, f"s0.t{t}.d{dd}"),
                iteration,
                compute=m * (F + B),
                comm_tp=2 * m * t_tp,
                comm_dp=t_dp,
                comm_pp=3 * d,
                bubble_warmup=Bp + d,
                bubble_cooldown=Fp,
            )
            # Stage 1: waits F' for its first input (warm-up), once d for F2's input
            # in the steady state (imbalance: after its first backward, before its last
            # forward), and finishes B' + d before stage 0 (cool-down tail).
            assert_breakdown(
                timeline_of(timeline, f"s1.t{t}.d{dd}"),
                iteration,
                compute=m * (F + B),
                comm_tp=2 * m * t_tp,
                comm_dp=t_dp,
                comm_pp=2 * d,
                bubble_warmup=Fp,
                bubble_imbalance=d,
                bubble_cooldown=Bp + d,
            )
    # Bubbles of each stage add up to the classic (p - 1)(F' + B') plus message waits.
    s0 = timeline_of(timeline, "s0.t0.d0").breakdown
    assert s0["bubble_warmup"] + s0["bubble_cooldown"] == pytest.approx((p - 1) * (Fp + Bp) + d)
    # By position (Optimus's Table 1): the first stage waits only between its passes; the
    # last waits F' before its first, d between, and B' + d after its last.
    first = timeline_of(timeline, "s0.t0.d0").bubble_positions
    assert first == pytest.approx({"leading": 0.0, "inner": Bp + d + Fp, "trailing": 0.0}, rel=REL, abs=1e-12)
    last = timeline_of(timeline, "s1.t0.d0").bubble_positions
    assert last == pytest.approx({"leading": Fp, "inner": d, "trailing": Bp + d}, rel=REL, abs=1e-12)


def test_megatron_without_messages_is_the_classic_formula():
    """With 0-byte pipeline messages (p2p_time = 0) the iteration is exactly the classic
    (m + p - 1)(F' + B') + t_dp, and each stage's bubble is (p - 1)(F' + B')."""
    timeline = run(build_megatron(per_rank=True, s_act=0.0))
    e = megatron_expected()
    assert timeline.iteration_time == pytest.approx((MEG_M + MEG_PP - 1) * (e["Fp"] + e["Bp"]) + e["t_dp"], rel=REL)
    s0 = timeline_of(timeline, "s0.t0.d0").breakdown
    assert s0["bubble_warmup"] == pytest.approx(e["Bp"]) and s0["bubble_cooldown"] == pytest.approx(e["Fp"])
    s1 = timeline_of(timeline, "s1.t0.d0").breakdown
    assert s1["bubble_warmup"] == pytest.approx(e["Fp"]) and s1["bubble_cooldown"] == pytest.approx(e["Bp"])


# =========================================================================================
# 2. DistMM: towers on disjoint ranks with different dp, a batch-sync over K=2 micro-batches
# =========================================================================================
DMM_BATCH, DMM_K = 12, 2
DMM_VISION_RANKS, DMM_TEXT_RANKS = (0, 1, 2), (3,)  # vision dp=3, text dp=1
S_GATHER = 8e6  # both modalities' features of the whole batch
S_DP_VISION = 3e6


def build_distmm() -> Program:
    program = Program(world_size=4, classes=[])
    program.add_group(Group("world", (0, 1, 2, 3)))
    program.add_group(Group("dp.vision", DMM_VISION_RANKS))

    def tower(unit: str, ranks: tuple[int, ...], tail: list) -> RankProgram:
        per_replica = DMM_BATCH // len(ranks)
        mb = per_replica // DMM_K
        instructions: list = [Compute(Work(unit, "fwd", mb, (0, 1)), microbatch=j) for j in range(DMM_K)]
        # The batch-sync: gather the features, then the interaction scores this replica's
        # K·mb local samples against the whole gathered batch of the other modality.
        interaction = Work("contrastive", "interaction", per_replica, (0, 1), contrastive_batch=DMM_BATCH)
        instructions += [Collective("all_gather", "world", S_GATHER, "interaction"), Compute(interaction)]
        instructions += [Compute(Work(unit, "bwd", mb, (0, 1)), microbatch=j) for j in reversed(range(DMM_K))]
        return RankProgram(ranks=ranks, instructions=instructions + tail, label=unit, units=(unit, "contrastive"))

    # The three vision replicas are interchangeable: one class covers them.
    program.classes.append(tower("vision", DMM_VISION_RANKS, [Collective("all_reduce", "dp.vision", S_DP_VISION, "dp")]))
    program.classes.append(tower("text", DMM_TEXT_RANKS, []))
    return program


def test_distmm_batch_sync_waits_for_the_slower_tower():
    # vision: 4 images per replica, micro-batches of 2; text: 12 texts, micro-batches of 6
    Fv, Ft = gemm_s(1000 * 2, 1000, 1000), gemm_s(500 * 6, 1000, 1000)  # 4 ms, 6 ms
    Bv, Bt = 2 * Fv, 2 * Ft
    # interaction: similarity (R x EMBED)@(EMBED x 12) forward, two input gradients (no weight)
    Iv, It = 3 * gemm_s(4, DMM_BATCH, EMBED), 3 * gemm_s(12, DMM_BATCH, EMBED)
    t_gather = gather_s(4, S_GATHER, INTRA_BW, INTRA_LAT)  # ranks 0-3: one node
    t_dp = all_reduce_s(3, S_DP_VISION, INTRA_BW, INTRA_LAT)
    assert (Fv, Ft) == (pytest.approx(4 * MS), pytest.approx(6 * MS))
    assert t_gather == pytest.approx(0.09 * MS) and t_dp == pytest.approx(0.08 * MS)

    timeline = run(build_distmm())
    sync = DMM_K * Ft  # the gather starts when the slower tower is done
    text_end = sync + t_gather + It + DMM_K * Bt
    vision_end = sync + t_gather + Iv + DMM_K * Bv + t_dp
    assert vision_end < text_end
    assert timeline.iteration_time == pytest.approx(text_end, rel=REL)
    vision, text = timeline_of(timeline, "vision"), timeline_of(timeline, "text")
    # The faster tower's wait for the slower one is load imbalance, not communication.
    assert_breakdown(
        vision,
        text_end,
        compute=DMM_K * (Fv + Bv) + Iv,
        bubble_imbalance=DMM_K * (Ft - Fv),
        comm_interaction=t_gather,
        comm_dp=t_dp,
        idle=text_end - vision_end,
    )
    assert_breakdown(text, text_end, compute=DMM_K * (Ft + Bt) + It, comm_interaction=t_gather)
    # The gather span is where it should be on both towers.
    for rank_timeline in (vision, text):
        (span,) = [s for s in rank_timeline.spans if s.category == "comm_interaction"]
        assert (span.start, span.end) == (pytest.approx(sync), pytest.approx(sync + t_gather))
        interaction = [s for s in rank_timeline.spans if s.unit == "contrastive"]
        assert len(interaction) == 1 and interaction[0].start == pytest.approx(sync + t_gather)


# =========================================================================================
# 3. DistTrain: broker fan-in from an encoder with dp=2 into an LLM with dp=1, and fan-out
# =========================================================================================
S_BROKER = 4e6
S_DP_ENC = 2e6
DT_SAMPLES = 2  # per encoder replica
DT_LOAD = {0: 1.0, 1: 1.5}  # data heterogeneity: rank 1's images are 1.5x larger


def build_disttrain(recv_order: tuple[int, int] = (0, 1)) -> Program:
    program = Program(world_size=3, classes=[])
    program.add_group(Group("dp.encoder", (0, 1)))
    for r in (0, 1):
        link(program, f"enc.fwd.r{r}", r, 2, S_BROKER, "broker")
        link(program, f"enc.bwd.r{r}", 2, r, S_BROKER, "broker")
        program.classes.append(
            RankProgram(
                ranks=(r,),
                label=f"encoder{r}",
                units=("encoder",),
                pipelined=True,
                instructions=[
                    Compute(Work("encoder", "fwd", DT_SAMPLES, (0, 1), load=DT_LOAD[r])),
                    send(f"enc.fwd.r{r}"),
                    recv(f"enc.bwd.r{r}"),
                    Compute(Work("encoder", "bwd", DT_SAMPLES, (0, 1), load=DT_LOAD[r])),
                    Collective("all_reduce", "dp.encoder", S_DP_ENC, "dp"),
                ],
            )
        )
    llm_samples = DT_SAMPLES * 2
    program.classes.append(
        RankProgram(
            ranks=(2,),
            label="llm",
            units=("llm",),
            pipelined=True,
            instructions=[
                *[recv(f"enc.fwd.r{r}") for r in recv_order],
                Compute(Work("llm", "fwd", llm_samples, (0, 2))),
                Compute(Work("llm", "bwd", llm_samples, (0, 2))),
                send("enc.bwd.r0"),  # fan-out, one send stream: 0 then 1
                send("enc.bwd.r1"),
            ],
        )
    )
    return program


@pytest.mark.parametrize("recv_order", [(0, 1), (1, 0)])
def test_disttrain_broker_fan_in_starts_at_the_later_arrival(recv_order):
    enc_fwd = DT_SAMPLES * (gemm_s(1000, 1000, 1000) + gemm_s(1000, 500, 1000) + gemm_s(1000, 1000, 1000))
    E = {r: enc_fwd * DT_LOAD[r] for r in (0, 1)}  # 10 ms, 15 ms
    d = p2p_s(S_BROKER, INTRA_BW, INTRA_LAT)  # ranks 0-2: one node
    L_f = 2 * 4 * gemm_s(1000, 1000, 1000)  # 2 layers x 4 samples
    L_b = 2 * L_f
    t_dp = all_reduce_s(2, S_DP_ENC, INTRA_BW, INTRA_LAT)
    assert E[0] == pytest.approx(10 * MS) and E[1] == pytest.approx(15 * MS) and d == pytest.approx(0.05 * MS)

    timeline = run(build_disttrain(recv_order))
    llm = timeline_of(timeline, "llm")
    arrivals = {r: E[r] + d for r in (0, 1)}
    llm_start = max(arrivals.values())
    (fwd,) = [s for s in llm.spans if s.unit == "llm" and s.name.startswith("fwd")]
    assert fwd.start == pytest.approx(llm_start, rel=REL)
    T = llm_start + L_f + L_b  # the LLM's gradients leave at T
    # fan-out on one send stream: rank 0's gradient leaves at T, rank 1's at T + d
    enc0_ready, enc1_ready = T + d + 2 * E[0], T + 2 * d + 2 * E[1]
    iteration = max(enc0_ready, enc1_ready) + t_dp
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)

    # LLM: waiting on the encoders before its first backward is warm-up; the transfer
    # time it sees is broker comm (both arrivals if it waits on rank 0 first, only the
    # later one otherwise); after its backward it is in cool-down until the end.
    exposed_broker = 2 * d if recv_order == (0, 1) else d
    assert_breakdown(
        llm,
        iteration,
        compute=L_f + L_b,
        comm_broker=exposed_broker,
        bubble_warmup=llm_start - exposed_broker,
        bubble_cooldown=iteration - T,
    )
    # Encoders: the wait between their forward and backward is both after the last
    # forward and before the first backward: imbalance. Rank 0 waits for the slower
    # rank 1 at the DP all-reduce: cool-down.
    assert_breakdown(
        timeline_of(timeline, "encoder0"),
        iteration,
        compute=3 * E[0],
        comm_broker=d,
        comm_dp=t_dp,
        bubble_imbalance=T - E[0],
        bubble_cooldown=enc1_ready - enc0_ready,
    )
    assert_breakdown(
        timeline_of(timeline, "encoder1"), iteration, compute=3 * E[1], comm_broker=d, comm_dp=t_dp, bubble_imbalance=T + d - E[1]
    )


# =========================================================================================
# 4. Optimus: encoder kernels placed into an LLM bubble on the same rank
# =========================================================================================
S_OPT = 4e6


def build_optimus(placement: str) -> Program:
    """Rank 0 runs LLM layer 0, waits for rank 1's message (a bubble of ~6 ms), runs LLM
    layer 1. The encoder layer is split at kernel granularity: kernels [0, 2) and [2, 3).
    placement='bubble': kernels [0, 2) run inside the bubble (before the Recv-wait),
    kernel [2, 3) after LLM layer 1. placement='after': all of them after the LLM."""
    enc_a = Compute(Work("encoder", "fwd", 1, (0, 1), kernels=(0, 2)))
    enc_b = Compute(Work("encoder", "fwd", 1, (0, 1), kernels=(2, 3)))
    llm_a = Compute(Work("llm", "fwd", 1, (0, 1)))
    llm_b = Compute(Work("llm", "fwd", 1, (1, 2)))
    if placement == "bubble":
        rank0 = [llm_a, enc_a, recv("x"), llm_b, enc_b]
    else:
        rank0 = [llm_a, recv("x"), llm_b, enc_a, enc_b]
    program = Program(
        world_size=2,
        classes=[
            RankProgram(ranks=(0,), instructions=rank0, label="colocated", units=("llm", "encoder"), pipelined=True),
            RankProgram(
                ranks=(1,),
                label="sender",
                units=("llm",),
                pipelined=True,
                instructions=[
                    Compute(Work("llm", "fwd", 2, (0, 2))),
                    send("x"),
                ],
            ),
        ],
    )
    link(program, "x", 1, 0, S_OPT, "pp")
    return program


def test_optimus_encoder_kernels_fill_the_llm_bubble():
    L = gemm_s(1000, 1000, 1000)  # one LLM layer, one sample: 2 ms
    enc_a = gemm_s(1000, 1000, 1000) + gemm_s(1000, 500, 1000)  # kernels k0, k1: 3 ms
    enc_b = gemm_s(1000, 1000, 1000)  # kernel k2: 2 ms
    sender = 2 * 2 * L  # 8 ms
    d = p2p_s(S_OPT, INTRA_BW, INTRA_LAT)
    arrival = sender + d
    assert L + enc_a < sender  # enc_a fits in the bubble

    inside, after = run(build_optimus("bubble")), run(build_optimus("after"))
    assert inside.iteration_time == pytest.approx(arrival + L + enc_b, rel=REL)
    assert after.iteration_time == pytest.approx(arrival + L + enc_a + enc_b, rel=REL)
    assert after.iteration_time - inside.iteration_time == pytest.approx(enc_a, rel=1e-6)

    rank0 = timeline_of(inside, "colocated")
    enc_spans = [s for s in rank0.spans if s.unit == "encoder"]
    assert [(s.start, s.end) for s in enc_spans] == [
        (pytest.approx(L), pytest.approx(L + enc_a)),  # inside the bubble
        (pytest.approx(arrival + L), pytest.approx(arrival + L + enc_b)),
    ]
    # The bubble shrank by exactly the encoder kernels placed in it.
    assert_breakdown(rank0, inside.iteration_time, compute=2 * L + enc_a + enc_b, comm_pp=d, bubble_warmup=sender - L - enc_a)
    assert_breakdown(
        timeline_of(after, "colocated"), after.iteration_time, compute=2 * L + enc_a + enc_b, comm_pp=d, bubble_warmup=sender - L
    )


# =========================================================================================
# 5. Par4D: one FC layer on a (2, 2, 2) grid, asynchronous collectives and waits
# =========================================================================================
GRID = (2, 2, 2)
S_AG_Z, S_AR_Y, S_RS_Z = 2e7, 1e8, 2e7


def grid_rank(x: int, y: int, z: int, d: int = 0, grid=GRID) -> int:
    """x fastest, then y, z, data (Par4D's G = (G_x, G_y, G_z, G_data) order)."""
    gx, gy, gz = grid[:3]
    return x + gx * (y + gy * (z + gz * d))


def grid_family(axis: int, grid: tuple[int, int, int, int]) -> list[tuple[int, ...]]:
    """Every group along `axis` (0=x, 1=y, 2=z, 3=data) of a 4D grid."""
    groups = []
    others = [range(n) for i, n in enumerate(grid) if i != axis]
    for fixed in itertools.product(*others):
        coords = list(fixed)
        members = []
        for v in range(grid[axis]):
            c = coords[:axis] + [v] + coords[axis:]
            members.append(grid_rank(*c, grid=grid))
        groups.append(tuple(members))
    return groups


def build_par4d(ar_x_bytes: float, listed: bool = False) -> Program:
    grid4 = GRID + (1,)
    program = Program(world_size=8, classes=[])
    names = {}
    for axis, label in enumerate("xyz"):
        family = grid_family(axis, grid4)
        sharing = family_sharing(CLUSTER, family)
        for group in family:
            name = f"{label}{group}"
            program.add_group(Group(name, group, sharing=sharing))
            for r in group:
                names[(r, label)] = name
    fwd = Work("fc", "fwd", 1, (0, 1))
    dgrad = Work("fc", "bwd_input", 1, (0, 1))
    wgrad = Work("fc", "bwd_weight", 1, (0, 1))
    for r in range(8):
        gx, gy, gz = names[(r, "x")], names[(r, "y")], names[(r, "z")]
        program.classes.append(
            RankProgram(
                ranks=(r,),
                label=f"r{r}",
                units=("fc",),
                instructions=[
                    # forward: gather the weight shard over z (asynchronous, then wait; or
                    # blocking into a list, then concatenated), GEMM, all-reduce the partial
                    # outputs over y
                    *(
                        [Collective("all_gather", gz, S_AG_Z, "tp", stream="z", listed=True)]
                        if listed
                        else [Collective("all_gather", gz, S_AG_Z, "tp", stream="z", blocking=False, handle="ag_z"), Wait("ag_z")]
                    ),
                    Compute(fwd),
                    Collective("all_reduce", gy, S_AR_Y, "tp", stream="compute"),
                    # backward: input gradient, its all-reduce over x overlapped with the weight
                    # gradient, then reduce-scatter of the weight gradient over z
                    Compute(dgrad),
                    Collective("all_reduce", gx, ar_x_bytes, "tp", stream="x", blocking=False, handle="ar_x"),
                    Compute(wgrad),
                    Wait("ar_x"),
                    Collective("reduce_scatter", gz, S_RS_Z, "tp", stream="z", blocking=False, handle="rs_z"),
                    Wait("rs_z"),
                ],
            )
        )
    return program


def test_par4d_family_sharing_of_the_grid():
    grid4 = GRID + (1,)
    # x and y groups stay inside a node of 4; the 4 z rings of node 0 all leave it.
    assert [family_sharing(CLUSTER, grid_family(a, grid4)) for a in range(3)] == [1, 1, 4]
    assert all(not CLUSTER.spans_nodes(g) for g in grid_family(0, grid4) + grid_family(1, grid4))
    assert all(CLUSTER.spans_nodes(g) for g in grid_family(2, grid4))


@pytest.mark.parametrize(
    "grid, betas",
    [
        # Placement-aware β with G_node = 4 and β_inter = 1 (Par4D eq. 10; docs/strategies.md, Par4D)
        ((2, 2, 2, 2), ("intra", "intra", 1 / 4, 1 / 4)),
        ((1, 1, 8, 2), ("intra", "intra", 1, 1 / 4)),
        ((8, 1, 1, 2), (1, 1 / 4, 1 / 4, 1 / 4)),
    ],
)
def test_par4d_placement_aware_bandwidth(grid, betas):
    intra = 100.0
    cluster = make_cluster(nodes=4, devices_per_node=4, intra_bandwidth=intra, inter_bandwidth=1.0)
    for axis, beta in enumerate(betas):
        family = grid_family(axis, grid)
        if grid[axis] == 1:
            # A group of one rank never communicates, so its β does not matter.
            assert CommModel(cluster).collective_time("all_reduce", family[0], 1e6) == 0.0
            continue
        sharing = family_sharing(cluster, family)
        want = intra if beta == "intra" else beta
        for group in family:
            assert cluster.bandwidth(group, sharing) == pytest.approx(want), (grid, axis, group, sharing)


@pytest.mark.parametrize("ar_x_bytes", [1e8, 3e8])
def test_par4d_layer_overlaps_async_all_reduce_with_weight_gradient(ar_x_bytes):
    F = gemm_s(1000, 1000, 1000)
    B_in = B_w = F  # 2 ms each
    z_bw = min(INTRA_BW, INTER_BW / 4)  # 4 z rings share node 0's NICs
    t_ag = gather_s(2, S_AG_Z, z_bw, INTER_LAT)
    t_ary = all_reduce_s(2, S_AR_Y, INTRA_BW, INTRA_LAT)
    t_arx = all_reduce_s(2, ar_x_bytes, INTRA_BW, INTRA_LAT)
    t_rs = gather_s(2, S_RS_Z, z_bw, INTER_LAT)
    assert t_ag == pytest.approx(1.1 * MS) and t_ary == pytest.approx(1.02 * MS)
    iteration = t_ag + F + t_ary + B_in + max(B_w, t_arx) + t_rs
    timeline = run(build_par4d(ar_x_bytes))
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)
    exposed_x = max(0.0, t_arx - B_w)
    for rank_timeline in timeline.ranks:
        assert_breakdown(rank_timeline, iteration, compute=F + B_in + B_w, comm_tp=t_ag + t_ary + exposed_x + t_rs)
        (arx,) = [s for s in rank_timeline.spans if s.stream == "x"]
        (wgrad,) = [s for s in rank_timeline.spans if s.name.startswith("bwd_weight")]
        assert arx.start == pytest.approx(wgrad.start)  # issued right before it: overlap
    if ar_x_bytes == 1e8:
        assert exposed_x == 0.0
    else:
        assert exposed_x == pytest.approx(1.02 * MS)


def test_a_listed_gather_copies_its_bytes_twice_before_the_work_that_waits_for_it():
    """AxoNN's on-the-spot gather: the flat buffer copied out to the list's parts, then the
    parts concatenated, each read and written at a device copy's rate, as compute."""
    stream = 1e12 * 0.5
    cluster = make_cluster(memory_bandwidth=1e12, copy_efficiency=0.5)
    F = gemm_s(1000, 1000, 1000)
    t_ag = gather_s(2, S_AG_Z, min(INTRA_BW, INTER_BW / 4), INTER_LAT)
    t_ary = all_reduce_s(2, S_AR_Y, INTRA_BW, INTRA_LAT)
    t_rs = gather_s(2, S_RS_Z, min(INTRA_BW, INTER_BW / 4), INTER_LAT)
    copies = 4 * S_AG_Z / stream
    assert copies == pytest.approx(0.16 * MS)
    timeline = simulate(build_par4d(1e8, listed=True), MODEL, cluster, PRECISION)
    iteration = t_ag + copies + F + t_ary + 2 * F + t_rs
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)
    for rank_timeline in timeline.ranks:
        assert_breakdown(rank_timeline, iteration, compute=copies + 3 * F, comm_tp=t_ag + t_ary + t_rs)
        (copy,) = [s for s in rank_timeline.spans if s.name == "copy out and concatenate"]
        assert copy.start == pytest.approx(t_ag) and copy.end - copy.start == pytest.approx(copies)


def test_only_a_blocking_all_gather_is_listed():
    for bad in (
        dict(op="reduce_scatter"),
        dict(op="all_gather", blocking=False, handle="h"),
    ):
        with pytest.raises(ValueError, match="only a blocking all_gather"):
            Collective(group="z0", bytes=1.0, kind="tp", listed=True, **bad)


# =========================================================================================
# 5b. Par4D on a named 2x2x2 mesh: the layer's GEMM sharded by the grid, the collectives'
#     buffers from Par4D's message sizes (eqs. 4-7), every group made from the mesh
# =========================================================================================
def build_par4d_mesh() -> tuple[Program, dict[str, float]]:
    mesh = Mesh.contiguous((("x", 2), ("y", 2), ("z", 2)))
    gx, gy, gz = (mesh.degree(a) for a in "xyz")
    m = k = n = 1000
    elem = 2  # bf16
    sizes = {
        "ag_z": k * n / (gx * gy) * elem,  # the gathered weight block W_{j,i}
        "ar_y": m * n / (gz * gx) * elem,  # the partial output O_{k,i}
        "ar_x": m * k / (gz * gy) * elem,  # the input gradient dI_{k,j}
        "rs_z": k * n / (gx * gy) * elem,
    }  # the weight gradient before its scatter
    program = Program(world_size=8, classes=[])
    for axis in "xyz":
        family = mesh.family(axis)
        sharing = family_sharing(CLUSTER, family)
        program.add_group(Group(axis, mesh.group(axis, 0), sharing=sharing, family=tuple(family)))
    sharding = Sharding((("x", gx), ("y", gy), ("z", gz)))
    program.classes.append(
        RankProgram(
            ranks=mesh.ranks,
            label="grid",
            units=("fc",),
            instructions=[
                Collective("all_gather", "z", sizes["ag_z"], "tp", stream="z", blocking=False, handle="ag_z"),
                Wait("ag_z"),
                Compute(Work("fc", "fwd", 1, (0, 1), sharding=sharding)),
                Collective("all_reduce", "y", sizes["ar_y"], "tp", stream="compute"),
                Compute(Work("fc", "bwd_input", 1, (0, 1), sharding=sharding)),
                Collective("all_reduce", "x", sizes["ar_x"], "tp", stream="x", blocking=False, handle="ar_x"),
                Compute(Work("fc", "bwd_weight", 1, (0, 1), sharding=sharding)),
                Wait("ar_x"),
                Collective("reduce_scatter", "z", sizes["rs_z"], "tp", stream="z", blocking=False, handle="rs_z"),
                Wait("rs_z"),
            ],
        )
    )
    return program, sizes


def test_par4d_layer_on_a_named_mesh_prices_to_the_grid_shapes():
    program, sizes = build_par4d_mesh()
    F = gemm_s(1000 / 2, 1000 / 2, 1000 / 2)  # (m/z x k/y) @ (k/y x n/x): 0.25 ms
    z_bw = min(INTRA_BW, INTER_BW / 4)  # the 4 z rings of a node share its NICs
    t_ag = gather_s(2, sizes["ag_z"], z_bw, INTER_LAT)
    t_ary = all_reduce_s(2, sizes["ar_y"], INTRA_BW, INTRA_LAT)
    t_arx = all_reduce_s(2, sizes["ar_x"], INTRA_BW, INTRA_LAT)
    t_rs = gather_s(2, sizes["rs_z"], z_bw, INTER_LAT)
    assert F == pytest.approx(0.25 * MS) and t_ag == pytest.approx(0.125 * MS) and t_arx < F
    iteration = t_ag + F + t_ary + F + F + t_rs  # the x all-reduce hides under dW
    timeline = run(program)
    assert timeline.iteration_time == pytest.approx(iteration, rel=REL)
    (grid,) = timeline.ranks
    assert grid.ranks == tuple(range(8))
    assert_breakdown(grid, iteration, compute=3 * F, comm_tp=t_ag + t_ary + t_rs)


# =========================================================================================
# 5c. Par4D's planner Program: two FC layers on a (2, 2, 2, 1) grid (8 ranks, 2 nodes of 4),
#     the overlaps switched one by one, priced by hand
# =========================================================================================
PAR4D_LAYER = _layer("par4d_fc", gemm("fc", 1000, 1000, 1000, "n"))
PAR4D_MODEL = ModelSpec(name="par4d_toy", units=(_unit("fc2", (PAR4D_LAYER, PAR4D_LAYER)),))


def build_par4d_planned(overlap: tuple[str, ...], recompute: str, cached: int) -> Program:
    from src.strategies.par4d.layout import Grid, UnitGrid
    from src.strategies.par4d.programs import Par4DSettings, par4d_program

    grid = Grid(2, 2, 2, 1)
    unit = PAR4D_MODEL.unit("fc2")
    layouts = UnitGrid(unit).layout(grid)
    # The second layer reads the first's output: it is transposed (x and y swap roles).
    assert [lay.fcs[0].transposed for lay in layouts] == [False, True]
    settings = Par4DSettings(micro_batch=2, recompute=recompute, overlap=frozenset(overlap), cached_layers=cached)
    program, _ = par4d_program(PAR4D_MODEL, CLUSTER, PRECISION, 2, grid, layouts, settings, "fc2")
    return program


# Per FC, by hand: 2 samples of 1000 rows split over z=2 -> 1000 rows a rank; the GEMM is
# (1000 x 1000/b) @ (1000/b x 1000/a) with a = b = 2.
P4_F = gemm_s(1000, 500, 500)  # 0.5 ms, each of fwd, dX, dW
P4_AG = gather_s(2, 1000 * 1000 / 4 * 2, min(INTRA_BW, INTER_BW / 4), INTER_LAT)  # z spans the 2 nodes: 0.125 ms
P4_RS = P4_AG
P4_AR = all_reduce_s(2, 1000 * 500 * 2, INTRA_BW, INTRA_LAT)  # x and y stay in a node: 0.03 ms
P4_COPY = 4 * 1000 * 1000 / 4 * 2 / 1e18  # a blocking gather's copy-out and concatenation
# Adam on each rank's 1/8 of the weights (HBM-bound), bf16: averaging and zeroing its fp32
# gradients (12 bytes a parameter), then norm, Adam and the bf16 copy (4 + 28 + 6).
P4_OPT = 2 * 1e6 / 8 * (12 + 38) / 1e18


@pytest.mark.parametrize(
    "overlap, recompute, cached, listed, expected",
    [
        # No overlap: per layer AG + F + AR forward; dX + AR + dW + RS backward. Each gather
        # blocks, into a list of the shards then concatenated (P4_COPY).
        ((), "none", 0, 2, 2 * (P4_AG + P4_F + P4_AR) + 2 * (P4_F + P4_AR + P4_F + P4_RS)),
        # B + C: layer 1's gather hides under layer 0's GEMM; layer 1's reduce-scatter under
        # layer 0's backward; layer 0's is waited at the end.
        (("reduce_scatter", "all_gather"), "none", 0, 0, P4_AG + 2 * (P4_F + P4_AR) + 2 * (2 * P4_F + P4_AR) + P4_RS),
        # A + B under full recompute: each backward gathers its weights again (layer 0's
        # queued behind layer 1's reduce-scatter on the z stream), re-runs the forward and its
        # all-reduce; dX's all-reduce hides under dW.
        (
            ("all_reduce", "reduce_scatter"),
            "full",
            0,
            4,
            2 * (P4_AG + P4_F + P4_AR) + (P4_AG + P4_AR + 3 * P4_F) + (P4_RS + P4_AG + P4_AR + 3 * P4_F) + P4_RS,
        ),
        # + D: both layers' gathered weights are cached, the recompute gathers nothing.
        (("all_reduce", "reduce_scatter", "cache"), "full", 2, 2, 2 * (P4_AG + P4_F + P4_AR) + 2 * (P4_AR + 3 * P4_F) + P4_RS),
        # All four: C prefetches the recompute's gathers too, so caching saves no time here.
        (
            ("all_reduce", "reduce_scatter", "all_gather", "cache"),
            "full",
            2,
            0,
            P4_AG + 2 * (P4_F + P4_AR) + 2 * (P4_AR + 3 * P4_F) + P4_RS,
        ),
    ],
)
def test_par4d_planned_program_prices_each_overlap_by_hand(overlap, recompute, cached, listed, expected):
    assert P4_F == pytest.approx(0.5 * MS) and P4_AG == pytest.approx(0.125 * MS) and P4_AR == pytest.approx(0.03 * MS)
    program = build_par4d_planned(overlap, recompute, cached)
    for rank in program.classes:
        gathers = [i for i in rank.instructions if isinstance(i, Collective) and i.op == "all_gather"]
        assert [g.listed for g in gathers] == [g.blocking for g in gathers] and sum(g.listed for g in gathers) == listed
    timeline = simulate(program, PAR4D_MODEL, CLUSTER, PRECISION)
    expected += P4_OPT + listed * P4_COPY
    assert timeline.iteration_time == pytest.approx(expected, rel=REL)
    (ranks,) = timeline.ranks
    assert ranks.ranks == tuple(range(8))
    compute = 2 * 3 * P4_F + (2 * P4_F if recompute == "full" else 0.0) + P4_OPT + listed * P4_COPY
    assert_breakdown(ranks, expected, compute=compute, comm_tp=expected - compute)
