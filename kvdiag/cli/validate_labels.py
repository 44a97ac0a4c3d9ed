"""``kvdiag validate-labels``: agreement of approximate labels with exact ones (Spearman, AUROC, top-k, where they
disagree)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console


def validate_labels(
    exact: Path = typer.Option(..., "--exact", help="labels.parquet from kvdiag label (exact method)"),
    approx: Path = typer.Option(..., "--approx", help="labels.parquet from kvdiag label --method fast|fisher (a "
                                                      "superset of the exact entries is fine)"),
    out: Path = common.flag("--out", ..., "output directory: validation.md, *.csv, validation.png, "
                                                "validation.json"),
    scores: Path = common.flag("--scores", None, "scores.parquet (kvdiag score) for the attention and payload "
                                                       "bins"),
    harmful_quantile: float = typer.Option(0.9, "--harmful-quantile", help="exact-harmful: exact kl_mean >= this "
                                                                           "quantile of its checkpoint"),
    top_k: int = typer.Option(8, "--top-k", help="top-k overlap: k most harmful entries per checkpoint"),
    bins: int = typer.Option(4, "--bins", help="quantile bins per disagreement feature"),
    seed: int = common.Seed,  # of the bootstrap
    attention: str = typer.Option("attention", "--attention", help="scores column binned as attention"),
    payload: str = typer.Option("value_norm", "--payload", help="scores column binned as payload"),
    bootstrap: int = common.Bootstrap,
    level: float = typer.Option(0.95, "--level", help="CI level"),
) -> None:
    """How far approximate labels can be trusted: per-checkpoint Spearman, AUROC for exact-harmful entries, top-k
    overlap."""
    check_outputs({"--out": (out, "dir")}, {"--exact": exact, "--approx": approx, "--scores": scores})
    from kvdiag.core.io import check_table
    from kvdiag.label.config import ValidateConfig

    cfg = ValidateConfig(
        harmful_quantile=harmful_quantile, top_k=top_k, bins=bins, n_boot=bootstrap, level=level, seed=seed,
        attention=attention, payload=payload,
    )
    cfg.validate()  # the settings and the files' footers, before polars and numpy (run_validation reads them)
    for flag, path in (("--exact", exact), ("--approx", approx), ("--scores", scores)):
        if path is not None:
            check_table(path, flag)
    from kvdiag.label.validate import run_validation
    paths = run_validation(exact, approx, out, cfg, scores)
    plain_console().print((out / "validation.md").read_text(), markup=False, highlight=False)
    plain_console().print(f"wrote {', '.join(p.name for p in paths)} to {out}", highlight=False)
