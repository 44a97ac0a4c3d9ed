"""The project's plotting helpers: Agg figures with the seaborn style, PNG + PDF, stats rows (used by figures,
rank-eval, decisions and replay)."""

from __future__ import annotations

import contextlib
import math
import textwrap
from pathlib import Path

import polars as pl
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvdiag.core.io import write_atomically

STATS_SCHEMA = {"statistic": pl.String, "value": pl.Float64, "note": pl.String}
NOTE_COLOR = "firebrick"


@contextlib.contextmanager
def style():
    """seaborn's whitegrid/paper style for the figures made inside (rcParams restored afterwards)."""
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"):
        yield


# one (colour, marker) pair per line: tab20's 20 colours, then the next marker (lines 0-19, 20-39, ...)
PALETTE_SIZE, MARKERS = 20, (".", "x", "^", "s")


def line_styles(names: list[str]) -> dict[str, tuple[tuple[float, float, float], str]]:
    """Each of ``names`` its own (colour, marker): colour ``i % 20`` of tab20, marker ``i // 20``. A default colour
    cycle repeats after 10 lines and the zoo has more rules, so colour alone would give two rules one line style."""
    palette = sns.color_palette("tab20", PALETTE_SIZE)
    return {name: (palette[i % PALETTE_SIZE], MARKERS[i // PALETTE_SIZE % len(MARKERS)])
            for i, name in enumerate(names)}


def new_figure(ncols: int, width: float, height: float) -> tuple[Figure, list]:
    """A figure on the Agg canvas (never a display backend, no pyplot state) with ``ncols`` axes."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def save_figure(fig: Figure, out_dir: Path, name: str) -> list[Path]:
    """``name``.png (150 dpi) and ``name``.pdf in ``out_dir``."""
    png, pdf = out_dir / f"{name}.png", out_dir / f"{name}.pdf"
    write_atomically(png, lambda tmp: fig.savefig(tmp, dpi=150, format="png"))
    fig.set_layout_engine("none")  # keep the layout the PNG computed: the PDF needs no second layout pass
    write_atomically(
        pdf, lambda tmp: fig.savefig(tmp, format="pdf", metadata={"CreationDate": None})
    )  # reproducible bytes
    return [png, pdf]


def note_on(ax, text: str, y: float = 0.5, width: int = 60) -> None:
    """A visible note in the axes (too few candidates, undefined statistic), wrapped at ``width`` characters;
    left out of the layout so it never squeezes the axes."""
    wrapped = "\n".join(textwrap.fill(line, width) for line in text.splitlines())
    ax.text(0.5, y, wrapped, transform=ax.transAxes, ha="center", va="center", color=NOTE_COLOR, fontsize=7,
            bbox=dict(boxstyle="round", facecolor="white", edgecolor=NOTE_COLOR, alpha=0.9)).set_in_layout(False)


def write_stats(rows: list[dict], path: Path) -> pl.DataFrame:
    df = pl.DataFrame(rows, schema=STATS_SCHEMA)
    df.write_csv(path)
    return df


def stats_dict(rows: list[dict]) -> dict[str, float]:
    return {r["statistic"]: r["value"] for r in rows}


def fmt(value: float, digits: int = 3) -> str:
    """A number for a figure annotation ("n/a" when undefined)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and (abs(value) >= 1e4 or (value != 0 and abs(value) < 10 ** -digits)):
        return f"{value:.2e}"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)
