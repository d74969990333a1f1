"""The one rule every headline is judged by, and the checks of the qualitative claims.

A paper's value is a number, a range [low, high] or "up to X". Ours holds when it is within
the tolerance of the stated value: 10 % for ratios, times, counts, rates and memory, 3 points
for MFU, HFU and scheduling efficiencies (kept as fractions: 0.03). A range holds when ours
lies inside it, or within the tolerance of its nearer end (a range is judged as its nearest
number is); "up to X" compares our largest value over the rows the claim covers with X, "as low as X" our smallest.
The tolerance swamps effects smaller than itself (a 3 % gain reads as "holds" at no gain):
the claims that such a gain exists are checked separately, as qualitative claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from src.errors import ConfigError

EXTREMES = {"up_to": "up to", "as_low_as": "as low as"}
RELATIVE = 0.10
POINTS = 0.03
RELATIVE_KINDS = ("ratio", "time", "count", "rate", "memory")
POINT_KINDS = ("mfu", "hfu", "efficiency")
KINDS = RELATIVE_KINDS + POINT_KINDS
CAUSES = {
    "unstated": "the paper does not state a parameter the result depends on",
    "simulator": "the simulator (what a cost model of the same program does not see)",
    "implementation": "our implementation of a planner or baseline",
    "paper": "the paper's numbers disagree with each other",
}
RULE = (
    "Ours holds when it is within 10 % of the paper's value (ratios, times, counts, rates, memory) or within "
    "3 points of it (MFU, HFU, scheduling efficiencies); for a stated range, within that tolerance of the range "
    '(inside it, or near its nearer end); "up to X" compares our largest value over the rows the claim covers '
    'with X, "as low as X" our smallest. The ratio column is ours over the paper\'s value (over the nearer end '
    "of a range, 1 inside it)."
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


@dataclass(frozen=True)
class Verdict:
    holds: bool
    ratio: float | None  # ours over the paper's value (its nearest end for a range)


def judge(kind: str, paper: PaperValue, ours: float) -> Verdict:
    """Whether ours is within the kind's tolerance of the paper's value (its nearer end)."""
    nearest = min(max(ours, paper.low), paper.high)
    ratio = ours / nearest if nearest else None
    tolerance = POINTS if kind in POINT_KINDS else RELATIVE * abs(nearest)
    return Verdict(abs(ours - nearest) <= tolerance + 1e-12, ratio)


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


def check_claim(check: dict[str, Any], values: Table) -> bool:
    """Evaluate a claim's check on the figure's values (every group the check names)."""
    kind = check["kind"]
    groups = check["groups"]
    if kind in ("lowest", "highest"):
        sign = 1 if kind == "lowest" else -1
        return all(all(sign * values[g][check["series"]] < sign * values[g][other] for other in check["than"]) for g in groups)
    if kind in ("increasing", "decreasing"):
        sign = 1 if kind == "increasing" else -1
        seq = [values[g][check["series"]] for g in groups]
        return all(sign * (b - a) > 0 for a, b in zip(seq, seq[1:]))
    if kind == "largest_gap":
        gaps = {g: values[g][check["series"]] - values[g][check["than"][0]] for g in groups}
        return max(gaps, key=lambda g: gaps[g]) == check["at"]
    raise ConfigError(f"unknown claim check {kind!r} (lowest, highest, increasing, decreasing, largest_gap)")


CHECKS = ("lowest", "highest", "increasing", "decreasing", "largest_gap")
