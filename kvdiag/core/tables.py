"""Markdown tables: one writer for rank-eval's table.md, replay's summary.md, the report and the benches."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence], align: str | None = None,
                   cell: Callable[[object], str] = str) -> str:
    """A Markdown table, one line per row and a final newline.

    align : one character per column, ``l`` or ``r`` (default: the first column left, the others right).
    cell : how a value becomes its text (default ``str``).
    """
    align = align or "l" + "r" * (len(headers) - 1)
    lines = [_line(headers), "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += [_line(cell(v) for v in row) for row in rows]
    return "\n".join(lines) + "\n"


def _line(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def number_text(x, digits: int = 4) -> str:
    """A report cell's text for a number: ``n/a`` for None/NaN, ``∞``, thousands separators for integral values,
    ``digits`` significant digits otherwise."""
    if x is None:
        return "n/a"
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if isinstance(x, (int, np.integer)):
        return f"{int(x):,}"
    x = float(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):  # e.g. an odds ratio with an empty cell
        return "∞" if x > 0 else "−∞"
    if x == int(x) and abs(x) < 1e9:
        return f"{int(x):,}"
    return f"{x:.{digits}g}"


def ci_text(value, low, high, digits: int = 3) -> str:
    """A value with its confidence interval, ``value [low, high]``, each as :func:`number_text`."""
    return f"{number_text(value, digits)} [{number_text(low, digits)}, {number_text(high, digits)}]"


def cell_text(x) -> str:
    """A report cell: strings as they are, numbers by :func:`number_text`; ``|`` escaped, one line."""
    text = x if isinstance(x, str) else number_text(x)
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(headers: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> str:
    """A Markdown table of report cells (:func:`cell_text`); ``align`` one char per column (l or r; default: l then
    r)."""
    return markdown_table(headers, rows, align, cell_text)


def frame_table(df) -> str:
    """A polars DataFrame as a Markdown table of report cells (None as an empty cell)."""
    return md_table(df.columns, [[("" if v is None else v) for v in row] for row in df.rows()])
