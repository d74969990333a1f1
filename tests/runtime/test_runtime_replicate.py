"""An MLLM's encoder and generator replicated over their TP group on six real workers:
each rank of the group runs the whole ViT (or U-Net) on its share of every micro-batch and
reduces its gradients over the group's and the replicas' ranks; the first losses equal one
process's. On sequences alike a share is a block of the micro-batch's rows (half of them,
or with micro-batches of one sequence the row or none); on sequences of their own images
(interleaved data, from a tar shard) it is the images dealt to it, as the plan prices them
(runtime.row_shares): a share may run part of a sequence's images, or none.

- Megatron-LM (DistTrain §2.1's rigid baseline), tp=2 x pp=3: a replicated stage hands
  what it made to the LLM's TP ranks (which all-gather it); so too under ZeRO-1 with the
  sequences placed by train.balance=cost, under cost with two more warm-up forwards in
  front of the generator's stage (strategy.extra_warmup), and with micro-batches of one sequence, fewer
  rows than TP ranks, each rank's part of the hand-on the images dealt to it (on sequences
  alike under ZeRO-1, its block of rows: the row or none); and with the
  generator alone replicated after an encoder on a TP stage of its own, whose ranks each
  send an equal chunk of the micro-batch's packed image tokens.
- DistTrain as its §8.1 runs it (strategy.replicate): the encoder (2 ranks), the LLM (2
  replicas of one rank) and the generator (2 ranks) on disjoint ranks, joined by brokers; a
  replicated unit's ranks all-gather their shares before its broker sends the micro-batch
  whole, and a receiving one's broker shares what it got with its peers; so too with
  micro-batches of one sequence dealt over two GPUs (on sequences alike too), with the encoder frozen, with the
  generator replicated alone, and with the LLM on tp=2 between them.

One launch of six workers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from src.data.balance import dealt_images
from src.models.registry import build_model
from src.runtime.inputs import dataset_for
from src.plan_io import read_plan
from src.program import Compute
from src.runtime.reference import reference_losses
from tests.runtime.support import launch_cases, mllm_shard, sensitive, sensitive_optimizer, summary_of, trace_events

pytestmark = pytest.mark.slow  # starts worker processes

STEPS = 3
BATCH = 8
WORKERS = 6
MICRO_BATCH = 2
COLLECTIVE_OPS = ("all_gather", "broadcast", "all_reduce", "reduce_scatter")
MEGATRON = [
    "model=mllm_9b",
    "model.scale=tiny",
    "strategy=megatron",
    "strategy.tp=2",
    "strategy.pp=3",
    f"strategy.micro_batch_size={MICRO_BATCH}",
    "strategy.sequence_parallel=false",
    "strategy.recompute=none",
    "strategy.replicate=[encoder,generator]",
]
DISTTRAIN = ["model=mllm_9b", "model.scale=tiny", "strategy=disttrain", "strategy.generator.tp=2"]
BOTH = ["strategy.replicate=[encoder,generator]", "strategy.encoder.tp=2"]
# Encoder and generator micro-batches of two sequences (one of each LLM replica's), each
# dealt over its unit's two ranks.
TWO_REPLICAS = ["strategy.llm.tp=1", "strategy.llm.pp=1", "strategy.llm.dp=2"]
# One LLM replica on two stages: the encoder's and generator's micro-batches hold one
# sequence each, whose images their two ranks deal out (a rank may run none).
ONE_REPLICA = ["strategy.llm.tp=1", "strategy.llm.pp=2", "strategy.llm.dp=1"]
# The generator replicated alone, after an encoder of two data-parallel replicas.
GENERATOR_ONLY = ["strategy.replicate=[generator]", "strategy.encoder.dp=2"]
# One LLM replica on tp=2 between the replicated units: its brokers' lead shares with a TP peer too.
LLM_TP2 = ["strategy.llm.tp=2", "strategy.llm.pp=1", "strategy.llm.dp=1", "strategy.llm.sequence_parallel=false"]
BASE = [
    "backend=torch",
    "cluster=local",
    f"cluster.devices_per_node={WORKERS}",
    "logger=none",
    f"train.global_batch={BATCH}",
    f"train.steps={STEPS}",
    *sensitive(0.3),
]
# Images per sample of the shard: micro-batch 0's three images deal 2 and 1, the second
# sequence's split between the shares; micro-batch 1's one leaves the second share none;
# micro-batch 2's one sequence of three deals 2 and 1; micro-batch 3 holds none.
SHARD_IMAGES = [1, 2, 0, 1, 3, 0, 0, 0]
# Every image at the encoder's nominal side (a shard's are).
INTERLEAVED_MODEL = {"name": "mllm_9b", "scale": "tiny", "images_per_sequence": 2, "image_size_spread": 0}
IN_ORDER = ["strategy.zero_stage=0", "strategy.reorder=none"]
# A share left out of a collective fails the run soon (backend.timeout_s).
SHARD = [
    "train.data=interleaved",
    "backend.data=SHARDS",
    "model.images_per_sequence=2",
    "model.image_size_spread=0",
    "backend.timeout_s=60",
]
CASES = {
    "replicated": MEGATRON + ["train.data=uniform", "strategy.zero_stage=0"],
    # The distributed optimizer's partitions span a replicated stage's TP and DP ranks.
    "replicated_zero1": MEGATRON + ["train.data=uniform", "strategy.zero_stage=1"],
    "interleaved": MEGATRON + SHARD + ["strategy.zero_stage=0"],
    # Micro-batches of one sequence (DistTrain's rigid baseline runs micro-batch 1, §8.1):
    # fewer rows than TP ranks, so each part of a scattered transfer is a share's images.
    "interleaved_one_sequence": [o for o in MEGATRON if not o.startswith("strategy.micro_batch_size")]
    + SHARD
    + ["strategy.micro_batch_size=1", "strategy.zero_stage=0"],
    # The encoder on a TP stage of its own, the generator replicated, micro-batches of one
    # sequence: the encoder's stage sends each TP rank's equal chunk of its packed image tokens.
    "interleaved_encoder_tp2_one_sequence": [
        o for o in MEGATRON if not o.startswith(("strategy.micro_batch_size", "strategy.replicate"))
    ]
    + SHARD
    + ["strategy.micro_batch_size=1", "strategy.replicate=[generator]", "strategy.modality_stages=extra", "strategy.zero_stage=0"],
    # Sequences alike in micro-batches of one: the first rank of the group runs the row, the
    # second none; ZeRO-1's partitions span both.
    "replicated_one_sequence_zero1": [o for o in MEGATRON if not o.startswith("strategy.micro_batch_size")]
    + ["train.data=uniform", "strategy.micro_batch_size=1", "strategy.zero_stage=1"],
    # ZeRO-1's partitions over the dealt shares, and the cost policy placing the sequences.
    "interleaved_zero1_cost": MEGATRON + SHARD + ["strategy.zero_stage=1", "train.balance=cost"],
    # Two more warm-up forwards on the encoder's and the LLM's stages, so sequences queue in front of
    # the generator's; the cost policy ordering them for that schedule.
    "interleaved_one_sequence_cost_extra_warmup": [o for o in MEGATRON if not o.startswith("strategy.micro_batch_size")]
    + SHARD
    + ["strategy.micro_batch_size=1", "strategy.zero_stage=0", "train.balance=cost", "strategy.extra_warmup=2"],
    "disttrain": DISTTRAIN + BOTH + TWO_REPLICAS + ["train.data=uniform", *IN_ORDER],
    "disttrain_interleaved": DISTTRAIN + BOTH + TWO_REPLICAS + SHARD + IN_ORDER,
    "disttrain_interleaved_zero1_cost": DISTTRAIN + BOTH + TWO_REPLICAS + SHARD + ["strategy.zero_stage=1", "train.balance=cost"],
    "disttrain_one_sequence": DISTTRAIN + BOTH + ONE_REPLICA + SHARD + IN_ORDER,
    "disttrain_one_sequence_uniform": DISTTRAIN + BOTH + ONE_REPLICA + ["train.data=uniform", *IN_ORDER],
    # Fig. 19's frozen encoder: its broker still gathers the shares' states, and no gradient returns to it.
    "disttrain_frozen_encoder": DISTTRAIN + BOTH + TWO_REPLICAS + SHARD + IN_ORDER + ["model.frozen=[encoder]"],
    "disttrain_generator_only": DISTTRAIN + GENERATOR_ONLY + TWO_REPLICAS + SHARD + IN_ORDER,
    "disttrain_llm_tp2": DISTTRAIN + BOTH + LLM_TP2 + SHARD + IN_ORDER,
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("shards")
    mllm_shard(root / "shard-0.tar", SHARD_IMAGES)
    return f"{root}/shard-*.tar"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shards) -> dict[str, Path]:
    cases = {name: BASE + [o.replace("SHARDS", shards) for o in extra] for name, extra in CASES.items()}
    return launch_cases(tmp_path_factory.mktemp("replicate"), cases, WORKERS)


@pytest.fixture(scope="module")
def references(shards) -> dict[str, list[float]]:
    uniform = reference_losses(build_model({"name": "mllm_9b", "scale": "tiny"}), 0, BATCH, STEPS, sensitive_optimizer(0.3))
    interleaved = reference_losses(
        build_model(INTERLEAVED_MODEL), 0, BATCH, STEPS, sensitive_optimizer(0.3), data=shards, content="interleaved"
    )
    frozen = reference_losses(
        build_model({**INTERLEAVED_MODEL, "frozen": ["encoder"]}),
        0,
        BATCH,
        STEPS,
        sensitive_optimizer(0.3),
        data=shards,
        content="interleaved",
    )
    return {"uniform": uniform, "interleaved": interleaved, "interleaved_frozen_encoder": frozen}


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, references, case):
    data = "interleaved" if "train.data=interleaved" in CASES[case] else "uniform"
    reference = references[data + ("_frozen_encoder" if "model.frozen=[encoder]" in CASES[case] else "")]
    assert summary_of(runs[case])["measured"]["loss"] == pytest.approx(reference, rel=1e-4)
    assert reference[-1] != pytest.approx(reference[0], rel=1e-3)  # it trains, so equality says something


@pytest.mark.parametrize("case", ["interleaved_zero1_cost", "disttrain_interleaved_zero1_cost"])
def test_the_cost_policy_moved_the_sequences_it_trains_as_one_process(runs, case):
    order = read_plan(runs[case] / "plan.json").plan.sample_order
    assert order is not None and sorted(order) == list(range(BATCH)) and list(order) != sorted(order)


def test_the_shard_s_micro_batches_deal_unevenly_and_leave_a_share_none(shards):
    """What the interleaved case's equality covers, read off its data: dealt images that
    are not a rows share's, an uneven deal, and a share of no image."""
    dataset = dataset_for(build_model(INTERLEAVED_MODEL), 0, shards, content="interleaved")
    counts = [dataset.image_count(i) for i in range(BATCH)]
    assert counts == SHARD_IMAGES
    micro_batches = [counts[p : p + MICRO_BATCH] for p in range(0, BATCH, MICRO_BATCH)]
    dealt = [[len(block) for block in dealt_images(sum(held), 2)] for held in micro_batches]
    assert any(len(set(shares)) > 1 for shares in dealt)
    assert any(sum(held) and 0 in shares for held, shares in zip(micro_batches, dealt))
    assert any(shares != held for held, shares in zip(micro_batches, dealt))  # not the rows' images


@pytest.mark.parametrize("case", ["replicated", "replicated_one_sequence_zero1", "interleaved", "interleaved_one_sequence"])
def test_replicated_stages_split_rows_and_run_no_tp_collective(runs, case):
    summary = summary_of(runs[case])
    units = summary["plan"]["units"]
    for name in ("encoder", "generator"):
        assert units[name]["mesh"] == {"rows": 2, "dp": 1, "pp": 1} and units[name]["tp"] == 1
    assert units["llm"]["mesh"] == {"tp": 2, "dp": 1, "pp": 1}
    events = trace_events(runs[case])
    # The LLM's stage all-gathers the encoder's rows (forward) and the generator's gradients
    # (backward); the replicated stages gather nothing and hold no TP group.
    gathers = {e["name"] for e in events if e.get("name", "").startswith("all_gather")}
    assert gathers == {"all_gather tp.s1"}, sorted(gathers)


@pytest.mark.parametrize("case", ["disttrain", "disttrain_interleaved", "disttrain_interleaved_zero1_cost"])
def test_disttrain_s_replicated_units_gather_their_shares_for_their_broker_and_share_what_it_receives(runs, case):
    summary = summary_of(runs[case])
    units = summary["plan"]["units"]
    for name in ("encoder", "generator"):
        assert units[name]["mesh"] == {"rows": 2, "dp": 1, "pp": 1} and units[name]["tp"] == 1
    assert units["llm"]["mesh"] == {"tp": 1, "dp": 2, "pp": 1}
    assert units["encoder"]["micro_batch"] == units["generator"]["micro_batch"] == 2
    events = trace_events(runs[case])
    collectives = Counter(e["name"] for e in events if e.get("name", "").split(" ")[0] in COLLECTIVE_OPS)
    # Per micro-batch: the encoder's ranks gather their images' states for the broker to the
    # LLM and share the gradient it brings back; the generator's share the LLM's states its
    # broker receives and gather their gradients for it. No other collective inside a unit.
    microbatches = units["encoder"]["num_microbatches"]
    assert collectives == {
        f"{op} {unit}.tp.s0": microbatches
        for op, unit in (("all_gather", "encoder"), ("broadcast", "encoder"), ("broadcast", "generator"), ("all_gather", "generator"))
    }


def test_disttrain_s_replicated_units_deal_out_micro_batches_of_one_sequence(runs):
    """The plan prices the busiest rank's share of a sequence's images (a fraction of a
    micro-batch, not a chunk of a pass): each rank runs its dealt images once."""
    units = summary_of(runs["disttrain_one_sequence"])["plan"]["units"]
    assert units["encoder"]["micro_batch"] == units["generator"]["micro_batch"] == 1
    assert units["encoder"]["mesh"]["rows"] == units["generator"]["mesh"]["rows"] == 2
    program = read_plan(runs["disttrain_one_sequence"] / "plan.json").plan.program
    passes = [i.work for c in program.classes for i in c.instructions if isinstance(i, Compute) and i.work.unit == "encoder"]
    assert {w.fraction for w in passes if w.phase in ("fwd", "bwd")} == {0.5}


def test_a_frozen_replicated_encoder_gathers_for_its_broker_and_gets_no_gradient_back(runs):
    events = trace_events(runs["disttrain_frozen_encoder"])
    encoder = {e["name"] for e in events if e.get("name", "").endswith(" encoder.tp.s0")}
    assert encoder == {"all_gather encoder.tp.s0"}
