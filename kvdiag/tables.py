"""Markdown tables: one writer for rank-eval's table.md, replay's summary.md and the report."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


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
