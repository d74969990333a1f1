"""Scores a catalogue against its figures' results: one row per headline (ours, the ratio,
the verdict, a miss's cause and evidence), the claims, per-paper and total counts; written as
markdown, JSON and one plot.

A row reads `holds` (by verdict.judge), `consistent` (it misses at the point value, but its
first explanation is an unstated parameter and some value between our smallest and largest
over that parameter's declared range would hold), `misses` with the cause of the first other
explanation (or "not explained"), or `not run` (a job it needs failed, or a figure or sweep it
needs has no current results: none stored, or another version's).

A preset series named `<series>_best` is the best plan (our searched fastest) beside the
paper's plan `<series>`: a headline comparing against the paper's plan also shows what it
would read against the best plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from src.reproduction.catalogue import (
    PLACEHOLDER,
    ROW_PLACEHOLDER,
    Catalogue,
    Claim,
    ErrsTerm,
    Explanation,
    Headline,
    Locus,
    RowMatch,
    Sensitivity,
    Setting,
    config_value,
    measured_value,
    paper_value,
)
from src.reproduction.results import FigureResults
from src.reproduction.verdict import (
    CAUSES,
    NOT_EXPLAINED,
    POINT_KINDS,
    RULE,
    Verdict,
    check_claim,
    consistent,
    judge,
    show,
)
from src.sweep import SweepSpec

BEST = "_best"
HOLDS, CONSISTENT, MISSES, NOT_RUN = "holds", "consistent", "misses", "not run"
MISS_CAUSES = tuple(c for c in CAUSES if c != "unstated") + (NOT_EXPLAINED,)  # an unstated cause explains, or passes on


@dataclass(frozen=True)
class Goal:
    hold: float  # share of all headlines that hold at the point value
    hold_or_consistent: float  # share that hold or are consistent over a declared range
    paper_hold: float  # share that hold, for every paper

    def text(self) -> str:
        return (
            f"at least {_share(self.hold)} of the numeric headlines hold at the point value, at least "
            f"{_share(self.hold_or_consistent)} hold or are consistent over a declared range, no paper below "
            f"{_share(self.paper_hold)} holding"
        )


GOAL = Goal(0.45, 0.70, 0.30)

Figures = dict[str, tuple[SweepSpec, FigureResults | None]]  # None: no current results


@dataclass
class Swept:
    """A row's quantity at each value of one sensitivity's range (None: did not run)."""

    sensitivity: Sensitivity
    values: list[float | None]

    @property
    def ran(self) -> list[float]:
        return [v for v in self.values if v is not None]


@dataclass
class Scored:
    headline: Headline
    ours: float | None
    verdict: Verdict | None  # None: a job it needs did not run
    best: float | None  # the same quantity against the best plan, where the figure has one
    note: str = ""  # where an "up to" maximum lies, or why it did not run
    status: str = ""
    cause: str = ""  # a miss's class (MISS_CAUSES), or "unstated" for a consistent row
    evidence: str = ""
    swept: list[Swept] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return self.status == HOLDS


@dataclass
class ScoredClaim:
    claim: Claim
    holds: bool | None  # None: not run
    status: str = ""
    miss: str = ""  # a miss's cause and evidence


@dataclass
class PaperScore:
    catalogue: Catalogue
    headlines: list[Scored]
    claims: list[ScoredClaim]

    def count(self, status: str) -> int:
        return sum(s.status == status for s in self.headlines)

    @property
    def held(self) -> int:
        return self.count(HOLDS)

    def misses(self, cause: str) -> int:
        return sum(s.status == MISSES and s.cause == cause for s in self.headlines)


def _results(figures: Figures, preset: str) -> FigureResults | None:
    return figures[preset][1]


Place = tuple[FigureResults, str]  # the results a series is read from, and the group


def _read(place: Callable[[str], Place | None], series: str, field_name: str, match: RowMatch | None) -> float | None:
    """A series' field where `place` puts it; a figure's 'value' built, where the presets
    report it otherwise, from its metric as each reports it, normalised as the figure is."""
    at = place(series)
    if at is None:
        return None
    results, group = at
    if field_name != "value" or match is None or not match.raw:
        return results.value(group, series, field_name)
    value = results.value(group, series, match.raw[results.name])
    if value is None or not match.normalize:
        return value
    by = place(match.normalize["by"])
    base = None if by is None else by[0].value(by[1], match.normalize["by"], match.raw[by[0].name])
    if base is None:
        return None
    return base / value if match.normalize.get("invert") else value / base


def _in_figure(figures: Figures, preset: str, group: str) -> Callable[[str], Place | None]:
    results = _results(figures, preset)
    return lambda series: None if results is None else (results, group)


def _at_setting(figures: Figures, setting: Setting) -> Callable[[str], Place | None]:
    def place(series: str) -> Place | None:
        preset, group = setting[series]
        results = _results(figures, preset)
        return None if results is None else (results, group)

    return place


def _quantity(
    locus: Locus,
    group: str,
    figures: Figures,
    over: tuple[str, ...] | None = None,
    place: Callable[[str], Place | None] | None = None,
    match: RowMatch | None = None,
) -> float | None:
    """Ours at one group (or one setting of a range: `place`): the series' field, over the
    smallest of the `over` series' field."""
    place = place or _in_figure(figures, locus.preset, group)
    value = _read(place, locus.series, locus.field, match)
    over = locus.over if over is None else over
    if value is None or not over:
        return value
    bases = [_read(place, series, locus.over_field or locus.field, match) for series in over]
    if any(b is None for b in bases):
        return None
    return value / min(b for b in bases if b is not None)


def _best(locus: Locus, group: str, figures: Figures) -> float | None:
    """The same quantity against the best plan: the `_best` sibling of the series, of the
    `over` series, or of the series the figure normalises by."""
    spec, results = figures[locus.preset]
    if results is None:
        return None
    if locus.series + BEST in spec.series:
        best_series = Locus(locus.preset, locus.groups, locus.series + BEST, locus.field, locus.over, locus.over_field)
        return _quantity(best_series, group, figures)
    if locus.over and all(s + BEST in spec.series for s in locus.over):
        return _quantity(locus, group, figures, tuple(s + BEST for s in locus.over))
    by = (spec.normalize or {}).get("by")
    if locus.field == "value" and not locus.over and by and by + BEST in spec.series:
        ours, best = results.value(group, locus.series, "value"), results.value(group, by + BEST, "value")
        return None if ours is None or best is None else ours / best
    return None


def _number(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "–"
    if percent:
        return f"{100 * value:.1f} %"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _fill(
    text: str, explanation: Explanation, group: str, preset: str, figures: Figures, catalogue: Catalogue, row: dict[str, str]
) -> str:
    """An evidence text with its placeholders filled (the catalogue loader checked they resolve)."""
    spec, results = figures[preset]

    def fill(match: Any) -> str:
        source, field_name, at = match.groups()
        if source.startswith("measured."):
            measurement = explanation.measured[source.removeprefix("measured.")]
            value = measured_value(measurement, field_name, catalogue.measurements[measurement.file], catalogue.paper)
            return _number(float(value)) if isinstance(value, (int, float)) else str(value)
        if source.startswith("config."):
            return config_value(spec, source.removeprefix("config."), field_name, at or group, catalogue.paper)
        percent = field_name.endswith("%")
        if source.startswith("paper."):
            stated = paper_value(spec, source.removeprefix("paper."), field_name.removesuffix("%"), at or group, catalogue.paper)
            return "–".join(_number(v, percent) for v in stated) if isinstance(stated, list) else _number(float(stated), percent)
        value = None if results is None else results.field(at or group, source, field_name.removesuffix("%"))
        return value if isinstance(value, str) else _number(None if value is None else float(value), percent)

    text = PLACEHOLDER.sub(fill, text)
    return ROW_PLACEHOLDER.sub(lambda m: row.get(m.group(1), "–"), text)


def _errs_otherwise(explanation: Explanation, catalogue: Catalogue) -> str:
    """'' where a simulator cause's measurements err as it says (each pair of `errs` a below
    b); else the first that does not, for the row's evidence."""
    for pair in explanation.errs:
        values = [_term(term, explanation, catalogue) for term in pair]
        if not values[0][1] < values[1][1]:
            (a, va), (b, vb) = values
            below = b if isinstance(pair[1], float) else f"{b}, {_number(vb)}"
            return f"the {explanation.cause} cause's measurement does not err its way: {a} is {_number(va)}, not below {below}"
    return ""


def _term(term: ErrsTerm, explanation: Explanation, catalogue: Catalogue) -> tuple[str, float]:
    """(what it is, its value) of an `errs` term: a number, or a field of a measurement (named
    by its file's row)."""
    if isinstance(term, float):
        return _number(term), term
    name, field_name = term
    measurement = explanation.measured[name]
    value = float(measured_value(measurement, field_name, catalogue.measurements[measurement.file], catalogue.paper))
    where = measurement.at or ", ".join(f"{v}" for v in measurement.row.values())
    return f"{field_name} of {Path(measurement.file).name} ({where})", value


def _swept(sensitivity: Sensitivity, row_id: str, locus: Locus, extreme: str, figures: Figures) -> Swept:
    """The row's quantity at each value of the range, at each of its figure groups (the
    largest or smallest of them for an extreme)."""
    match = sensitivity.matches[row_id]
    values: list[float | None] = []
    for index in range(len(sensitivity.range.values)):
        ran = []
        for group in locus.groups:
            place = _at_setting(figures, match.settings[group][index])
            quantity = _quantity(locus, group, figures, place=place, match=match)
            if quantity is not None:
                ran.append(quantity)
        if not ran or (len(ran) < len(locus.groups) and not extreme):
            values.append(None)
        else:
            values.append((min if extreme == "as_low_as" else max)(ran))
    return Swept(sensitivity, values)


def _range_text(kind: str, swept: list[Swept]) -> str:
    """What the declared ranges give: '<parameter> over <values> gives <lowest>-<highest>'."""
    parts = []
    for sw in swept:
        rng, ran = sw.sensitivity.range, sw.ran
        shown = f"{show(kind, min(ran))}–{show(kind, max(ran))}" if ran else "nothing (no setting ran)"
        settings = "" if len(ran) == len(sw.values) else f" ({len(ran)} of {len(sw.values)} settings ran)"
        parts.append(f"{rng.parameter} over {', '.join(rng.values)} gives {shown}{settings}")
    return "; ".join(parts)


def score_headline(headline: Headline, figures: Figures, catalogue: Catalogue) -> Scored:
    locus = headline.locus
    results = _results(figures, locus.preset)
    if results is None:
        return Scored(headline, None, None, None, note=f"not run: no current results of {locus.preset}", status=NOT_RUN)
    values = {g: _quantity(locus, g, figures) for g in locus.groups}
    missing = [g for g, v in values.items() if v is None]
    if missing and (not headline.value.extreme or len(missing) == len(values)):
        return Scored(headline, None, None, None, note=f"not run: {results.error(missing[0], locus.series)}", status=NOT_RUN)
    ran = {g: v for g, v in values.items() if v is not None}
    smallest = headline.value.extreme == "as_low_as"
    group = (min if smallest else max)(ran, key=lambda g: ran[g])
    ours = ran[group]
    note = f"{'smallest' if smallest else 'largest'} at {group}" if len(values) > 1 else ""
    scored = Scored(headline, ours, judge(headline.kind, headline.value, ours), _best(locus, group, figures), note)
    turns = _turning_within_spread(headline, results, group, ours)
    if scored.verdict is not None and scored.verdict.holds and not turns:
        scored.status = HOLDS
        return scored
    row = {"ours": show(headline.kind, ours), "at": group}
    fill_group = group if headline.value.extreme else locus.groups[0]
    parts: list[str] = [turns] if turns else []
    if scored.verdict is not None and scored.verdict.short_of_gain:
        parts.append(f"within the band, but less than half the change the paper's {headline.value.text(headline.kind)} claims")
    side = "above" if ours > headline.value.high else "below"
    for explanation in headline.miss:
        if explanation.when and explanation.when != side:
            parts.append(f"ours misses {side} the paper's value, where the {explanation.cause} cause's measurement does not err")
            continue
        otherwise = _errs_otherwise(explanation, catalogue)
        if otherwise:
            parts.append(otherwise)
            continue
        evidence = _fill(explanation.evidence, explanation, fill_group, locus.preset, figures, catalogue, row)
        if explanation.cause != "unstated":
            scored.status, scored.cause, scored.evidence = MISSES, explanation.cause, "; ".join([*parts, evidence])
            return scored
        pending = [n for n in explanation.sensitivity if _results(figures, catalogue.sensitivities[n].preset) is None]
        if pending:
            presets = ", ".join(dict.fromkeys(catalogue.sensitivities[n].preset for n in pending))
            pending_note = f"misses at the point value, not judged over its range: no current results of {presets}"
            scored.status, scored.note = NOT_RUN, "; ".join(filter(None, [scored.note, pending_note]))
            return scored
        swept = [
            _swept(catalogue.sensitivities[name], headline.id, locus, headline.value.extreme, figures)
            for name in explanation.sensitivity
        ]
        scored.swept = swept
        over = [v for s in swept for v in s.ran]
        over_range = _range_text(headline.kind, swept)
        if over and consistent(headline.kind, headline.value, min(over), max(over)):
            scored.status, scored.cause, scored.evidence = CONSISTENT, "unstated", f"{over_range}; {evidence}"
            return scored
        beyond = "above" if over and min(over) > headline.value.high else "short of"
        parts.append(f"{over_range}, {beyond} the paper's value; {evidence}")
    scored.status, scored.cause, scored.evidence = MISSES, NOT_EXPLAINED, "; ".join(parts)
    return scored


def _turning_within_spread(headline: Headline, results: FigureResults, group: str, ours: float) -> str:
    """Where ours is the least of a running time's repeated runs and the verdict at the
    largest of them differs, why it is no verdict; '' otherwise."""
    locus = headline.locus
    largest = None if locus.over else results.largest(group, locus.series, locus.field)
    if largest is None:
        return ""
    holds = judge(headline.kind, headline.value, ours).holds
    if judge(headline.kind, headline.value, largest).holds == holds:
        return ""
    at_least, at_largest = ("holds", "misses") if holds else ("misses", "holds")
    return (
        f"{at_least} at the least of its timed runs ({show(headline.kind, ours)}) and {at_largest} at their largest "
        f"({show(headline.kind, largest)}): the verdict turns with this machine's load"
    )


def _claim_table(
    claim: Claim,
    figures: Figures,
    places: dict[str, Callable[[str], Place | None]],
    match: RowMatch | None = None,
    largest: bool = False,
) -> dict[str, dict[str, float]] | None:
    """The check's values (group -> series -> value), each group's series read where
    `places[group]` puts them; None where a job did not run. `largest`: a running time
    measured in repeated runs at the largest of them (the value, their least, elsewhere); with
    the check's `per`, each over that series' value in the group."""
    check = claim.check
    table: dict[str, dict[str, float]] = {}
    for group in check["groups"]:
        table[group] = {}
        base = _read(places[group], check["per"], claim.field, match) if "per" in check else 1.0
        if not base:
            return None
        for series in [check["series"], *check.get("than", [])]:
            value = _read(places[group], series, claim.field, match)
            if value is None:
                return None
            value /= base
            if largest and match is None and "per" not in check:
                at = places[group](series)
                spread = None if at is None else at[0].largest(at[1], series, claim.field)
                value = value if spread is None else spread
            table[group][series] = value
    return table


def score_claim(claim: Claim, figures: Figures, catalogue: Catalogue) -> ScoredClaim:
    places = {g: _in_figure(figures, claim.preset, g) for g in claim.check["groups"]}
    table = _claim_table(claim, figures, places)
    if table is None:
        return ScoredClaim(claim, None, NOT_RUN)
    largest = _claim_table(claim, figures, places, largest=True)
    assert largest is not None, "every value read above has its largest"
    holds = check_claim(claim.check, table)
    beyond_spread = check_claim(claim.check, table, largest)
    if holds and beyond_spread:
        return ScoredClaim(claim, True, HOLDS)
    group = claim.check["groups"][0]
    parts: list[str] = []
    if holds:
        parts.append("holds at the least of the timed runs, not over their spread: the order turns with this machine's load")
    for explanation in claim.miss:
        otherwise = _errs_otherwise(explanation, catalogue)
        if otherwise:
            parts.append(otherwise)
            continue
        evidence = _fill(explanation.evidence, explanation, group, claim.preset, figures, catalogue, {})
        if explanation.cause != "unstated":
            return ScoredClaim(claim, False, MISSES, f"{explanation.cause}: {'; '.join([*parts, evidence])}")
        if any(_results(figures, catalogue.sensitivities[n].preset) is None for n in explanation.sensitivity):
            return ScoredClaim(claim, False, NOT_RUN, "misses; not judged over its range: its sweep has no current results")
        held = []
        for name in explanation.sensitivity:
            sensitivity = catalogue.sensitivities[name]
            match = sensitivity.matches[claim.id]
            for index, value in enumerate(sensitivity.range.values):
                places = {g: _at_setting(figures, settings[index]) for g, settings in match.settings.items()}
                at = _claim_table(claim, figures, places, match)
                if at is not None and check_claim(claim.check, at):
                    held.append(f"{sensitivity.range.parameter} = {value}")
        if held:
            return ScoredClaim(claim, False, CONSISTENT, f"unstated: holds at {', '.join(held)}; {evidence}")
        ranges = "; ".join(
            f"{catalogue.sensitivities[n].range.parameter} over {', '.join(catalogue.sensitivities[n].range.values)}"
            for n in explanation.sensitivity
        )
        parts.append(f"holds at no setting of {ranges}; {evidence}")
    return ScoredClaim(claim, False, MISSES, f"{NOT_EXPLAINED}: {'; '.join(parts)}".rstrip(": "))


def score(catalogue: Catalogue, figures: Figures) -> PaperScore:
    return PaperScore(
        catalogue,
        [score_headline(h, figures, catalogue) for h in catalogue.headlines],
        [score_claim(c, figures, catalogue) for c in catalogue.claims],
    )


def _share(count: float, total: float = 1) -> str:
    return f"{100 * count / total:.0f} %" if total else "–"


def _totals(scores: list[PaperScore]) -> tuple[int, int, int]:
    total = sum(len(s.headlines) for s in scores)
    return total, sum(s.held for s in scores), sum(s.count(CONSISTENT) for s in scores)


def goal_met(scores: list[PaperScore]) -> bool:
    total, held, explained = _totals(scores)
    return (
        bool(total)
        and held / total >= GOAL.hold
        and (held + explained) / total >= GOAL.hold_or_consistent
        and all(s.held / len(s.headlines) >= GOAL.paper_hold for s in scores if s.headlines)
    )


def summary_table(scores: list[PaperScore]) -> str:
    lines = [
        "| paper | numeric headlines | hold | consistent | hold or consistent | "
        + " | ".join(f"misses: {c}" for c in MISS_CAUSES)
        + " | not run | claims that hold |",
        "|---|---|---|---|---|" + "---|" * len(MISS_CAUSES) + "---|---|",
    ]

    def cells(name: str, rows: list[PaperScore]) -> str:
        total, held, explained = _totals(rows)
        claims = f"{sum(c.status == HOLDS for s in rows for c in s.claims)} / {sum(len(s.claims) for s in rows)}"
        counts = [
            name,
            str(total),
            f"{held} ({_share(held, total)})",
            str(explained),
            f"{held + explained} ({_share(held + explained, total)})",
        ]
        counts += [str(sum(s.misses(c) for s in rows)) for c in MISS_CAUSES]
        counts += [str(sum(s.count(NOT_RUN) for s in rows)), claims]
        return "| " + " | ".join(counts) + " |"

    lines += [cells(s.catalogue.paper, [s]) for s in scores]
    if len(scores) > 1:
        lines.append(cells("**total**", scores))
    return "\n".join(lines)


def _status_text(status: str) -> str:
    return status if status in (HOLDS, CONSISTENT, NOT_RUN) else "**misses**"


def paper_section(s: PaperScore, papers_dir: str | None) -> str:
    """papers_dir: the folder of the papers' texts (None: cite the text's file name alone)."""
    c = s.catalogue
    cited = c.text if papers_dir is None else f"{papers_dir}/{c.text}"
    lines = [
        f"## {c.title}",
        "",
        f"Paper text: `{cited}`. Of {len(s.headlines)} numeric headlines, {s.held} hold at the point value "
        f"and {s.count(CONSISTENT)} more are consistent over a declared range.",
        "",
        "| id | figure | quantity | paper | where | ours | ours vs best plan | ratio | verdict | cause, evidence |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s.headlines:
        h = r.headline
        ours = show(h.kind, r.ours) + (f" ({r.note})" if r.note else "")
        ratio = "–" if r.verdict is None or r.verdict.ratio is None else f"{r.verdict.ratio:.2f}"
        miss = f"{r.cause}: {r.evidence}".rstrip(": ") if r.status in (MISSES, CONSISTENT) else ""
        cells = [h.id, h.figure, h.quantity, h.value.text(h.kind), h.where, ours, show(h.kind, r.best), ratio]
        lines.append("| " + " | ".join(cells + [_status_text(r.status), miss]) + " |")
    if s.claims:
        lines += ["", "### Qualitative claims", ""]
        lines += ["| id | figure | claim | where | verdict | cause, evidence |", "|---|---|---|---|---|---|"]
        for sc in s.claims:
            cl = sc.claim
            lines.append(f"| {cl.id} | {cl.figure} | {cl.claim} | {cl.where} | {_status_text(sc.status)} | {sc.miss} |")
    swept = [(r, sw) for r in s.headlines for sw in r.swept]
    if swept:
        lines += ["", "### Over the declared ranges of unstated parameters", ""]
        lines += ["| id | paper | parameter (source) | ours at each setting | verdict |", "|---|---|---|---|---|"]
        for r, sw in swept:
            h, rng = r.headline, sw.sensitivity.range
            at = ", ".join(f"{value}: {show(h.kind, ours)}" for value, ours in zip(rng.values, sw.values))
            lines.append(f"| {h.id} | {h.value.text(h.kind)} | {rng.parameter} ({rng.source}) | {at} | {_status_text(r.status)} |")
    return "\n".join(lines)


def markdown(scores: list[PaperScore], source: str, papers_dir: str | None, absent: dict[str, str] | None = None) -> str:
    met = goal_met(scores)
    lines = [
        "# Reproduction scorecard",
        "",
        f"Written by `python -m src.reproduce` from the figure results in `{source}`. Every number below is the "
        "simulator's, from the figure presets (`sweeps/`) run as they are; a paper's number is never an input.",
        "",
        f"Rule: {RULE}",
        "",
        "Causes: " + "; ".join(f"**{k}**: {v}" for k, v in CAUSES.items()) + f"; **{NOT_EXPLAINED}**: none of these.",
        "",
        "## Summary",
        "",
        summary_table(scores),
        "",
        f"Goal: {GOAL.text()}: " + ("met." if met else "**not met**."),
    ]
    if absent:
        listed = ", ".join(f"`{name}` ({why})" for name, why in absent.items())
        lines += ["", f"**Not current**: {listed}; the rows that need them read 'not run' until the figures are re-run."]
    for s in scores:
        lines += ["", paper_section(s, papers_dir)]
    return "\n".join(lines) + "\n"


def as_json(scores: list[PaperScore], source: str, absent: dict[str, str] | None = None) -> dict[str, Any]:
    def headline(r: Scored) -> dict[str, Any]:
        h = r.headline
        return {
            "id": h.id,
            "figure": h.figure,
            "quantity": h.quantity,
            "paper": h.value.text(h.kind),
            "paper_low": h.value.low,
            "paper_high": h.value.high,
            "extreme": h.value.extreme,
            "kind": h.kind,
            "where": h.where,
            "quote": h.quote,
            "preset": h.locus.preset,
            "groups": list(h.locus.groups),
            "series": h.locus.series,
            "field": h.locus.field,
            "over": list(h.locus.over),
            "over_field": h.locus.over_field,
            "ours": r.ours,
            "ours_vs_best_plan": r.best,
            "ratio": None if r.verdict is None else r.verdict.ratio,
            "status": r.status,
            "holds": r.holds,
            "ran": r.verdict is not None,
            "note": r.note,
            "cause": r.cause,
            "evidence": r.evidence,
            "swept": [
                {
                    "sensitivity": sw.sensitivity.id,
                    "range": sw.sensitivity.range.id,
                    "preset": sw.sensitivity.preset,
                    "settings": dict(zip(sw.sensitivity.range.values, sw.values)),
                }
                for sw in r.swept
            ],
        }

    def counts(s: PaperScore) -> dict[str, Any]:
        return {
            "headlines": len(s.headlines),
            "hold": s.held,
            "consistent": s.count(CONSISTENT),
            "not_run": s.count(NOT_RUN),
            "misses": {c: s.misses(c) for c in MISS_CAUSES},
        }

    return {
        "source": source,
        "rule": RULE,
        "goal": GOAL.text(),
        "goal_met": goal_met(scores),
        "not_current": dict(absent or {}),
        "papers": {
            s.catalogue.paper: {
                "title": s.catalogue.title,
                **counts(s),
                "rows": [headline(r) for r in s.headlines],
                "claims": [
                    {"id": c.claim.id, "claim": c.claim.claim, "status": c.status, "holds": c.holds, "miss": c.miss} for c in s.claims
                ],
            }
            for s in scores
        },
    }


COLOURS = {HOLDS: "tab:green", CONSISTENT: "tab:orange", MISSES: "tab:red"}


def plot(scores: list[PaperScore], path: Path) -> None:
    """Ours over the paper's value per headline, papers side by side: holds in green,
    consistent over a declared range in orange, misses in red, the ±10 % band shaded
    (point kinds are judged in points: their marker says so)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from src.report import plotting

    fig, (ax,) = plotting.new_figure(11.0, 4.8)
    x = 0
    ticks = []
    for s in scores:
        start = x
        for r in s.headlines:
            ratio = r.verdict.ratio if r.verdict is not None else None
            if ratio is not None and ratio > 0 and r.status in COLOURS:
                points = r.headline.kind in POINT_KINDS
                marker = "x" if r.status == MISSES else ("s" if points else "o")
                ax.plot([x], [ratio], marker=marker, color=COLOURS[r.status], markersize=4, linestyle="none")
            x += 1
        label = f"{s.catalogue.paper}\n{s.held}+{s.count(CONSISTENT)}/{len(s.headlines)}"
        ticks.append(((start + x - 1) / 2, label))
        ax.axvline(x - 0.5, color="grey", linewidth=0.5)
        x += 1
    ax.axhspan(0.9, 1.1, color="grey", alpha=0.2)
    ax.set_yscale("log")
    ax.set_xticks([t for t, _ in ticks])
    ax.set_xticklabels([label for _, label in ticks])
    ax.set_ylabel("ours / paper (nearest end of a range)")
    plotting.title(ax, "Reproduction scorecard: holds + consistent / numeric headlines, per paper")
    plotting.legend_outside(
        fig,
        [
            Line2D([], [], marker="o", color=COLOURS[HOLDS], linestyle="none", label="holds (ratio, time, count, rate, memory)"),
            Line2D([], [], marker="s", color=COLOURS[HOLDS], linestyle="none", label="holds (MFU, HFU, efficiency: ±3 points)"),
            Line2D([], [], marker="o", color=COLOURS[CONSISTENT], linestyle="none", label="consistent over a declared range"),
            Line2D([], [], marker="x", color=COLOURS[MISSES], linestyle="none", label="misses"),
            Patch(color="grey", alpha=0.2, label="within ±10 %"),
        ],
    )
    plotting.save(fig, path)


def write(
    scores: list[PaperScore], out: Path, stem: str, source: str, papers_dir: str | None, absent: dict[str, str] | None = None
) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(scores, source, papers_dir, absent)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(as_json(scores, source, absent), indent=1) + "\n")
    plot(scores, out / f"{stem}.png")
    return text
