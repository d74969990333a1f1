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
  (the same rule over its micro-batches); they run in Algorithm 3's order or spread out
  (`spread`: heavy and light alternating evenly), whichever the replica's recurrence
  prices shorter. Algorithm 3 fills the first stage's intervals; where the last stage
  works per image, a heavy micro-batch there stalls every stage before it, and only a
  queue in front of it (the schedule's extra warm-up) lets the light ones after it catch
  up, which they do best spread out.

The recurrence is the plan's 1F1B, its extra warm-up forwards included
(schedules.pipeline). The costs are linear in a micro-batch's load (a Work's compute scales with its load,
src/costmodel/compute.py): a stage's forward and backward seconds are a fixed part plus,
per unit that works per image, seconds per unit of the micro-batch's mean load over its
sequences. A planner reads these off its plan at the mean load (StageCosts per stage); the
plan carries them (Plan.balancing) so that the real backend places every step's batch by the
same policy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from src.batch_layout import BatchLayout
from src.data.reorder import IntervalSim, StageTimes, inter_reorder, lpt
from src.config import BALANCE_POLICIES as POLICIES
from src.errors import ConfigError

if TYPE_CHECKING:  # numpy is imported where a batch is balanced: every plan imports this module, few balance
    import numpy as np

    from src.data.loads import BatchLoads


# The golden ratio's fractional part: its multiples, mod 1, fill [0, 1) most evenly (spread).
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class StageCosts:
    """One pipeline stage's seconds for one micro-batch: `fwd` and `bwd` at no load of the
    per-image units, plus per such unit the seconds per unit of the micro-batch's mean load."""

    fwd: float
    bwd: float
    fwd_per_load: tuple[tuple[str, float], ...] = ()
    bwd_per_load: tuple[tuple[str, float], ...] = ()


def dealt_images(count: int, shares: int) -> tuple[range, ...]:
    """Which of a micro-batch's `count` images (in sequence order) each of `shares` ranks
    runs, dealt out whole as evenly as they go by count: contiguous blocks in order, the
    first count % shares ranks one image more (ranks past the images run none). The plan
    prices a replicated unit by these blocks (busiest_share) and the real backend runs them
    (data.interleaved_mllm.dealt_slots)."""
    size, extra = divmod(count, shares)
    blocks, start = [], 0
    for rank in range(shares):
        end = start + size + (1 if rank < extra else 0)
        blocks.append(range(start, end))
        start = end
    return tuple(blocks)


def busiest_share(images: Sequence[float], shares: int) -> float:
    """The most a rank runs of `images` (each image's load) dealt out over `shares` ranks
    (dealt_images)."""
    return max((sum(images[block.start : block.stop]) for block in dealt_images(len(images), shares) if block), default=0.0)


@dataclass(frozen=True)
class Dealt:
    """A unit replicated over `shares` ranks of its TP group that deals a micro-batch's
    images out whole, built for `images` images a sequence: the busiest rank's images set
    its time (stages.replicated_rows prices ceil(rows / shares) of them at the mean)."""

    unit: str
    shares: int
    images: int

    def load(self, image_loads: Sequence[float], sequences: int = 1) -> float:
        """`sequences` sequences' images (each image's load against the mean sequence) as a
        load against the mean micro-batch of that many sequences, on its busiest rank."""
        at_mean = math.ceil(sequences * self.images / self.shares) / self.images
        return busiest_share(image_loads, self.shares) / at_mean


@dataclass(frozen=True)
class Balancer:
    """The pipeline a batch is balanced for: how its replicas cut the batch (`layout`, no
    sample groups: a group scored together cannot be split), its stages' costs, and the
    units that deal a micro-batch's images out over their ranks (`dealt`: where a micro-batch
    holds one sequence, its load on them is its images' on the busiest rank)."""

    layout: BatchLayout
    stages: tuple[StageCosts, ...]
    dealt: tuple[Dealt, ...] = ()
    extra_warmup: int = 0  # the pipeline's warm-up forwards beyond 1F1B's (schedules.pipeline)

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

    def sequence_loads(self, loads: BatchLoads) -> dict[str, tuple[float, ...]]:
        """Each sequence's load on each unit the costs read: where micro-batches hold one
        sequence, its images' on the busiest rank for a unit of `dealt` (exact); otherwise
        its load against the mean sequence. A micro-batch of several deals their images out
        together, so a sequence's rounding up to whole images on the busiest rank is not
        its own: its images count in proportion (a sequence of one image weighs an eighth of
        one of eight on eight ranks, where alone both cost the busiest rank one image)."""
        dealt = {d.unit: d for d in self.dealt} if self.layout.micro_batch == 1 else {}
        out = {}
        for unit in self.units:
            if unit in dealt:
                out[unit] = tuple(dealt[unit].load(images) for images in loads.per_image(unit))
            else:
                out[unit] = loads.of(unit) or ()
        return out

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
        fwd, bwd = self._stage_parts(loads)
        seconds = fwd + bwd  # what each sequence adds to each stage, forward and backward
        if policy == "reorder":
            replicas = [sorted(group) for group in lpt(seconds.sum(axis=1).tolist(), self.layout.dp, equal_count=True)]
            microbatches = [self._cut(members) for members in replicas]
        else:
            replicas = vector_lpt(seconds, range(count), self.layout.dp)
            microbatches = [
                self._cut(members) if self.layout.micro_batch == 1 else vector_lpt(seconds, members, self.layout.microbatches)
                for members in replicas
            ]
        if policy == "reorder":
            return self._positions([self._ordered(mbs, fwd, bwd) for mbs in microbatches])
        return self._positions(self._ordered_by_cost(microbatches, fwd, bwd))

    def makespan(self, loads: Mapping[str, Sequence[float]], order: Sequence[int]) -> float:
        """The cost model's iteration: the slowest replica's 1F1B recurrence over its
        micro-batches (communication left out) — what the policies are judged by here; the
        simulator prices the Program itself."""
        return max(self.replica_makespans(loads, order))

    def replica_makespans(
        self, loads: Mapping[str, Sequence[float]], order: Sequence[int], replicas: Sequence[int] | None = None
    ) -> list[float]:
        """Each replica's 1F1B recurrence over its micro-batches (`replicas`: these only)."""
        layout, spans = self.layout, []
        fwd, bwd = self._stage_parts(loads)
        for replica in range(layout.dp) if replicas is None else replicas:
            firsts = [layout.first_sample(replica, j) for j in range(layout.microbatches)]
            spans.append(self._span(self._times([list(order[p : p + layout.micro_batch]) for p in firsts], fwd, bwd)))
        return spans

    def _span(self, times: Sequence[StageTimes]) -> float:
        """One replica's recurrence over its micro-batches' times, in that order."""
        sim = IntervalSim(len(self.stages), len(times), self.extra_warmup)
        for each in times:
            sim.place(each)
        return sim.makespan

    def times(self, sequences: Sequence[int], loads: Mapping[str, Sequence[float]]) -> StageTimes:
        """A micro-batch's stage times: each unit at its sequences' mean load."""
        return self._times([list(sequences)], *self._stage_parts(loads))[0]

    def times_alone(self, loads: Mapping[str, Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
        """Per sequence and stage, its forward and backward seconds as a micro-batch of its own."""
        import numpy as np

        fwd, bwd = self._stage_parts(loads)
        return fwd * self.layout.micro_batch + np.array(self._fixed_fwd), bwd * self.layout.micro_batch + np.array(self._fixed_bwd)

    def _stage_parts(self, loads: Mapping[str, Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
        """Per sequence and stage, its share of a micro-batch's forward and backward seconds
        beyond the fixed part (a micro-batch's time is the fixed part plus its sequences')."""
        import numpy as np

        count, stages = self.layout.global_batch, len(self.stages)
        fwd, bwd = np.zeros((count, stages)), np.zeros((count, stages))
        for unit in self.units:
            column = np.asarray(loads[unit], dtype=float) / self.layout.micro_batch
            for s, stage in enumerate(self.stages):
                fwd[:, s] += dict(stage.fwd_per_load).get(unit, 0.0) * column
                bwd[:, s] += dict(stage.bwd_per_load).get(unit, 0.0) * column
        return fwd, bwd

    def _times(self, microbatches: list[list[int]], fwd: np.ndarray, bwd: np.ndarray) -> list[StageTimes]:
        """Each micro-batch's stage times, from its sequences' parts (_stage_parts)."""
        import numpy as np

        rows = np.array(microbatches)
        forward = (fwd[rows].sum(axis=1) + self._fixed_fwd).tolist()
        backward = (bwd[rows].sum(axis=1) + self._fixed_bwd).tolist()
        return [StageTimes(tuple(f), tuple(b)) for f, b in zip(forward, backward)]

    @functools.cached_property
    def _fixed_fwd(self) -> tuple[float, ...]:
        return tuple(stage.fwd for stage in self.stages)

    @functools.cached_property
    def _fixed_bwd(self) -> tuple[float, ...]:
        return tuple(stage.bwd for stage in self.stages)

    def _cut(self, members: list[int]) -> list[list[int]]:
        b = self.layout.micro_batch
        return [members[i : i + b] for i in range(0, len(members), b)]

    def _ordered(self, microbatches: list[list[int]], fwd: np.ndarray, bwd: np.ndarray) -> list[list[int]]:
        """Algorithm 3's order of a replica's micro-batches."""
        return [microbatches[i] for i in inter_reorder(self._times(microbatches, fwd, bwd))]

    def _ordered_by_cost(self, replicas: list[list[list[int]]], fwd: np.ndarray, bwd: np.ndarray) -> list[list[list[int]]]:
        """Each replica's micro-batches in Algorithm 3's order or the spread one, whichever
        its recurrence prices shorter (Algorithm 3's on a tie); every replica's two timed at
        once (order_search.makespans)."""
        import numpy as np

        from src.data.order_search import makespans, time_tables

        times = [self._times(microbatches, fwd, bwd) for microbatches in replicas]
        firsts = [inter_reorder(each) for each in times]
        spreads = [spread([sum(t.fwd) + sum(t.bwd) for t in each]) for each in times]
        count = len(replicas)
        spans = makespans(time_tables(times), np.tile(np.arange(count), 2), np.array(firsts + spreads), self.extra_warmup)
        best = [first if spans[g] <= spans[count + g] else other for g, (first, other) in enumerate(zip(firsts, spreads))]
        return [[microbatches[i] for i in order] for microbatches, order in zip(replicas, best)]

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

    @property
    def units(self) -> tuple[str, ...]:
        return self.balancer.units

    def order(self, loads: Mapping[str, Sequence[float]]) -> tuple[int, ...]:
        return self.balancer.order(self.policy, loads)

    def place(self, loads: BatchLoads) -> tuple[int, ...]:
        """The order of a batch whose sequences weigh `loads`."""
        return self.order(self.balancer.sequence_loads(loads))


def spread(seconds: Sequence[float]) -> list[int]:
    """An order of items weighing `seconds` in which every stretch holds heavy and light
    alike: heaviest first (ties: the lower index), each at the next position of a
    low-discrepancy sequence over the order (the golden ratio's multiples, mod 1)."""
    n = len(seconds)
    heaviest_first = sorted(range(n), key=lambda i: (-seconds[i], i))
    positions = sorted(range(n), key=lambda r: ((r * GOLDEN) % 1.0, r))
    order = [0] * n
    for position, item in zip(positions, heaviest_first):
        order[position] = item
    return order


def vector_lpt(seconds: np.ndarray, members: Sequence[int] | range, groups: int) -> list[list[int]]:
    """`members` over `groups` groups of equal count, each stage's total balanced: largest
    sequence first (by its busiest stage), each to the group whose busiest stage it raises
    least (ties: the lower group). Groups list their members in data order."""
    import numpy as np

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
