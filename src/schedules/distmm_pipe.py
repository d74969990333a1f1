"""DistMM's pipeline schedules around the batch-sync instruction (DistMM §5.4, Figure 6).

An iteration's micro-batches form `groups` batch-sync groups of `k` micro-batches each
(micro-batch index g·k + j). A group's batch-sync (S) runs the interaction once on the
features of all its micro-batches, so it can only start after the group's last forward
and every backward of the group waits for it: a barrier. The contrastive batch a
batch-sync sees is a whole group; no schedule here splits a group.

- gpipe_sync: per group, its k forwards, S, its k backwards; the next group starts only
  when this one has drained, so every barrier empties and refills the pipeline (the idle
  cycles of Figure 6, top).
- distmm_pipe: the backwards of group g are interleaved with the forwards of group g+1
  (Figure 6, bottom). Stage s keeps k + min(k, P-1-s) forwards ahead of its backwards:
  the next group's forwards fill the time the stage would otherwise spend waiting for
  the gradients of the group behind the barrier. At most two groups are resident, which
  is why DistMM-Pipe's largest contrastive batch is (M·P - M_s)/(2·M_a) (§5.4).

S appears only in the order of the stage holding the features (the last, unless the
tower's projection sits between its layers, as CoCa's text tower's does); stages before
it see the barrier as gradients that arrive late. With one group there is nothing to
interleave and both schedules are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from src.errors import ConfigError

SYNC_SCHEDULES = ("distmm_pipe", "gpipe_sync")


@dataclass(frozen=True, slots=True)
class SyncOp:
    """F/B: forward/backward of micro-batch `microbatch` (of group `group`);
    S: the batch-sync of `group` (microbatch = the group's first micro-batch)."""

    kind: Literal["F", "B", "S"]
    group: int
    microbatch: int

    @property
    def chunk(self) -> int:
        """Towers run no virtual stages: every operation is on chunk 0."""
        return 0


def _check(stages: int, groups: int, k: int) -> None:
    for name, value in (("pipeline stages", stages), ("batch-sync groups", groups), ("micro-batches per group", k)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")


def _with_syncs(order: list[SyncOp], k: int, holds_features: bool) -> list[SyncOp]:
    """Insert each group's S right after its last forward (on the stage holding the features)."""
    if not holds_features:
        return order
    out: list[SyncOp] = []
    for op in order:
        out.append(op)
        if op.kind == "F" and op.microbatch % k == k - 1:
            out.append(SyncOp("S", op.group, op.microbatch - (k - 1)))
    return out


def gpipe_sync(stages: int, groups: int, k: int, sync_stage: int | None = None) -> list[list[SyncOp]]:
    _check(stages, groups, k)
    orders = []
    for stage in range(stages):
        order: list[SyncOp] = []
        for g in range(groups):
            order += [SyncOp("F", g, g * k + j) for j in range(k)]
            order += [SyncOp("B", g, g * k + j) for j in range(k)]
        orders.append(_with_syncs(order, k, stage == (stages - 1 if sync_stage is None else sync_stage)))
    return orders


def distmm_pipe(stages: int, groups: int, k: int, sync_stage: int | None = None) -> list[list[SyncOp]]:
    _check(stages, groups, k)
    total = groups * k
    orders = []
    for stage in range(stages):
        lead = min(total, k + min(k, stages - 1 - stage))
        order = [SyncOp("F", j // k, j) for j in range(lead)]
        for j in range(total):
            order.append(SyncOp("B", j // k, j))
            if lead + j < total:
                order.append(SyncOp("F", (lead + j) // k, lead + j))
        orders.append(_with_syncs(order, k, stage == (stages - 1 if sync_stage is None else sync_stage)))
    return orders


SYNC_BUILDERS: dict[str, Callable[..., list[list[SyncOp]]]] = {
    "distmm_pipe": distmm_pipe,
    "gpipe_sync": gpipe_sync,
}


def build_sync_schedule(name: str, stages: int, groups: int, k: int, sync_stage: int | None = None) -> list[list[SyncOp]]:
    """`sync_stage`: the stage holding the features (default: the last)."""
    if name not in SYNC_BUILDERS:
        raise ConfigError(f"unknown batch-sync schedule {name!r}; choose one of {list(SYNC_BUILDERS)}")
    return SYNC_BUILDERS[name](stages, groups, k, sync_stage)


def resident(order: list[SyncOp]) -> int:
    """Most micro-batches whose forward has run and backward has not, along one order."""
    live = peak = 0
    for op in order:
        if op.kind == "F":
            live += 1
            peak = max(peak, live)
        elif op.kind == "B":
            live -= 1
    return peak


def max_contrastive_batch(memory: float, static: float, activation: float, stages: int) -> float:
    """DistMM §5.4: the largest batch DistMM-Pipe's interaction can see, (M·P - M_s)/(2·M_a),
    for memory M per device, static memory M_s and activation memory M_a per sample of the
    whole model. The paper's intermediate step, (M - M_s/P)/(M_a/(2P)), equals twice this; its
    final form is what the derivation gives: (M·P - M_s)/M_a samples fit a pipeline, and two
    K-groups are resident at once, so half of them."""
    return (memory * stages - static) / (2 * activation)


def max_pipeline_batch(memory: float, static: float, activation: float, stages: int) -> float:
    """DistMM §5.4: the largest micro-batch (the interaction's batch) of 1F1B/GPipe,
    (M - M_s/P)/M_a, bounded by M/M_a whatever P."""
    return (memory - static / stages) / activation
