"""What a backend returns: when every instruction of every rank class ran, and why each
rank's compute stream was idle. Both the simulator and the real runtime produce this."""

from __future__ import annotations

from dataclasses import dataclass, field

# Breakdown categories, in the order reports show them. They add up to the iteration
# time on every rank: compute + exposed communication by kind + bubbles + idle.
BUBBLE_CATEGORIES = ("bubble_warmup", "bubble_cooldown", "bubble_imbalance")
# The same bubbles by where they fall on a rank (Optimus's Table 1 and Fig. 8 count them so):
# before its first forward or backward, between its passes, after its last.
BUBBLE_POSITIONS = ("leading", "inner", "trailing")
BREAKDOWN_CATEGORIES = ("compute", "comm_tp", "comm_pp", "comm_dp", "comm_interaction", "comm_broker") + BUBBLE_CATEGORIES + ("idle",)


@dataclass(slots=True)
class Span:
    """One instruction's execution on one stream. `category` is 'compute' for compute
    work, 'comm_<kind>' for communication. Not frozen (cheaper to build, as the instruction
    types, src/program.py); never changed once recorded."""

    stream: str
    start: float
    end: float
    name: str
    category: str
    unit: str = ""
    microbatch: int = -1


@dataclass
class RankTimeline:
    """The timeline of one class of interchangeable ranks (see program.RankProgram)."""

    ranks: tuple[int, ...]
    label: str
    units: tuple[str, ...]
    spans: list[Span]
    breakdown: dict[str, float]
    end: float
    peak_memory_bytes: float = 0.0
    memory: dict[str, float] = field(default_factory=dict)
    # Its bubbles by position (BUBBLE_POSITIONS), where its backend tells them apart.
    bubble_positions: dict[str, float] = field(default_factory=dict)


@dataclass
class Timeline:
    iteration_time: float
    ranks: list[RankTimeline]
    backend: str = "sim"
    events: int = 0
    p2p_bytes: float = 0.0  # bytes all ranks' point-to-point messages put on links

    def mean_breakdown(self) -> dict[str, float]:
        """Breakdown averaged over all ranks (each class weighted by its rank count)."""
        return self._rank_mean([r.breakdown for r in self.ranks], BREAKDOWN_CATEGORIES)

    def mean_bubble_positions(self) -> dict[str, float]:
        """Bubbles by position averaged over all ranks; empty unless every class has them."""
        if not self.ranks or not all(r.bubble_positions for r in self.ranks):
            return {}
        return self._rank_mean([r.bubble_positions for r in self.ranks], BUBBLE_POSITIONS)

    def _rank_mean(self, per_class: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
        """Each class's figures weighted by its rank count."""
        total = sum(len(r.ranks) for r in self.ranks)
        out = dict.fromkeys(keys, 0.0)
        for rank_timeline, figures in zip(self.ranks, per_class):
            weight = len(rank_timeline.ranks) / total
            for key, seconds in figures.items():
                out[key] += weight * seconds
        return out

    def unit_breakdown(self) -> dict[str, dict[str, float]]:
        """Breakdown averaged over the ranks of each unit."""
        per_unit: dict[str, dict[str, float]] = {}
        counts: dict[str, int] = {}
        for rank_timeline in self.ranks:
            for unit in rank_timeline.units:
                acc = per_unit.setdefault(unit, {cat: 0.0 for cat in BREAKDOWN_CATEGORIES})
                n = len(rank_timeline.ranks)
                counts[unit] = counts.get(unit, 0) + n
                for cat, seconds in rank_timeline.breakdown.items():
                    acc[cat] += n * seconds
        return {unit: {cat: v / counts[unit] for cat, v in acc.items()} for unit, acc in per_unit.items()}

    @property
    def peak_memory_bytes(self) -> float:
        return max((r.peak_memory_bytes for r in self.ranks), default=0.0)
