"""``kvdiag report``: one Markdown report and a self-contained HTML page of a run directory."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def report(
    run: Path = typer.Option(..., "--run", help="run directory: trace/, labels.parquet, scores.parquet, rank-eval/, figures/, commands.json"),
    out: Path | None = typer.Option(None, "--out", help="where report.md and report.html go (default: the run directory)"),
) -> None:
    """Write report.md and report.html (images embedded) describing a run: trace, labels, metrics, figures, commands."""
    from kvdiag.report import build_report

    md, html = build_report(run, out)
    Console().print(f"wrote {md} and {html}", highlight=False)
