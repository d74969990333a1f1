"""The scorecard's one rule on hand-made rows: numbers, ranges, "up to", points for MFU, claimed
gains (half of one, the same way), consistency over a range, claims' order."""

from __future__ import annotations

import pytest

from src.errors import ConfigError
from src.reproduction.verdict import PaperValue, band, check_claim, consistent, judge


def value(raw: object) -> PaperValue:
    return PaperValue.parse(raw, "test")


@pytest.mark.parametrize(
    ("kind", "paper", "ours", "holds"),
    [
        ("ratio", 1.25, 1.3, True),  # 4 % off
        ("ratio", 1.25, 1.4, False),  # 12 % off
        ("time", 10.0, 9.0, True),  # exactly 10 % below
        ("time", 10.0, 8.9, False),
        ("count", 12, 13, True),
        ("count", 1, 2, False),
        ("mfu", 0.42, 0.449, True),  # 2.9 points
        ("mfu", 0.42, 0.46, False),  # 4 points, though only 9.5 % off
        ("hfu", 0.27, 0.33, False),  # 6 points
        ("efficiency", 0.343, 0.315, True),
        ("efficiency", 0.343, 0.31, False),  # 3.3 points
    ],
)
def test_a_number_holds_within_its_kinds_tolerance(kind: str, paper: float, ours: float, holds: bool) -> None:
    assert judge(kind, value(paper), ours).holds is holds


@pytest.mark.parametrize(
    ("paper", "ours", "holds", "ratio"),
    [
        ([1.32, 1.39], 1.35, True, 1.0),  # inside
        ([1.32, 1.39], 1.30, True, 1.30 / 1.32),  # below, within 10 % of the lower end
        ([1.48, 1.67], 2.25, False, 2.25 / 1.67),  # above, 35 % past the upper end
        ([1.3, 2.7], 1.0, False, 1.0 / 1.3),
    ],
)
def test_a_range_holds_inside_or_near_its_nearer_end(paper: list[float], ours: float, holds: bool, ratio: float) -> None:
    verdict = judge("ratio", value(paper), ours)
    assert verdict.holds is holds
    assert verdict.ratio == pytest.approx(ratio)


def test_a_range_of_mfu_is_judged_in_points() -> None:
    assert judge("mfu", value([0.518, 0.547]), 0.50).holds
    assert not judge("mfu", value([0.518, 0.547]), 0.48).holds


def test_up_to_and_as_low_as_are_extremes_judged_as_numbers() -> None:
    up_to = value({"up_to": 3.27})
    assert up_to.extreme == "up_to" and up_to.text("ratio") == "up to 3.27"
    assert judge("ratio", up_to, 3.5).holds and not judge("ratio", up_to, 3.88).holds
    assert value({"as_low_as": 0.2}).text("mfu") == "as low as 20.0 %"


@pytest.mark.parametrize("raw", [True, "1.3", [2.0, 1.0], [1.0], {"at_most": 3}, {"up_to": "x"}])
def test_a_malformed_paper_value_is_refused(raw: object) -> None:
    with pytest.raises(ConfigError, match="test: paper value"):
        value(raw)


def test_claim_checks() -> None:
    table = {"a": {"x": 1.0, "y": 2.0}, "b": {"x": 3.0, "y": 3.5}, "c": {"x": 2.0, "y": 5.0}}
    groups = ["a", "b", "c"]
    assert check_claim({"kind": "lowest", "series": "x", "than": ["y"], "groups": groups}, table)
    assert not check_claim({"kind": "highest", "series": "x", "than": ["y"], "groups": groups}, table)
    assert check_claim({"kind": "increasing", "series": "y", "groups": groups}, table)
    assert not check_claim({"kind": "increasing", "series": "x", "groups": groups}, table)
    assert check_claim({"kind": "decreasing", "series": "x", "groups": ["b", "c"]}, table)
    assert check_claim({"kind": "largest_gap", "series": "y", "than": ["x"], "at": "c", "groups": groups}, table)
    assert not check_claim({"kind": "largest_gap", "series": "y", "than": ["x"], "at": "a", "groups": groups}, table)
    # steady: every group within the rule's 10 % of the smallest
    steady = {"a": {"x": 0.344}, "b": {"x": 0.346}, "c": {"x": 0.378}, "d": {"x": 0.380}}
    assert check_claim({"kind": "steady", "series": "x", "groups": ["a", "b", "c"]}, steady)
    assert not check_claim({"kind": "steady", "series": "x", "groups": ["a", "b", "d"]}, steady)


@pytest.mark.parametrize(
    ("paper", "ours", "holds"),
    [
        (1.06, 1.02, False),  # a third of a claimed 6 % gain: within the band, but no gain to speak of
        (1.06, 1.03, True),  # half of it
        (1.06, 0.98, False),  # a loss never holds a claimed gain, however close
        ([1.10, 1.18], 1.0333, False),  # a third of the nearer end's 10 %
        ([1.10, 1.18], 1.05, True),
        (0.95, 0.9833, False),  # "5 % faster" as a time ratio: a third of it
        (0.95, 0.975, True),
        (0.95, 1.01, False),
        ({"up_to": 1.06}, 1.02, False),  # "up to": the gain is |X - 1|
        ({"up_to": 1.06}, 1.04, True),
        (1.0, 1.08, True),  # "matching": no gain claimed, the band alone
    ],
)
def test_a_claimed_gain_holds_only_at_half_its_size_the_same_way(paper: object, ours: float, holds: bool) -> None:
    verdict = judge("ratio", value(paper), ours)
    assert verdict.holds is holds
    low, high = band("ratio", value(paper))
    assert verdict.short_of_gain is (low <= ours <= high and not holds)


def test_the_gain_rule_is_for_ratios_alone() -> None:
    assert judge("time", value(1.06), 1.0).holds  # a time of 1.06 s is no claimed gain
    assert value([0.9, 1.1]).claimed_gain("ratio") is None  # a range across 1 claims none
    assert value(1.25).claimed_gain("ratio") == (1, pytest.approx(0.25))
    assert value([0.8, 0.9]).claimed_gain("ratio") == (-1, pytest.approx(0.1))


@pytest.mark.parametrize(
    ("paper", "lowest", "highest", "explained"),
    [
        (1.3, 0.8, 1.0, False),  # the range gives at most 1.0; the band starts at 1.17
        (1.3, 0.8, 1.2, True),  # 1.2 would hold
        (1.3, 1.5, 2.0, False),  # above the band's 1.43
        (1.06, 0.95, 1.02, False),  # within the band, never half the claimed gain
        ([1.3, 2.7], 2.9, 3.5, True),  # 2.9 is within 10 % of the upper end
    ],
)
def test_a_paper_value_is_consistent_when_some_value_of_the_range_would_hold(
    paper: object, lowest: float, highest: float, explained: bool
) -> None:
    assert consistent("ratio", value(paper), lowest, highest) is explained


def test_values_equal_but_for_rounding_have_no_order() -> None:
    table = {"a": {"x": 0.999999999999989}, "b": {"x": 0.9999999999999959}}
    assert not check_claim({"kind": "increasing", "series": "x", "groups": ["a", "b"]}, table)
    assert not check_claim({"kind": "decreasing", "series": "x", "groups": ["a", "b"]}, table)
