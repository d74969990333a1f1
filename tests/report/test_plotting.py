"""Every figure the harness draws, rendered from made-up numbers: no text may reach past the
canvas (a clipped title, axis label, tick label or legend), and what the legend names is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from src.report import plotting
from src.sweep import REPO, figure_jobs, group_series, load_sweep

SWEEPS = sorted((REPO / "sweeps").glob("*.yaml"))
# A figure costs a third of a second to draw: the quick tier draws five that span the layouts
# (the most groups, the most series with paper values and ranges, one group of five series,
# paper ranges beside values, no paper numbers); the full suite draws every one.
QUICK = (
    "par4d_megatron_pp_sensitivity",
    "par4d_fig11_weak",
    "par4d_fig3_overlaps",
    "disttrain_fig17_orchestration",
    "distmm_fig8_partitioner",
)


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures saved while the fixture is active, kept open for inspection."""
    figures: list[Any] = []
    monkeypatch.setattr(plotting, "save", lambda fig, path: figures.append(fig))
    yield figures
    for fig in figures:
        plotting.pyplot().close(fig)


def assert_on_canvas(fig: Any) -> None:
    assert plotting.text_off_canvas(fig) == []


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=() if p.stem in QUICK else pytest.mark.slow) for p in SWEEPS])
def test_every_paper_figure_keeps_its_text_on_the_canvas(path: Path, drawn: list[Any]) -> None:
    from src.sweep import plot

    spec = load_sweep(path)
    rows = []
    for g_index, group in enumerate(spec.groups):
        for s_index, series in enumerate(group_series(spec, group)):
            value = None if (g_index, s_index) == (0, 1) else 1.0 + 0.1 * s_index + 0.05 * g_index
            rows.append({"group": group["label"], "series": series, "value": value, "paper": (group.get("paper") or {}).get(series)})
    plot(spec, {"rows": rows}, Path("unused.png"))
    (fig,) = drawn
    assert_on_canvas(fig)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert f"ours: {spec.label(next(iter(spec.series)))}" in legend
    papers = [r["paper"] for r in rows if r["paper"] is not None]
    assert ("paper: value" in legend) == any(not isinstance(p, list) for p in papers)  # named only where drawn
    assert ("paper: range" in legend) == any(isinstance(p, list) for p in papers)
    assert len(figure_jobs(spec)) >= len(rows)


def test_the_quick_tier_draws_figures_that_exist() -> None:
    assert set(QUICK) <= {p.stem for p in SWEEPS}


def test_optimus_speed_ups_say_what_they_are_normalised_to() -> None:
    for name in ("optimus_fig15_weak_scaling", "optimus_fig16_multi_encoder"):
        label = load_sweep(REPO / "sweeps" / f"{name}.yaml").metric_label
        assert "speed-up over Megatron-LM" in label and "(x)" in label


def test_compare_chart_says_how_the_winner_is_marked(drawn: list[Any]) -> None:
    from src.compare import ScalingReport, bar_chart

    outcomes = [
        {"strategy": name, "summary": {"throughput_samples_per_s": t, "devices": d}}
        for name, t, d in (("megatron-balanced", 120.0, 64), ("disttrain", 150.0, 64), ("a-strategy-with-a-long-name", 90.0, 64))
    ]
    bar_chart(outcomes, "mllm_15b on a800 (96 devices), global batch 64: a long title that must wrap", Path("x.png"))
    results = [{"devices": d, "model": "gpt", "cluster": "perlmutter", "outcomes": outcomes} for d in (16, 64)]
    ScalingReport._plot(results, ["megatron-balanced", "disttrain"], Path("y.png"))
    chart, scaling = drawn
    assert "fastest (highest throughput)" in [t.get_text() for t in chart.legends[0].get_texts()]
    assert_on_canvas(chart)
    assert_on_canvas(scaling)


def test_gantt_and_validation_keep_their_text_on_the_canvas(drawn: list[Any]) -> None:
    from src.gantt import render
    from src.timeline import RankTimeline, Span, Timeline
    from src.validate import plot

    spans = [
        Span("compute", 0.01 * i, 0.01 * i + 0.008, f"{'fwd' if i < 4 else 'bwd'} vision L0-1", "compute", "vision", i % 2)
        for i in range(8)
    ]
    ranks = [RankTimeline((r,), f"vision stage {r} (ranks {r})", ("vision",), spans, {}, 0.08) for r in range(2)]
    render([("GPipe with batch-sync", Timeline(0.08, ranks)), ("DistMM-Pipe", Timeline(0.07, ranks))], Path("g.png"))
    rows = [
        {"case": f"megatron tp{w} a-long-case-name", "workers": w, "measured_s": 0.1 * w, "predicted_s": 0.11 * w, "error_pct": 10.0}
        for w in (2, 4)
    ]
    plot(rows, Path("v.png"))
    for fig in drawn:
        assert_on_canvas(fig)


def test_the_scorecard_plot_keeps_its_text_on_the_canvas(drawn: list[Any]) -> None:
    from src.reproduction.catalogue import Presets, load_catalogue
    from src.reproduction.scorecard import CONSISTENT, HOLDS, MISSES, PaperScore, Scored, plot
    from src.reproduction.verdict import judge

    presets = Presets()
    scores = []
    for paper in ("distmm", "par4d"):
        cat = load_catalogue(paper, presets)
        rows = []
        for i, h in enumerate(cat.headlines):
            verdict = judge(h.kind, h.value, h.value.high * 1.05)
            rows.append(Scored(h, h.value.high * 1.05, verdict, None, status=HOLDS if verdict.holds else (MISSES, CONSISTENT)[i % 2]))
        scores.append(PaperScore(cat, rows, []))
    plot(scores, Path("s.png"))
    (fig,) = drawn
    assert_on_canvas(fig)


def test_text_off_canvas_finds_a_clipped_label() -> None:
    fig, ax = plotting.pyplot().subplots(figsize=(4.0, 3.0))
    ax.text(0.5, 1.2, "x" * 200, transform=ax.transAxes)  # runs far past both edges
    assert plotting.text_off_canvas(fig) == ["x" * 200]
    plotting.pyplot().close(fig)
