"""``kvdiag report``: one Markdown report and a self-contained HTML page of a run directory."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core.progress import plain_console


def report(
    run: Path = typer.Option(..., "--run", help="run directory: trace/, labels.parquet, scores.parquet, rank-eval/, "
                                                "figures/, commands.json"),
    out: Path | None = common.flag("--out", None, "where report.md and report.html go (default: the run "
                                                        "directory)"),
) -> None:
    """Write report.md, report.html (images embedded) and viewer.html (the token viewer) describing a run."""
    from kvdiag.core.io import check_writable
    from kvdiag.core.run_layout import check_run_dir

    check_run_dir(run)  # before matplotlib and torch (report_files reads the run's pieces)
    if out is not None:
        check_writable(out, "--out", "dir")
    from kvdiag.report.run import report_files

    md, html = report_files(run, out)
    plain_console().print(f"wrote {md}, {html} and {md.with_name('viewer.html')}", highlight=False)
