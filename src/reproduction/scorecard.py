"""Scores a catalogue against its figures' results: one row per headline (ours, the ratio,
the verdict, a miss's cause and evidence), the claims, the sensitivity sweeps, per-paper
and total counts; written as markdown, JSON and one plot.

A preset series named `<series>_best` is the best plan (our searched fastest) beside the
paper's plan `<series>`: a headline comparing against the paper's plan also shows what it
would read against the best plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from src.reproduction.catalogue import PLACEHOLDER, Catalogue, Claim, Headline, Locus, Sensitivity
from src.reproduction.results import FigureResults
from src.reproduction.verdict import CAUSES, POINT_KINDS, RULE, Verdict, check_claim, judge, show
from src.sweep import SweepSpec

BEST = "_best"
GOAL = (0.75, 0.60)  # issue 25: share of headlines that hold overall, and per paper at least
NOT_EXPLAINED = "not explained"


@dataclass
class Scored:
    headline: Headline
    ours: float | None
    verdict: Verdict | None  # None: a job it needs did not run
    best: float | None  # the same quantity against the best plan, where the figure has one
    note: str = ""  # where an "up to" maximum lies, or why it did not run
    cause: str = ""  # a miss's class (verdict.CAUSES) or NOT_EXPLAINED
    evidence: str = ""

    @property
    def holds(self) -> bool:
        return self.verdict is not None and self.verdict.holds


@dataclass
class ScoredClaim:
    claim: Claim
    holds: bool | None  # None: not run
    miss: str = ""  # a miss's cause and evidence


@dataclass
class ScoredSetting:
    sensitivity: Sensitivity
    setting: str
    ours: float | None
    holds: bool | None


@dataclass
class PaperScore:
    catalogue: Catalogue
    headlines: list[Scored]
    claims: list[ScoredClaim]
    settings: list[ScoredSetting]

    @property
    def held(self) -> int:
        return sum(s.holds for s in self.headlines)

    def misses(self, cause: str) -> int:
        return sum(not s.holds and s.cause == cause for s in self.headlines)


Figures = dict[str, tuple[SweepSpec, FigureResults]]


def _quantity(locus: Locus, group: str, figures: Figures, over: tuple[str, ...] | None = None) -> float | None:
    """Ours at one group: the series' field, over the smallest of the `over` series' field."""
    _, results = figures[locus.preset]
    value = results.value(group, locus.series, locus.field)
    over = locus.over if over is None else over
    if value is None or not over:
        return value
    bases = [results.value(group, series, locus.field) for series in over]
    if any(b is None for b in bases):
        return None
    return value / min(b for b in bases if b is not None)


def _best(locus: Locus, group: str, figures: Figures) -> float | None:
    """The same quantity against the best plan: the `_best` sibling of the series, of the
    `over` series, or of the series the figure normalises by."""
    spec, results = figures[locus.preset]
    if locus.series + BEST in spec.series:
        return _quantity(Locus(locus.preset, locus.groups, locus.series + BEST, locus.field, locus.over), group, figures)
    if locus.over and all(s + BEST in spec.series for s in locus.over):
        return _quantity(locus, group, figures, tuple(s + BEST for s in locus.over))
    by = (spec.normalize or {}).get("by")
    if locus.field == "value" and not locus.over and by and by + BEST in spec.series:
        ours, best = results.value(group, locus.series, "value"), results.value(group, by + BEST, "value")
        return None if ours is None or best is None else ours / best
    return None


def _evidence(text: str, group: str, figures: Figures, preset: str) -> str:
    _, results = figures[preset]

    def fill(match: Any) -> str:
        series, field, at = match.groups()
        value = results.value(at or group, series, field)
        if value is None:
            return "–"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"

    return PLACEHOLDER.sub(fill, text)


def score_headline(headline: Headline, figures: Figures) -> Scored:
    locus = headline.locus
    values = {g: _quantity(locus, g, figures) for g in locus.groups}
    missing = [g for g, v in values.items() if v is None]
    _, results = figures[locus.preset]
    if missing and (not headline.value.extreme or len(missing) == len(values)):
        scored = Scored(headline, None, None, None, note=f"not run: {results.error(missing[0], locus.series)}")
    else:
        ran = {g: v for g, v in values.items() if v is not None}
        smallest = headline.value.extreme == "as_low_as"
        group = (min if smallest else max)(ran, key=lambda g: ran[g])
        ours = ran[group]
        best = _best(locus, group, figures)
        note = f"{'smallest' if smallest else 'largest'} at {group}" if len(values) > 1 else ""
        scored = Scored(headline, ours, judge(headline.kind, headline.value, ours), best, note)
    if not scored.holds:
        if headline.miss is None:
            scored.cause = NOT_EXPLAINED
        else:
            scored.cause = headline.miss.cause
            scored.evidence = _evidence(headline.miss.evidence, locus.groups[0], figures, locus.preset)
    return scored


def score_claim(claim: Claim, figures: Figures) -> ScoredClaim:
    _, results = figures[claim.preset]
    check = claim.check
    table: dict[str, dict[str, float]] = {}
    for group in check["groups"]:
        table[group] = {}
        for series in [check["series"], *check.get("than", [])]:
            value = results.value(group, series, claim.field)
            if value is None:
                return ScoredClaim(claim, None)
            table[group][series] = value
    holds = check_claim(check, table)
    miss = ""
    if not holds:
        miss = NOT_EXPLAINED
        if claim.miss is not None:
            miss = f"{claim.miss.cause}: {_evidence(claim.miss.evidence, check['groups'][0], figures, claim.preset)}"
    return ScoredClaim(claim, holds, miss)


def score_sensitivity(sensitivity: Sensitivity, figures: Figures) -> list[ScoredSetting]:
    headline = sensitivity.headline
    out = []
    for group in sensitivity.locus.groups:
        ours = _quantity(sensitivity.locus, group, figures)
        holds = None if ours is None else judge(headline.kind, headline.value, ours).holds
        out.append(ScoredSetting(sensitivity, group, ours, holds))
    return out


def score(catalogue: Catalogue, figures: Figures) -> PaperScore:
    return PaperScore(
        catalogue,
        [score_headline(h, figures) for h in catalogue.headlines],
        [score_claim(c, figures) for c in catalogue.claims],
        [s for sens in catalogue.sensitivities for s in score_sensitivity(sens, figures)],
    )


def _share(held: int, total: int) -> str:
    return f"{100 * held / total:.0f} %" if total else "–"


def goal_met(scores: list[PaperScore]) -> bool:
    total = sum(len(s.headlines) for s in scores)
    held = sum(s.held for s in scores)
    return bool(total) and held / total >= GOAL[0] and all(s.held / len(s.headlines) >= GOAL[1] for s in scores if s.headlines)


def summary_table(scores: list[PaperScore]) -> str:
    causes = list(CAUSES) + [NOT_EXPLAINED]
    lines = [
        "| paper | numeric headlines | hold | share | " + " | ".join(f"misses: {c}" for c in causes) + " | claims that hold |",
        "|---|---|---|---|" + "---|" * len(causes) + "---|",
    ]
    for s in scores:
        claims = f"{sum(c.holds is True for c in s.claims)} / {len(s.claims)}"
        cells = [s.catalogue.paper, str(len(s.headlines)), str(s.held), _share(s.held, len(s.headlines))]
        lines.append("| " + " | ".join(cells + [str(s.misses(c)) for c in causes] + [claims]) + " |")
    if len(scores) > 1:
        total = sum(len(s.headlines) for s in scores)
        held = sum(s.held for s in scores)
        claims = f"{sum(c.holds is True for s in scores for c in s.claims)} / {sum(len(s.claims) for s in scores)}"
        cells = ["**total**", str(total), str(held), _share(held, total)] + [str(sum(s.misses(c) for s in scores)) for c in causes]
        lines.append("| " + " | ".join(cells + [claims]) + " |")
    return "\n".join(lines)


def _verdict_text(holds: bool | None) -> str:
    return "not run" if holds is None else ("holds" if holds else "**misses**")


def paper_section(s: PaperScore, papers_dir: str) -> str:
    c = s.catalogue
    lines = [
        f"## {c.title}",
        "",
        f"Paper text: `{papers_dir}/{c.text}`. {s.held} of {len(s.headlines)} numeric headlines hold.",
        "",
        "| id | figure | quantity | paper | where | ours | ours vs best plan | ratio | verdict | miss: cause, evidence |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s.headlines:
        h = r.headline
        ours = show(h.kind, r.ours) + (f" ({r.note})" if r.note else "")
        ratio = "–" if r.verdict is None or r.verdict.ratio is None else f"{r.verdict.ratio:.2f}"
        miss = "" if r.holds else f"{r.cause}: {r.evidence}".rstrip(": ")
        cells = [h.id, h.figure, h.quantity, h.value.text(h.kind), h.where, ours, show(h.kind, r.best), ratio]
        lines.append("| " + " | ".join(cells + [_verdict_text(r.verdict.holds if r.verdict else None), miss]) + " |")
    if s.claims:
        lines += ["", "### Qualitative claims", ""]
        lines += ["| id | figure | claim | where | verdict | miss: cause, evidence |", "|---|---|---|---|---|---|"]
        for sc in s.claims:
            cl = sc.claim
            lines.append(f"| {cl.id} | {cl.figure} | {cl.claim} | {cl.where} | {_verdict_text(sc.holds)} | {sc.miss} |")
    if s.settings:
        lines += ["", "### Sensitivity to unstated parameters", ""]
        lines += ["| parameter | setting | ours | against | verdict |", "|---|---|---|---|---|"]
        for st in s.settings:
            h = st.sensitivity.headline
            lines.append(
                f"| {st.sensitivity.parameter} | {st.setting} | {show(h.kind, st.ours)} | {h.id}: {h.value.text(h.kind)} | "
                f"{_verdict_text(st.holds)} |"
            )
        notes = list(dict.fromkeys(st.sensitivity.note for st in s.settings if st.sensitivity.note))
        lines += [""] + notes if notes else []
    return "\n".join(lines)


def markdown(scores: list[PaperScore], source: str, papers_dir: str) -> str:
    met = goal_met(scores)
    lines = [
        "# Reproduction scorecard",
        "",
        f"Written by `python -m src.reproduce` from the figure results in `{source}`. Every number below is the "
        "simulator's, from the figure presets (`sweeps/`) run as they are; a paper's number is never an input.",
        "",
        f"Rule: {RULE}",
        "",
        "Miss causes: " + "; ".join(f"**{k}**: {v}" for k, v in CAUSES.items()) + ".",
        "",
        "## Summary",
        "",
        summary_table(scores),
        "",
        f"Goal (issue 25): at least {GOAL[0]:.0%} of the numeric headlines hold, no paper below {GOAL[1]:.0%}: "
        + ("met." if met else "**not met**."),
    ]
    for s in scores:
        lines += ["", paper_section(s, papers_dir)]
    return "\n".join(lines) + "\n"


def as_json(scores: list[PaperScore], source: str) -> dict[str, Any]:
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
            "ours": r.ours,
            "ours_vs_best_plan": r.best,
            "ratio": None if r.verdict is None else r.verdict.ratio,
            "holds": r.holds,
            "ran": r.verdict is not None,
            "note": r.note,
            "cause": r.cause,
            "evidence": r.evidence,
        }

    return {
        "source": source,
        "rule": RULE,
        "goal_met": goal_met(scores),
        "papers": {
            s.catalogue.paper: {
                "title": s.catalogue.title,
                "headlines": len(s.headlines),
                "hold": s.held,
                "misses": {c: s.misses(c) for c in [*CAUSES, NOT_EXPLAINED]},
                "rows": [headline(r) for r in s.headlines],
                "claims": [{"id": c.claim.id, "claim": c.claim.claim, "holds": c.holds, "miss": c.miss} for c in s.claims],
                "sensitivity": [
                    {"id": st.sensitivity.id, "setting": st.setting, "ours": st.ours, "holds": st.holds} for st in s.settings
                ],
            }
            for s in scores
        },
    }


def plot(scores: list[PaperScore], path: Path) -> None:
    """Ours over the paper's value per headline, papers side by side; holds in green, misses
    in red, the ±10 % band shaded (point kinds are judged in points: their marker says so)."""
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
            if ratio is not None and ratio > 0:
                points = r.headline.kind in POINT_KINDS
                marker = ("s" if points else "o") if r.holds else "x"
                ax.plot([x], [ratio], marker=marker, color="tab:green" if r.holds else "tab:red", markersize=4, linestyle="none")
            x += 1
        ticks.append(((start + x - 1) / 2, f"{s.catalogue.paper}\n{s.held}/{len(s.headlines)} hold"))
        ax.axvline(x - 0.5, color="grey", linewidth=0.5)
        x += 1
    ax.axhspan(0.9, 1.1, color="grey", alpha=0.2)
    ax.set_yscale("log")
    ax.set_xticks([t for t, _ in ticks])
    ax.set_xticklabels([label for _, label in ticks])
    ax.set_ylabel("ours / paper (nearest end of a range)")
    plotting.title(ax, "Reproduction scorecard: every numeric headline of the four papers")
    plotting.legend_outside(
        fig,
        [
            Line2D([], [], marker="o", color="tab:green", linestyle="none", label="holds (ratio, time, count, rate, memory)"),
            Line2D([], [], marker="s", color="tab:green", linestyle="none", label="holds (MFU, HFU, efficiency: ±3 points)"),
            Line2D([], [], marker="x", color="tab:red", linestyle="none", label="misses"),
            Patch(color="grey", alpha=0.2, label="within ±10 %"),
        ],
    )
    plotting.save(fig, path)


def write(scores: list[PaperScore], out: Path, stem: str, source: str, papers_dir: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(scores, source, papers_dir)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(as_json(scores, source), indent=1) + "\n")
    plot(scores, out / f"{stem}.png")
    return text
