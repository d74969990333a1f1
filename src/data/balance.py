"""Balancing a skewed global batch over a pipeline's data-parallel replicas and micro-batches.

Sequences that hold different images weigh differently on the units that work per image (an
MLLM's encoder and generator). Which sequence runs where does not change what a step learns
(every sequence is trained on once, the loss is the batch's mean) but it does change the
step's critical path: the replicas wait for the slowest at the gradient reduction, and a
pipeline's micro-batches of unequal stage times leave gaps. A balancing policy permutes the
step's sequences over the positions of the batch (BatchLayout: replica r's micro-batch j
holds positions first_sample(r, j) ...):

- none: the data order.
- reorder: DistTrain's two algorithms (src/data/reorder.py): equal-count LPT gives every
  replica the same number of sequences of balanced total seconds (a sequence's size is the
  sum over stages of its per-image seconds); a replica keeps its sequences in data order,
  cut into micro-batches, which Algorithm 3 orders to fill 1F1B's first-stage intervals.
- cost: the cost model's stage times, stage by stage. Each replica is filled to balance
  every stage's total (vector LPT: a sequence goes to the replica whose busiest stage it
  raises least), so the encoder's and the generator's stages are balanced each on its own
  rather than in sum; a replica's sequences form micro-batches of balanced stage times
  (the same rule over its micro-batches); Algorithm 3 orders them.

The costs are linear in a micro-batch's load (a Work's compute scales with its load,
src/costmodel/compute.py): a stage's forward and backward seconds are a fixed part plus,
per unit that works per image, seconds per unit of the micro-batch's mean load over its
sequences. A planner reads these off its plan at the mean load (StageCosts per stage); the
plan carries them (Plan.balancing) so that the real backend places every step's batch by the
same policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from src.batch_layout import BatchLayout
from src.data.reorder import IntervalSim, StageTimes, inter_reorder, lpt
from src.config import BALANCE_POLICIES as POLICIES
from src.errors import ConfigError


@dataclass(frozen=True)
class StageCosts:
    """One pipeline stage's seconds for one micro-batch: `fwd` and `bwd` at no load of the
    per-image units, plus per such unit the seconds per unit of the micro-batch's mean load."""

    fwd: float
    bwd: float
    fwd_per_load: tuple[tuple[str, float], ...] = ()
    bwd_per_load: tuple[tuple[str, float], ...] = ()

    def times(self, loads: Mapping[str, float]) -> tuple[float, float]:
        fwd = self.fwd + sum(seconds * loads[unit] for unit, seconds in self.fwd_per_load)
        bwd = self.bwd + sum(seconds * loads[unit] for unit, seconds in self.bwd_per_load)
        return fwd, bwd

    def per_load(self, unit: str) -> float:
        """Forward plus backward seconds per unit of `unit`'s load."""
        return dict(self.fwd_per_load).get(unit, 0.0) + dict(self.bwd_per_load).get(unit, 0.0)


@dataclass(frozen=True)
class Balancer:
    """The pipeline a batch is balanced for: how its replicas cut the batch (`layout`, no
    sample groups: a group scored together cannot be split) and its stages' costs."""

    layout: BatchLayout
    stages: tuple[StageCosts, ...]

    def __post_init__(self) -> None:
        if self.layout.groups not in (None, self.layout.microbatches):
            raise ConfigError(
                f"train.balance: the batch is cut into {self.layout.groups} sample groups scored together; "
                f"balancing would move sequences between them"
            )
        if not self.stages:
            raise ConfigError("train.balance: a pipeline of no stage")

    @property
    def units(self) -> tuple[str, ...]:
        """The units whose loads the costs read."""
        names = {u for s in self.stages for u, _ in s.fwd_per_load + s.bwd_per_load}
        return tuple(sorted(names))

    def order(self, policy: str, loads: Mapping[str, Sequence[float]]) -> tuple[int, ...]:
        """order[p]: which sequence (in data order) position p of the batch holds."""
        if policy not in POLICIES:
            raise ConfigError(f"train.balance={policy!r}; choose one of {list(POLICIES)}")
        count = self.layout.global_batch
        for unit in self.units:
            if len(loads[unit]) != count:
                raise ConfigError(f"train.balance: {len(loads[unit])} {unit} loads for a batch of {count} sequences")
        if policy == "none":
            return tuple(range(count))
        seconds = self._sequence_seconds(loads)
        fwd, bwd = self._stage_parts(loads)
        if policy == "reorder":
            replicas = [sorted(group) for group in lpt(seconds.sum(axis=1).tolist(), self.layout.dp, equal_count=True)]
            microbatches = [self._cut(members) for members in replicas]
        else:
            replicas = vector_lpt(seconds, range(count), self.layout.dp)
            microbatches = [
                self._cut(members) if self.layout.micro_batch == 1 else vector_lpt(seconds, members, self.layout.microbatches)
                for members in replicas
            ]
        return self._positions([self._ordered(mbs, fwd, bwd) for mbs in microbatches])

    def makespan(self, loads: Mapping[str, Sequence[float]], order: Sequence[int]) -> float:
        """The cost model's iteration: the slowest replica's 1F1B recurrence over its
        micro-batches (communication left out) — what the policies are judged by here; the
        simulator prices the Program itself."""
        layout, worst = self.layout, 0.0
        for replica in range(layout.dp):
            sim = IntervalSim(len(self.stages), layout.microbatches)
            for j in range(layout.microbatches):
                first = layout.first_sample(replica, j)
                sim.place(self.times([order[p] for p in range(first, first + layout.micro_batch)], loads))
            worst = max(worst, sim.makespan)
        return worst

    def times(self, sequences: Sequence[int], loads: Mapping[str, Sequence[float]]) -> StageTimes:
        """A micro-batch's stage times: each unit at its sequences' mean load."""
        mean = {unit: sum(loads[unit][q] for q in sequences) / len(sequences) for unit in self.units}
        fwd, bwd = zip(*(stage.times(mean) for stage in self.stages))
        return StageTimes(tuple(fwd), tuple(bwd))

    def _sequence_seconds(self, loads: Mapping[str, Sequence[float]]) -> np.ndarray:
        """seconds[q, s]: what sequence q adds to stage s (forward and backward) in a
        micro-batch it shares with micro_batch - 1 others."""
        fwd, bwd = self._stage_parts(loads)
        return fwd + bwd

    def _stage_parts(self, loads: Mapping[str, Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
        """Per sequence and stage, its share of a micro-batch's forward and backward seconds
        beyond the fixed part."""
        count, stages = self.layout.global_batch, len(self.stages)
        fwd, bwd = np.zeros((count, stages)), np.zeros((count, stages))
        for unit in self.units:
            column = np.asarray(loads[unit], dtype=float) / self.layout.micro_batch
            for s, stage in enumerate(self.stages):
                fwd[:, s] += dict(stage.fwd_per_load).get(unit, 0.0) * column
                bwd[:, s] += dict(stage.bwd_per_load).get(unit, 0.0) * column
        return fwd, bwd

    def _cut(self, members: list[int]) -> list[list[int]]:
        b = self.layout.micro_batch
        return [members[i : i + b] for i in range(0, len(members), b)]

    def _ordered(self, microbatches: list[list[int]], fwd: np.ndarray, bwd: np.ndarray) -> list[list[int]]:
        """Algorithm 3's order of a replica's micro-batches, timed by their sequences' parts."""
        fixed_fwd = np.array([stage.fwd for stage in self.stages])
        fixed_bwd = np.array([stage.bwd for stage in self.stages])
        rows = np.array(microbatches)
        times = [
            StageTimes(tuple(f), tuple(b))
            for f, b in zip((fixed_fwd + fwd[rows].sum(axis=1)).tolist(), (fixed_bwd + bwd[rows].sum(axis=1)).tolist())
        ]
        order = inter_reorder(times)
        return [microbatches[i] for i in order]

    def _positions(self, replicas: list[list[list[int]]]) -> tuple[int, ...]:
        positions = [0] * self.layout.global_batch
        for replica, microbatches in enumerate(replicas):
            for j, members in enumerate(microbatches):
                first = self.layout.first_sample(replica, j)
                positions[first : first + len(members)] = members
        assert sorted(positions) == list(range(self.layout.global_batch)), "a balancing permutes the batch"
        return tuple(positions)


@dataclass(frozen=True)
class Balancing:
    """A plan's balancing, redone on every step's batch: the policy and the pipeline it
    balances for (the plan's sample order is the first step's)."""

    policy: str
    balancer: Balancer

    def order(self, loads: Mapping[str, Sequence[float]]) -> tuple[int, ...]:
        return self.balancer.order(self.policy, loads)


def vector_lpt(seconds: np.ndarray, members: Sequence[int] | range, groups: int) -> list[list[int]]:
    """`members` over `groups` groups of equal count, each stage's total balanced: largest
    sequence first (by its busiest stage), each to the group whose busiest stage it raises
    least (ties: the lower group). Groups list their members in data order."""
    members = list(members)
    cap = len(members) // groups
    assert cap * groups == len(members), f"{len(members)} sequences do not split into {groups} equal groups"
    rows = seconds[members][:, seconds.any(axis=0)]  # stages no sequence weighs on are left out
    if rows.shape[1] == 0:
        rows = np.zeros((len(members), 1))
    totals = np.zeros((groups, rows.shape[1]))  # a full group's row is infinite: nothing more goes there
    room = [cap] * groups
    out: list[list[int]] = [[] for _ in range(groups)]
    largest_first = np.lexsort((np.asarray(members), -rows.max(axis=1)))
    for i in largest_first.tolist():
        g = int((totals + rows[i]).max(axis=1).argmin())
        totals[g] += rows[i]
        room[g] -= 1
        if room[g] == 0:
            totals[g] = np.inf
        out[g].append(members[i])
    return [sorted(group) for group in out]
