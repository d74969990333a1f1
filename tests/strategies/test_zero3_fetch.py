"""ZeRO-3's parameter fetch as each DeepSpeed release ran it (strategy.zero3_fetch, by
default the named strategy.deepspeed_version's), and the per-GPU traffic of one
micro-batch per GPU, which does not depend on the number of GPUs."""

from __future__ import annotations

import pytest

from dataclasses import replace

from src.costmodel.compute import ComputeModel
from src.errors import ConfigError
from src.program import Collective, Compute, Plan
from src.setup import Setup, plan_run, validate
from src.strategies.ddp import DDPOptions
from tests.composing import composed

# A GPT of 2 blocks, hidden 512: QKV 512 x 1536, projection 512 x 512, MLP 512 x 2048 and back
# (above DeepSpeed's 1e5-element persistence threshold: fetched); biases and norms (512, 1536,
# 2048 elements) stay whole. The embedding (1024 + 128 positions) x 512 is one module, the tied
# head's projection another.
BLOCK = 512 * 1536 + 512 * 512 + 2 * 512 * 2048
EMBEDDING = (1024 + 128) * 512
HEAD = 512 * 1024
FETCHED = 2 * BLOCK + EMBEDDING + HEAD


def _plan(gpus: int, batch: int, *extra: str) -> tuple[Plan, Setup]:
    setup = validate(
        composed(
            [
                "model=gpt",
                "model.preset=null",
                "model.layers=2",
                "model.hidden=512",
                "model.heads=8",
                "model.vocab=1024",
                "train.seq_len=128",
                "cluster=dgx_a100",
                f"cluster.nodes={gpus // 8}",
                f"train.global_batch={batch}",
                "train.precision=bf16",
                "strategy=ddp",
                "strategy.zero_stage=3",
                "strategy.recompute=full",
                "strategy.overlap_comm=true",
                "logger=none",
                *extra,
            ]
        )
    )
    return plan_run(setup), setup


@pytest.mark.parametrize(
    "version, fetch",
    [(None, "prefetched"), ("0.3.15", "per_tensor"), ("0.5.4", "per_tensor"), ("0.5.5", "coalesced"), ("0.6.0", "prefetched")],
)
def test_the_fetch_follows_the_named_deepspeed_release(version: str | None, fetch: str) -> None:
    assert DDPOptions(zero_stage=3, deepspeed_version=version).fetch == fetch
    assert DDPOptions(zero_stage=3, deepspeed_version=version, zero3_fetch="coalesced").fetch == "coalesced"


@pytest.mark.parametrize("key, value", [("deepspeed_version", "0.3"), ("deepspeed_version", "v0.3.15"), ("zero3_fetch", "lazy")])
def test_a_bad_release_or_fetch_is_refused_in_one_line(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^strategy.{key}") as err:
        _plan(8, 8, f"strategy.{key}={value}")
    assert "\n" not in str(err.value)


def test_before_0_5_5_every_gather_blocks_and_nothing_is_prefetched() -> None:
    old, _ = _plan(8, 8, "strategy.deepspeed_version=0.3.15")
    new, _ = _plan(8, 8)
    gathers = [i for i in old.program.classes[0].instructions if isinstance(i, Collective) and i.op == "all_gather"]
    assert gathers and all(i.blocking for i in gathers)
    assert old.units[0].prefetch_params == 0 and new.units[0].prefetch_params > 0
    assert any(not i.blocking for i in new.program.classes[0].instructions if isinstance(i, Collective) and i.op == "all_gather")
    # DeepSpeed issued the gradients' reduce-scatters asynchronously (overlap_comm), but the next
    # fetch's device-wide synchronize waits for them: they block, and before 0.6.0 there is one
    # per trained tensor (a block's four weights and biases, two norms' scales and shifts);
    # a prefetching release overlaps them, one per layer.
    for version in ("0.3.15", "0.5.5"):
        plan, _ = _plan(8, 8, f"strategy.deepspeed_version={version}")
        scatters = [i for i in plan.program.classes[0].instructions if isinstance(i, Collective) and i.op == "reduce_scatter"]
        assert scatters and all(i.blocking for i in scatters) and max(i.count for i in scatters) == 12
    scatters = [i for i in new.program.classes[0].instructions if isinstance(i, Collective) and i.op == "reduce_scatter"]
    assert scatters and all(not i.blocking and i.count == 1 for i in scatters)
    fetching = [i.work for i in old.program.classes[0].instructions if isinstance(i, Compute) and i.work.fetches]
    assert fetching and all(w.fetch_blocking for w in fetching)


def test_a_blocking_fetch_waits_on_the_host_and_a_prefetched_one_hides_under_the_kernels() -> None:
    # 512 samples a micro-batch: a block's kernels outlast their host's issuing them.
    plan, setup = _plan(8, 4096, "strategy.deepspeed_version=0.3.15", "strategy.micro_batch_size=512")
    block = next(i for i, layer in enumerate(setup.model.unit("llm").layers) if layer.name == "block")
    computes = [i.work for i in plan.program.classes[0].instructions if isinstance(i, Compute)]
    work = next(w for w in computes if w.fetches and w.layers == (block, block + 1))
    compute = ComputeModel(setup.cluster, "bf16")
    host = work.fetches * setup.cluster.host_fetch_s
    assert setup.cluster.host_fetch_s > 0
    assert work.fetch_copies == 8  # one copy out per rank of the group
    plain = replace(work, fetch_copies=0)
    blocking = compute.work_time(plain, setup.model)
    overlapped = compute.work_time(replace(plain, fetch_blocking=False), setup.model)
    assert blocking == pytest.approx(host + compute.work_time(replace(plain, fetches=0, fetched=0.0), setup.model))
    assert overlapped < blocking
    # The zero fill and the copies out: three passes over the gathered bytes, and a kernel each.
    cluster = setup.cluster
    copies = (
        3 * work.fetched * 2 / (cluster.memory_bandwidth * cluster.memory_efficiency) + work.fetches * 9 * cluster.kernel_overhead_s
    )
    # ... and on the host, the list of 8 partitions built and copied entry by entry, waited for.
    entries = work.fetches * 8 * cluster.host_list_entry_s
    assert cluster.host_list_entry_s > 0
    assert compute.work_time(work, setup.model) == pytest.approx(blocking + copies + entries)


def test_a_list_reduce_scatter_flattens_its_gradients_rank_by_rank() -> None:
    plan, setup = _plan(8, 8, "strategy.deepspeed_version=0.5.5")
    block = next(i for i, layer in enumerate(setup.model.unit("llm").layers) if layer.name == "block")
    works = [i.work for i in plan.program.classes[0].instructions if isinstance(i, Compute) and i.work.layers == (block, block + 1)]
    (work,) = [w for w in works if w.scatters]
    assert work.phase == "bwd" and (work.scatters, work.scatter_copies) == (12, 8)
    assert work.scattered == setup.model.unit("llm").trainable_params(block, block + 1)
    cluster = replace(setup.cluster, host_list_entry_s=0.0)
    compute = ComputeModel(cluster, "bf16")
    copies = 2 * work.scattered * 2 / (cluster.memory_bandwidth * cluster.memory_efficiency) + 12 * 8 * cluster.kernel_overhead_s
    assert compute.work_time(work, setup.model) == pytest.approx(compute.work_time(replace(work, scatters=0), setup.model) + copies)
    # The lists are built on the host after the backward's kernels are issued, while they run:
    # where the host is the longer, each entry adds its time.
    slow, slower = (ComputeModel(replace(cluster, host_list_entry_s=e), "bf16").work_time(work, setup.model) for e in (1e-3, 2e-3))
    assert slower - slow == pytest.approx(12 * 8 * 1e-3)
    prefetching, _ = _plan(8, 8)
    assert not any(i.work.scatters for i in prefetching.program.classes[0].instructions if isinstance(i, Compute))


def test_tensor_by_tensor_a_partitioned_norm_is_two_gathers() -> None:
    per_tensor, _ = _plan(8, 8, "strategy.zero3_fetch=per_tensor", "strategy.param_persistence_threshold=0")
    coalesced, _ = _plan(8, 8, "strategy.zero3_fetch=coalesced", "strategy.param_persistence_threshold=0")

    def gathers(plan: Plan) -> int:
        return sum(i.count for i in plan.program.classes[0].instructions if isinstance(i, Collective) and i.op == "all_gather")

    # Each block has two norms (two tensors each), the head its final norm: 5 more per pass.
    assert gathers(per_tensor) - gathers(coalesced) == 2 * (2 * 2 + 1)


def _traffic(plan: Plan, op: str) -> float:
    """Bytes one rank's collectives of `op` move over its links: (g - 1) / g of each buffer."""
    out = 0.0
    for i in plan.program.classes[0].instructions:
        if isinstance(i, Collective) and i.op == op:
            g = len(plan.program.groups[i.group].ranks)
            out += i.count * i.bytes * (g - 1) / g
    return out


def test_one_micro_batch_per_gpu_moves_the_same_bytes_per_gpu_at_768_and_1536_gpus() -> None:
    """SC21's ZeRO-3 rows run one micro-batch per GPU (batch 1536 on 768 GPUs of 2, on 1536
    of 1): each GPU gathers every fetched parameter for its forward and again for its
    recomputed forward and backward (bf16: 2 bytes each), and reduce-scatters every
    trained parameter's gradient once, whatever the group; its compute halves."""
    half, setup = _plan(768, 1536, "strategy.deepspeed_version=0.3.15")
    full, _ = _plan(1536, 1536, "strategy.deepspeed_version=0.3.15")
    assert half.units[0].micro_batch == 2 and full.units[0].micro_batch == 1
    assert half.units[0].num_microbatches == full.units[0].num_microbatches == 1
    trained = setup.model.unit("llm").trainable_params(0, setup.model.unit("llm").num_layers)
    for plan, g in ((half, 768), (full, 1536)):
        assert _traffic(plan, "all_gather") == pytest.approx(2 * FETCHED * 2 * (g - 1) / g)
        assert _traffic(plan, "reduce_scatter") == pytest.approx(trained * 2 * (g - 1) / g)
    assert _traffic(half, "all_gather") / _traffic(full, "all_gather") == pytest.approx((767 / 768) / (1535 / 1536))
    for plan, mb in ((half, 2), (full, 1)):
        works = [i.work for i in plan.program.classes[0].instructions if isinstance(i, Compute)]
        assert {w.samples for w in works if w.phase != "optimizer"} == {mb}
