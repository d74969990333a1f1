"""One style for every figure the harness draws (paper figures, comparisons, Gantt charts,
the simulator's validation, the reproduction scorecard).

Every figure is laid out by matplotlib's constrained layout, so titles, axis labels and
tick labels stay on the canvas; legends go outside the axes (to the right, or above a
stack of panels), never over the data; titles wrap to the figure's width.
`text_off_canvas` is what the tests use to hold every figure to this.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 120
TITLE_SIZE = 10
# Characters of a title line per inch of figure width at TITLE_SIZE points.
TITLE_CHARS_PER_INCH = 11


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (no display is ever needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_figure(width: float, height: float, rows: int = 1, sharex: bool = False) -> tuple[Figure, list[Axes]]:
    """A figure of `rows` stacked panels under constrained layout."""
    fig, axes = pyplot().subplots(rows, 1, figsize=(width, height), sharex=sharex, squeeze=False, layout="constrained")
    return fig, list(axes[:, 0])


def wrapped(text: str, fig: Figure, share: float = 1.0) -> str:
    """`text` broken into lines that fit `share` of the figure's width."""
    chars = max(20, int(fig.get_figwidth() * share * TITLE_CHARS_PER_INCH))
    return "\n".join(textwrap.fill(line, chars) for line in text.splitlines())


def title(ax: Axes, text: str) -> None:
    ax.set_title(wrapped(text, ax.figure, share=0.75), fontsize=TITLE_SIZE)  # type: ignore[arg-type]


def legend_outside(fig: Figure, handles: list[Any] | None = None, above: bool = False, labels: list[str] | None = None) -> None:
    """The legend beside the axes (right; above with `above`), where it covers no data.
    Handles carry their labels unless `labels` names them."""
    if handles is None:
        handles, labels = fig.axes[0].get_legend_handles_labels()
    if not handles:
        return
    named = {"labels": labels} if labels is not None else {}
    if above:
        fig.legend(handles=handles, loc="outside upper center", ncol=min(4, len(handles)), fontsize=8, frameon=False, **named)
    else:
        fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False, **named)


def save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)


def text_off_canvas(fig: Figure) -> list[str]:
    """Every visible text of a drawn figure that reaches past the canvas's edges."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    canvas = fig.bbox
    # Tick labels matplotlib keeps for ticks outside the view are not drawn.
    undrawn = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            slack = 1e-9 * (high - low)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not low - slack <= tick.get_loc() <= high + slack:
                    undrawn.update({id(tick.label1), id(tick.label2)})
    outside = []
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or id(text) in undrawn:
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1:
            outside.append(text.get_text())
    return outside
