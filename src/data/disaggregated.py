"""Which sequence each position of a disaggregated MLLM's global batch holds (DistTrain's
reorderings), and the loads that follow.

Position p = j * DP_lm + r is LLM replica r's micro-batch j (micro-batches of one
sequence); encoder replica e's micro-batch j holds positions j * DP_lm + e * b_me ...
+ b_me - 1 (b_me = DP_lm / DP_me), the generator's likewise. A reordering permutes the
batch's sequences over these positions only (§6), so every sequence is still trained on
once per step.

- none: the data order (the layouts are drawn independently, so it is random).
- intra (Algorithm 2): equal-count LPT gives every LLM replica m sequences of balanced
  total size (a sequence's size is its encoder plus generator seconds); the encoder's and
  generator's replicas, unions of consecutive LLM replicas, are balanced with them. A
  replica keeps its sequences in data order.
- inter (Algorithm 3): LLM replicas joined through a shared encoder or generator replica
  form one pipeline (lcm(b_me, b_mg) consecutive replicas); its micro-batch slots (one
  sequence per member replica, members' sequences sorted by size so that a slot holds
  like sizes) are ordered by Algorithm 3 on the slots' stage times, a slot's encoder
  and generator stages taking its slowest replica's load.
- both: intra, then inter.
- cost: the cost model's balance (src/data/balance.py, policy cost): vector LPT gives every
  LLM replica m sequences whose encoder seconds and generator seconds are balanced each on
  its own, not in sum; then slots whose shared encoder and generator micro-batches are
  balanced (a micro-batch of several sequences costs their sum: more so where its images
  are dealt out over a replicated unit's GPUs), ordered by Algorithm 3 and the order search;
  or both's placement, its order searched on likewise, where the recurrence of the chain's
  own orders (order_search: an interleaved LLM's virtual stages on their stages) prices its
  slowest pipeline shorter.

A plan carries its reordering (Reordering: the policy, the units' replicas and the stage
costs it was decided on) so that the real backend places every step's batch the way the
planner places that batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from src.data.balance import Dealt, vector_lpt
from src.data.reorder import StageTimes, inter_reorder, lpt
from src.schedules.chain import Chain

if TYPE_CHECKING:
    from src.data.loads import BatchLoads, PerImage

REORDERS = ("none", "intra", "inter", "both", "cost")
# train.balance's policies as DistTrain's reorderings: its own algorithms are `reorder`.
BALANCE_REORDERS = {"none": "none", "reorder": "both", "cost": "cost"}


@dataclass(frozen=True)
class Assignment:
    """positions[p] = the index (in data order) of the sequence at position p."""

    positions: tuple[int, ...]
    dp_lm: int

    def sequences(self, microbatch: int, first: int, count: int) -> tuple[int, ...]:
        start = microbatch * self.dp_lm + first
        return self.positions[start : start + count]


@dataclass(frozen=True)
class Reordering:
    """A plan's reordering, redone on every step's batch. per_sequence: the encoder's and
    the generator's seconds (forward and backward) per sequence at unit load; fwd, bwd:
    every virtual stage's seconds for one micro-batch at unit load, the encoder's, the
    LLM's, then the generator's (a slot's encoder and generator stages scale with its
    load); chain: the units' stages and virtual stages per stage, whose orders the
    pipeline runs (schedules.chain)."""

    policy: str
    dp_lm: int
    dp_me: int
    dp_mg: int
    per_sequence: tuple[float, float]
    fwd: tuple[tuple[float, ...], ...]
    bwd: tuple[tuple[float, ...], ...]
    chain: Chain

    def __post_init__(self) -> None:
        if self.policy not in REORDERS:
            raise ValueError(f"reordering {self.policy!r}: one of {list(REORDERS)}")
        if len(self.fwd) != 3 or len(self.bwd) != 3:
            raise ValueError(f"a reordering's stages are the encoder's, the LLM's and the generator's, not {len(self.fwd)} units")
        virtual = [pp * vpp for pp, vpp in self.chain.units]
        if virtual != [len(f) for f in self.fwd] or virtual != [len(b) for b in self.bwd]:
            raise ValueError(f"a chain of {virtual} virtual stages per unit over {[len(f) for f in self.fwd]} stages' times")

    @property
    def units(self) -> tuple[str, ...]:
        """The units whose loads place the batch."""
        return ("encoder", "generator")

    def order(self, loads: Mapping[str, Sequence[float]]) -> tuple[int, ...]:
        """order[p]: which sequence (in data order) position p of the batch holds."""
        return self.assignment(loads["encoder"], loads["generator"]).positions

    def place(self, loads: BatchLoads) -> tuple[int, ...]:
        """The order of a batch whose sequences weigh `loads`."""
        return self.assignment(loads.by_unit["encoder"], loads.by_unit["generator"]).positions

    def assignment(self, enc: Sequence[float], gen: Sequence[float]) -> Assignment:
        """The positions of a batch's sequences (their encoder and generator loads)."""
        import numpy as np  # here, not at the top: every plan imports this module (src/data/balance.py)

        seconds = np.column_stack([self.per_sequence[0] * np.asarray(enc), self.per_sequence[1] * np.asarray(gen)])
        count, dp_lm = len(seconds), self.dp_lm
        sizes = seconds.sum(axis=1).tolist()
        if self.policy == "cost":
            # The cost model's slots, or DistTrain's own (Algorithms 2 and 3), each order searched
            # on: whichever's slowest pipeline the recurrence prices shorter (on a tie the
            # balanced, whose heaviest micro-batch is the lighter).
            balanced = self._inter(vector_lpt(seconds, range(count), dp_lm), sizes, enc, gen, mixed=True)
            own = self._inter(self._intra(sizes), sizes, enc, gen, mixed=False)
            groups = min((balanced, own), key=lambda placed: placed[1])[0]
        else:
            if self.policy in ("intra", "both"):
                groups = self._intra(sizes)
            else:
                groups = [list(range(r, count, dp_lm)) for r in range(dp_lm)]  # replica r's data-order sequences
            if self.policy in ("inter", "both"):
                groups = self._inter(groups, sizes, enc, gen, mixed=False)[0]
        positions = [0] * count
        for r, members in enumerate(groups):
            for j, sequence in enumerate(members):
                positions[j * dp_lm + r] = sequence
        return Assignment(tuple(positions), dp_lm)

    def _intra(self, sizes: Sequence[float]) -> list[list[int]]:
        """Algorithm 2: equal-count LPT over the LLM replicas, each keeping its sequences in data order."""
        return [sorted(g) for g in lpt(sizes, self.dp_lm, equal_count=True)]

    def _slot_times(self, enc: float, gen: float) -> StageTimes:
        """A micro-batch slot's stage times at its encoder and generator loads."""
        scales = (enc, 1.0, gen)
        fwd = tuple(f * scale for scale, stages in zip(scales, self.fwd) for f in stages)
        bwd = tuple(b * scale for scale, stages in zip(scales, self.bwd) for b in stages)
        return StageTimes(fwd, bwd)

    def _inter(
        self, groups: list[list[int]], sizes: Sequence[float], enc: Sequence[float], gen: Sequence[float], mixed: bool
    ) -> tuple[list[list[int]], float]:
        """Algorithm 3 over each pipeline of LLM replicas joined through a shared encoder or
        generator replica, on its slots' stage times (a slot's unit takes its slowest
        replica's load); the slots of like sizes, or balanced (`mixed`). Under policy cost
        the order is searched on from Algorithm 3's, and the slowest pipeline's recurrence
        is returned beside the groups (NaN otherwise)."""
        b_me, b_mg = self.dp_lm // self.dp_me, self.dp_lm // self.dp_mg
        width = b_me * b_mg // math.gcd(b_me, b_mg)
        out = [list(g) for g in groups]
        pipelines = []  # per pipeline: its first replica, slots, their stage times and Algorithm 3's order
        for first in range(0, self.dp_lm, width):
            if mixed and width > 1:
                slots = self._mixed_slots([out[r] for r in range(first, first + width)], enc, gen, b_me, b_mg)
            else:
                members = [sorted(out[r], key=lambda s: (-sizes[s], s)) for r in range(first, first + width)]
                slots = list(zip(*members))

            def worst(slot: tuple[int, ...], loads: Sequence[float], b: int) -> float:
                return max(sum(loads[s] for s in slot[i : i + b]) / b for i in range(0, width, b))

            times = [self._slot_times(worst(slot, enc, b_me), worst(slot, gen, b_mg)) for slot in slots]
            pipelines.append((first, slots, times, inter_reorder(times)))
        orders = [order for *_, order in pipelines]
        span = math.nan
        if self.policy == "cost":  # the cost model's order: searched on from Algorithm 3's
            import numpy as np

            from src.data.order_search import improve, makespans, time_tables  # numpy's: imported where it runs

            tables = [times for _, _, times, _ in pipelines]
            orders = improve(tables, orders, chain=self.chain)
            span = float(makespans(time_tables(tables), np.arange(len(orders)), np.array(orders), chain=self.chain).max())
        for (first, slots, _, _), order in zip(pipelines, orders):
            for k, r in enumerate(range(first, first + width)):
                out[r] = [slots[i][k] for i in order]
        return out, span

    def _mixed_slots(
        self, members: list[list[int]], enc: Sequence[float], gen: Sequence[float], b_me: int, b_mg: int
    ) -> list[tuple[int, ...]]:
        """Slots of a pipeline's replicas (`members[k]`: replica k's sequences) whose shared
        units' micro-batches are balanced, not of like sizes: a micro-batch of a unit shared
        by b replicas (or replicated over its TP group, its images dealt out) costs the sum
        of its sequences' loads, so the heaviest sequences are spread over the micro-batches.
        Greedy, heaviest sequence first: each goes to the slot, among those its replica has
        not filled, whose encoder and generator micro-batches it leaves the lightest."""
        import numpy as np

        width, m = len(members), len(members[0])
        per_enc, per_gen = self.per_sequence
        enc_sums, gen_sums = np.zeros((m, width // b_me)), np.zeros((m, width // b_mg))
        free = np.ones((width, m), dtype=bool)
        slots = np.zeros((m, width), dtype=np.int64)
        placed = [(k, q) for k, seqs in enumerate(members) for q in seqs]
        placed.sort(key=lambda kq: (-max(per_enc * enc[kq[1]], per_gen * gen[kq[1]]), kq[1]))
        for k, q in placed:
            e, g = k // b_me, k // b_mg
            after = np.maximum(enc_sums[:, e] + per_enc * enc[q], gen_sums[:, g] + per_gen * gen[q])
            j = int(np.argmin(np.where(free[k], after, np.inf)))
            enc_sums[j, e] += per_enc * enc[q]
            gen_sums[j, g] += per_gen * gen[q]
            free[k, j] = False
            slots[j, k] = q
        return [tuple(int(q) for q in row) for row in slots]


def unit_loads(assignment: Assignment, loads: Sequence[float], dp: int, microbatches: int) -> tuple[tuple[float, ...], ...]:
    """loads[replica][microbatch] of a unit with `dp` replicas: the mean load of the
    sequences its micro-batch holds."""
    return _per_microbatch(assignment, dp, microbatches, lambda held: sum(loads[s] for s in held) / len(held))


def dealt_unit_loads(
    assignment: Assignment, image_loads: PerImage, dp: int, microbatches: int, dealt: Dealt
) -> tuple[tuple[float, ...], ...]:
    """loads[replica][microbatch] of a unit with `dp` replicas, each replicated over its TP
    group (`dealt`): its micro-batch's images dealt out whole over the group's GPUs, the
    busiest GPU's against its share at the mean."""
    return _per_microbatch(assignment, dp, microbatches, lambda held: dealt.load([x for s in held for x in image_loads[s]], len(held)))


def _per_microbatch(
    assignment: Assignment, dp: int, microbatches: int, weigh: Callable[[tuple[int, ...]], float]
) -> tuple[tuple[float, ...], ...]:
    """weigh(the sequences it holds) of every micro-batch of a unit with `dp` replicas, each
    holding DP_lm / dp sequences of the LLM replicas' positions."""
    b = assignment.dp_lm // dp
    return tuple(tuple(weigh(assignment.sequences(j, d * b, b)) for j in range(microbatches)) for d in range(dp))
