"""``kvdiag rank-eval``: rank every scorer against the oracle labels; tables in Markdown, CSV and LaTeX."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console
from kvdiag.core.schema import RHO

if TYPE_CHECKING:  # the stage (polars, pyarrow, numpy) loads when the command runs, not at the CLI's start-up
    from kvdiag.rankeval import RankEvalResult


def _print_summary(result: RankEvalResult, scope: str, out: Path, console: Console) -> None:
    import polars as pl

    from kvdiag.rankeval.registry import metrics_where
    from kvdiag.rankeval.run import OUTPUTS

    s, c = result.summary, result.config
    console.print(
        f"rank-eval: {s['n_evaluated']:,} candidates, {s['n_prompts']} prompts, {s['n_checkpoints']} "
        f"checkpoints ({s['granularity']}); harmful: kl_mean > {s['harm_threshold']:.4g} ({c.harm}), prevalence "
        f"{s['prevalence']:.3f}; "
        f"unresolved: {s['n_unresolved']} ({'excluded' if s['unresolved_excluded'] else 'included'}); candidates: "
        f"{s['candidates']}",
        highlight=False,
    )
    if "reference_note" in s:
        console.print(s["reference_note"], highlight=False)
    for warning in s["warnings"]:
        console.print(f"warning: {warning}", highlight=False)
    table = Table(title=f"{scope} metrics, FSR at rho = {c.rho:g}, {c.ci_level:.0%} CI over prompts (B = {c.n_boot})")
    table.add_column("Score")
    for m in metrics_where("table"):
        table.add_column(m.title, justify="right")
    rows = {
        (r["scorer"], r["metric"]): r for r in result.metrics.filter(pl.col("scope") == scope).iter_rows(named=True)
    }
    for name in result.scorers:
        cells = []
        for m in metrics_where("table"):
            r = rows[(name, m.name)]
            if math.isnan(r["value"]):
                cells.append("n/a")
            elif math.isnan(r["ci_low"]):
                cells.append(f"{r['value']:.3f}")
            else:
                cells.append(f"{r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")
        table.add_row(name + (" (ref)" if name == c.reference else ""), *cells)
    console.print(table)
    console.print(f"wrote {', '.join(OUTPUTS)} to {out}", highlight=False)


def rank_eval(
    labels: Path = common.flag("--labels", ..., "labels.parquet written by kvdiag label"),
    scores: Path = common.flag("--scores", ..., "scores.parquet written by kvdiag score (one column per scorer)"),
    out: Path = common.flag("--out", ..., "output directory"),
    harm: str = common.Harm,
    rho: float = typer.Option(RHO, help="eviction fraction: the lowest-scored floor(rho*C) candidates of a checkpoint "
                                        "are evicted " + common.BUDGET_TERMS),
    reference: str = typer.Option("auto", help="scorer for the paired comparisons: a score column, 'none' (no paired "
                                               "table) or 'auto' (avokv_e when the scores have it, else none)"),
    bootstrap: int = common.Bootstrap,
    seed: int = typer.Option(0, min=0, help="seed of the bootstrap (>= 0)"),
    include_unresolved: bool = common.IncludeUnresolved,
    noise_mult: float = common.NoiseMult,
    granularity: str | None = typer.Option(None, help="granularity to evaluate (token, layer, head) when the inputs "
                                                      "hold several"),
    scorers: list[str] | None = typer.Option(None, help="comma-separated score columns to evaluate, repeatable "
                                                        "(default: all)"),
    table_scope: str = typer.Option("pooled", help="scope of table.md / table.tex: pooled or macro"),
    min_age: int | None = common.MinAge,
    max_age: int | None = common.MaxAge,
    eligible: str | None = common.Eligible,
    rho_grid: list[str] | None = typer.Option(None, help="eviction fractions of the budget curves, comma-separated, "
                                                         "repeatable (default 0.1,...,0.9)"),
) -> None:
    """Rank every scorer against the oracle labels: AUROC, AP, top-k recall, false-safe rate, Spearman."""
    check_outputs({"--out": (out, "dir")}, {"--labels": labels, "--scores": scores})
    from kvdiag.core.io import check_table
    from kvdiag.scorers.names import check_eligible

    check_table(labels, "--labels")  # a missing file, before the stage's polars and numpy
    check_table(scores, "--scores")
    check_eligible(eligible)
    from kvdiag.rankeval.run import rank_eval_files

    result = rank_eval_files(
        labels,
        scores,
        out,
        table_scope,
        harm=harm,
        rho=rho,
        reference=None if reference.lower() == "none" else reference,
        n_boot=bootstrap,
        seed=seed,
        include_unresolved=include_unresolved,
        noise_mult=noise_mult,
        granularity=granularity,
        scorers=tuple(parsing.parse_list(scorers, "--scorers", str)) or None,
        min_age=min_age,
        max_age=max_age,
        eligible=eligible,
        **({"rho_grid": tuple(parsing.parse_list(rho_grid, "--rho-grid", float, low=0, high=1, strict=True,
                                                 example="0.1,0.25,0.5"))} if rho_grid else {}),
    )
    _print_summary(result, table_scope, out, plain_console())
