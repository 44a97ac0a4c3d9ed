"""A run directory's layout (what ``kvdiag report`` reads, and the command that makes each piece), checked without
torch or polars: ``kvdiag report`` refuses a run directory that holds no piece before it imports the stages."""

from __future__ import annotations

import os
from pathlib import Path

from kvdiag.core.errors import UserError

LAYOUT = {
    "trace": ("trace", "kvdiag trace --model MODEL --prompts PROMPTS --out RUN/trace"),
    "labels": ("labels.parquet", "kvdiag label --trace RUN/trace --out RUN/labels.parquet"),
    "scores": ("scores.parquet", "kvdiag score --trace RUN/trace --labels RUN/labels.parquet --out RUN/scores.parquet"),
    "rank-eval": ("rank-eval", "kvdiag rank-eval --labels RUN/labels.parquet --scores RUN/scores.parquet --out "
                               "RUN/rank-eval"),
    "figures": ("figures", "kvdiag figures --trace RUN/trace --labels RUN/labels.parquet --scores RUN/scores.parquet "
                           "--out RUN/figures"),
    "commands": ("commands.json", "kvdiag.report.run.record_command(RUN, argv) after each step"),
}
REPORT_FILES = ("report.md", "report.html", "viewer.html")  # what `kvdiag report` writes into --out


def check_run_dir(run: str | os.PathLike) -> Path:
    """``run`` as a Path; a ``UserError`` unless it is a directory holding at least one piece of :data:`LAYOUT`."""
    run = Path(run)
    if not run.is_dir():
        raise UserError(f"--run {run} is not a directory: pass the run directory (trace/, labels.parquet, ...)")
    if not any((run / rel).exists() for rel, _ in LAYOUT.values()):
        expected = ", ".join(rel for rel, _ in LAYOUT.values())
        raise UserError(f"--run {run} holds no kvdiag run piece (expected some of {expected}); pass the run directory")
    return run


def features_path(scores: str | os.PathLike) -> Path:
    """``scores.parquet`` -> ``scores.features.parquet`` (beside it: the token rows' read pressure and value payload
    that ``kvdiag score`` writes and the figures read, ``kvdiag.scorers.token_features``)."""
    scores = Path(scores)
    return scores.with_name(f"{scores.stem}.features{scores.suffix or '.parquet'}")
