"""``kvdiag fit``: a fitted ceiling for feature-based rules (grouped cross-validation), ranked beside the rules."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console


def fit(
    trace: Path = common.flag("--trace", ..., "Trace directory the labels were made from"),
    labels: Path = common.flag("--labels", ..., "labels.parquet written by kvdiag label (token rows are used)"),
    out: Path = common.flag("--out", ..., "output directory"),
    scores: Path | None = common.flag("--scores", None, "scores.parquet of the same labels: rank the hand-made "
                                                              "rules beside the fit"),
    features: list[str] | None = typer.Option(None, "--features", help="features to use, comma-separated, repeatable "
                                                                       "(default: all; see docs/rank-eval.md)"),
    harm: str = common.Harm,
    folds: int = typer.Option(5, "--folds", help="grouped cross-validation folds (by prompt; at most the number of "
                              "prompts)"),
    bootstrap: int = common.Bootstrap,
    include_unresolved: bool = common.IncludeUnresolved,
    noise_mult: float = common.NoiseMult,
    seed: int = common.Seed,
    rule_model: str = typer.Option("logistic", "--rule-model", metavar="logistic|boosted", help="the model the "
                                   "saved rule (model.json, the fitted:PATH scorer) runs; both are saved"),
    per_cell: bool = typer.Option(False, "--per-cell", help="fit one row per (layer, KV head) cell of each labelled "
                                  "token, with the token's label (as the rule scores; allows the features cell_layer "
                                  "and cell_kv_head), instead of one row of cell-mean features per token"),
) -> None:
    """Fit logistic regression and gradient-boosted trees to the harmful label from per-entry features, rank their
    out-of-fold predictions beside the rules, save both as a rule (fitted:RUN/model.json) that runs one of them."""
    check_outputs({"--out": (out, "dir")}, {"--trace": trace, "--labels": labels, "--scores": scores})
    from kvdiag.fit import FitConfig, check_config

    cfg = FitConfig(features=tuple(parsing.parse_list(features, "--features", str)), harm=harm, n_splits=folds,
                    n_boot=bootstrap, include_unresolved=include_unresolved, noise_mult=noise_mult, seed=seed,
                    rule=rule_model, aggregation="cells" if per_cell else "mean_raw")
    check_config(cfg)  # before the stage's numpy, polars and torch
    from kvdiag.fit import fit_files
    res = fit_files(trace, labels, scores, out, cfg)
    console = plain_console()
    s = res["summary"]
    console.print(f"fit on {s['n']:,} entries ({s['n_harmful']} harmful, {s['prompts']} prompts, {s['folds']} grouped "
                  f"folds); out-of-fold metrics with rank-eval:", highlight=False)
    m = res["metrics"].filter(
        (res["metrics"]["scope"] == "pooled") & res["metrics"]["metric"].is_in(["auroc", "ap", "fsr"])
    )
    for row in m.sort("metric", "value", descending=[False, True]).iter_rows(named=True):
        console.print(f"  {row['metric']:6s} {row['scorer']:24s} {row['value']:.3f} [{row['ci_low']:.3f}, "
                      f"{row['ci_high']:.3f}]",
                      highlight=False)
    console.print("wrote features.parquet, oof_scores.parquet, metrics.csv, table.md, importances.csv, model.json to "
                  f"{out}; the fitted rule fitted:{out / 'model.json'} runs the {rule_model} model",
                  highlight=False)
