"""``rank_eval_files``: what ``kvdiag rank-eval`` runs, from the labels and scores files to the output directory."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import polars as pl

from kvdiag.core.contracts import read_labels, read_scores, same_trace
from kvdiag.core.errors import UserError
from kvdiag.core.io import check_writable, read_json, write_csv, write_json, write_text
from kvdiag.core.provenance import provenance
from kvdiag.rankeval.budget_figure import budget_curves_figure
from kvdiag.rankeval.evaluate import RankEvalResult, check_inputs, rank_eval
from kvdiag.rankeval.tables import to_latex, to_markdown

OUTPUTS = ("metrics.csv", "paired.csv", "table.md", "table.tex", "budget_curves.csv", "budget_curves.png",
           "budget_curves.pdf", "config.json")
TABLE_SCOPES = ("pooled", "macro")


def rank_eval_files(labels: str | os.PathLike, scores: str | os.PathLike, out: str | os.PathLike,
                    table_scope: str = "pooled", **options) -> RankEvalResult:
    """Rank every scorer of ``scores`` against the oracle ``labels`` (:func:`rank_eval` with ``options``) and
    write ``OUTPUTS`` into the directory ``out``; ``table_scope`` (pooled or macro) chooses table.md/.tex.
    Bad input (unreadable files, labels and scores of different Traces, an unwritable ``out``) is refused
    before anything is written."""
    if table_scope not in TABLE_SCOPES:
        raise UserError(f"--table-scope {table_scope} is not pooled or macro")
    out = check_writable(out, "--out", "dir")
    label_df, label_meta = read_labels(labels, full=False)
    score_df, score_meta = read_scores(scores)
    check_inputs(label_meta, score_meta)
    same_trace({f"--labels {labels}": label_meta, f"--scores {scores}": score_meta})  # each names its Trace
    result = rank_eval(label_df, score_df, scores_meta=score_meta, **options)
    write_csv(result.metrics, out / "metrics.csv")  # atomic: `kvdiag figures --rank-eval` reuses it
    write_csv(result.paired, out / "paired.csv")
    write_text(out / "table.md", to_markdown(result, table_scope))
    write_text(out / "table.tex", to_latex(result, table_scope))
    write_csv(result.budget_curves, out / "budget_curves.csv")
    budget_curves_figure(result.budget_curves, out, result.summary["candidates"])
    config = {
        "command": "rank-eval",
        **provenance(),
        "config": asdict(result.config) | {"table_scope": table_scope},
        "inputs": {
            "labels": {"path": str(labels), "meta": label_meta},  # as given: no path of this machine
            "scores": {"path": str(scores), "meta": score_meta},
        },
        "summary": result.summary,
        "outputs": list(OUTPUTS),
    }
    write_json(out / "config.json", config)
    return result


def load_summary(path: str | os.PathLike) -> dict:
    """What ``kvdiag rank-eval`` wrote into the directory ``path``: ``{"config": config.json, "table.md": text or None,
    "has_budget_curves": bool}``; a directory without config.json (rank-eval did not finish) is a ``UserError``."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise UserError("config.json is missing (rank-eval did not finish)")
    table = path / "table.md"
    info = read_json(config, "config.json")
    if not isinstance(info, dict):
        raise UserError(f"config.json {config} is not the JSON object kvdiag rank-eval writes; re-run it")
    return {"config": info, "table.md": table.read_text() if table.is_file() else None,
            "has_budget_curves": (path / "budget_curves.png").is_file()}


def load_metrics(path: str | os.PathLike, what: str = "--rank-eval") -> pl.DataFrame:
    """The metrics table (metrics.csv) ``kvdiag rank-eval`` wrote into the directory ``path``."""
    from kvdiag.core.io import read_csv
    from kvdiag.rankeval.evaluate import METRICS_SCHEMA

    metrics = Path(path) / "metrics.csv"
    if not metrics.is_file():
        raise UserError(f"{what} {path} has no metrics.csv: pass a directory written by kvdiag rank-eval")
    return read_csv(metrics, METRICS_SCHEMA, what, "re-run kvdiag rank-eval", keys=("scorer", "metric", "scope"))
