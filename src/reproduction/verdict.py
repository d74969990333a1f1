"""The one rule every headline is judged by, and the checks of the qualitative claims.

A paper's value is a number, a range [low, high] or "up to X". Ours holds when it is within
the tolerance of the stated value: 10 % for ratios, times, counts, rates and memory, 3 points
for MFU, HFU and scheduling efficiencies (kept as fractions: 0.03). A range holds when ours
lies inside it, or within the tolerance of its nearer end (a range is judged as its nearest
number is); "up to X" compares our largest value over the rows the claim covers with X, "as
low as X" our smallest.

The band alone would accept no gain at all where the claim is small (a claimed 5 % gain is
"within 10 %" of 1.0), so a claimed gain is judged on its size too: a ratio whose paper value
lies wholly on one side of 1 claims a gain (or a loss) of |the end nearer 1 - 1|, and ours
holds only when it is a change the same way of at least half that size. Every verdict is
thus an interval of ours that holds (`holding`), which the sensitivity sweeps reuse: a
paper's value is consistent with a declared range of an unstated parameter when some value
between our smallest and largest over that range would hold.

A running time of this machine, measured in repeated runs, holds only where it holds at the
least and at the largest of its runs, and an order of such times only where it holds with
each anywhere between the two: a verdict the machine's load can turn is no verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from src.errors import ConfigError

EXTREMES = {"up_to": "up to", "as_low_as": "as low as"}
RELATIVE = 0.10
POINTS = 0.03
GAIN_SHARE = 0.5  # of a claimed gain, the least ours must show
RELATIVE_KINDS = ("ratio", "time", "count", "rate", "memory")
POINT_KINDS = ("mfu", "hfu", "efficiency")
KINDS = RELATIVE_KINDS + POINT_KINDS
CAUSES = {
    "unstated": "the paper does not state a parameter the result depends on; a sweep over a declared range of it shows "
    "whether the paper's value is within what the range gives",
    "simulator": "the simulator (a mechanism a cost model of the same program does not see), with a measurement where "
    "the simulator errs the same way",
    "implementation": "our implementation of a planner or baseline lacks a mechanism the paper's has",
    "paper": "the paper's numbers disagree with each other",
}
NOT_EXPLAINED = "not explained"  # a miss no cause explains (a catalogue may say so, with what the runs show)
RULE = (
    "Ours holds when it is within 10 % of the paper's value (ratios, times, counts, rates, memory) or within "
    "3 points of it (MFU, HFU, scheduling efficiencies); for a stated range, within that tolerance of the range "
    '(inside it, or near its nearer end); "up to X" compares our largest value over the rows the claim covers '
    'with X, "as low as X" our smallest. A ratio whose paper value lies wholly on one side of 1 claims a gain '
    '(or a loss) of |the end nearer 1 - 1| (for "up to X", |X - 1|): ours holds only when it is a change the same '
    "way of at least half that size, and within the band. A miss whose cause is an unstated parameter is "
    "consistent when some value between our smallest and largest over the parameter's declared range would "
    "hold by this rule. A running time of this machine measured in repeated runs (ours: the least of them) holds only "
    "where the largest of them holds too, and an order of such times only where their spreads do not overlap. The ratio "
    "column is ours over the paper's value (over the nearer end of a range, 1 inside it)."
)


@dataclass(frozen=True)
class PaperValue:
    low: float
    high: float
    extreme: str = ""  # "up_to": our largest over the rows the claim covers; "as_low_as": our smallest

    @classmethod
    def parse(cls, raw: Any, where: str) -> PaperValue:
        if isinstance(raw, bool):
            raise ConfigError(f"{where}: paper value {raw!r} is not a number, [low, high], {{up_to: X}} or {{as_low_as: X}}")
        if isinstance(raw, (int, float)):
            return cls(float(raw), float(raw))
        if isinstance(raw, list) and len(raw) == 2 and all(isinstance(v, (int, float)) for v in raw) and raw[0] <= raw[1]:
            return cls(float(raw[0]), float(raw[1]))
        if isinstance(raw, dict) and len(raw) == 1 and set(raw) <= set(EXTREMES):
            ((extreme, value),) = raw.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return cls(float(value), float(value), extreme)
        raise ConfigError(f"{where}: paper value {raw!r} is not a number, [low, high] (low <= high), {{up_to: X}} or {{as_low_as: X}}")

    @property
    def is_range(self) -> bool:
        return self.low != self.high

    def text(self, kind: str) -> str:
        show = _percent if kind in POINT_KINDS else _number
        if self.extreme:
            return f"{EXTREMES[self.extreme]} {show(self.high)}"
        return f"{show(self.low)}–{show(self.high)}" if self.is_range else show(self.low)

    def claimed_gain(self, kind: str) -> tuple[int, float] | None:
        """(direction, size) of the gain a ratio claims: +1 above 1, -1 below; None where the
        value is no ratio or does not lie wholly on one side of 1."""
        if kind != "ratio":
            return None
        if self.low > 1:
            return 1, self.low - 1
        if self.high < 1:
            return -1, 1 - self.high
        return None


@dataclass(frozen=True)
class Verdict:
    holds: bool
    ratio: float | None  # ours over the paper's value (its nearest end for a range)
    short_of_gain: bool = False  # within the band, but less than half the claimed gain


def band(kind: str, paper: PaperValue) -> tuple[float, float]:
    """The interval of ours within the kind's tolerance of the paper's value (its range)."""
    if kind in POINT_KINDS:
        return paper.low - POINTS, paper.high + POINTS
    return paper.low - RELATIVE * abs(paper.low), paper.high + RELATIVE * abs(paper.high)


def holding(kind: str, paper: PaperValue) -> tuple[float, float]:
    """The interval of ours that holds: the band, cut at half the claimed gain where the
    value claims one."""
    low, high = band(kind, paper)
    gain = paper.claimed_gain(kind)
    if gain is not None:
        direction, size = gain
        if direction > 0:
            low = max(low, 1 + GAIN_SHARE * size)
        else:
            high = min(high, 1 - GAIN_SHARE * size)
    return low, high


def _within(value: float, interval: tuple[float, float]) -> bool:
    return interval[0] - 1e-12 <= value <= interval[1] + 1e-12


def judge(kind: str, paper: PaperValue, ours: float) -> Verdict:
    """Whether ours holds: within the kind's tolerance of the paper's value (its nearer end)
    and, for a claimed gain, at least half of it the same way."""
    nearest = min(max(ours, paper.low), paper.high)
    holds = _within(ours, holding(kind, paper))
    return Verdict(holds, ours / nearest if nearest else None, short_of_gain=not holds and _within(ours, band(kind, paper)))


def consistent(kind: str, paper: PaperValue, lowest: float, highest: float) -> bool:
    """Whether some value between our smallest and largest over a declared range would hold."""
    low, high = holding(kind, paper)
    return lowest <= high + 1e-12 and highest >= low - 1e-12


def show(kind: str, value: float | None) -> str:
    if value is None:
        return "–"
    return _percent(value) if kind in POINT_KINDS else _number(value)


def _percent(value: float) -> str:
    return f"{100 * value:.1f} %"


def _number(value: float) -> str:
    return f"{value:.3g}"


# Qualitative claims: field values per group, per series -> holds?
Table = dict[str, dict[str, float]]  # group -> series -> value


TIE = 1e-9  # relative: values closer than this are equal (a claim's order is not decided by rounding noise)


def _below(a: float, b: float) -> bool:
    return b - a > TIE * max(abs(a), abs(b))


def check_claim(check: dict[str, Any], values: Table, largest: Table | None = None) -> bool:
    """Evaluate a claim's check on the figure's values (every group the check names); values
    that differ by rounding alone are equal, so no order holds between them. `largest`: for
    running times measured in repeated runs (`values` the least of each's runs), their
    largest; an order then holds only however the runs fall, each value anywhere between the
    two (the side meant to be lower read at its largest)."""
    high = values if largest is None else largest
    kind = check["kind"]
    groups = check["groups"]
    if kind in ("lowest", "highest"):
        series = check["series"]
        if kind == "lowest":
            return all(all(_below(high[g][series], values[g][other]) for other in check["than"]) for g in groups)
        return all(all(_below(high[g][other], values[g][series]) for other in check["than"]) for g in groups)
    if kind in ("increasing", "decreasing"):
        series = check["series"]
        pairs = list(zip(groups, groups[1:])) if kind == "increasing" else list(zip(groups[1:], groups))
        return all(_below(high[a][series], values[b][series]) for a, b in pairs)
    if kind == "steady":  # every group within the rule's relative tolerance of the smallest
        series = check["series"]
        low = min(values[g][series] for g in groups)
        return all(high[g][series] <= low + RELATIVE * abs(low) for g in groups)
    if kind == "largest_gap":
        if largest is not None:
            return check_claim(check, values) and check_claim(check, largest)
        gaps = {g: values[g][check["series"]] - values[g][check["than"][0]] for g in groups}
        return max(gaps, key=lambda g: gaps[g]) == check["at"]
    raise ConfigError(f"unknown claim check {kind!r} ({', '.join(CHECKS)})")


CHECKS = ("lowest", "highest", "increasing", "decreasing", "steady", "largest_gap")
