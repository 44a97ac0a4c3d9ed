"""The learned rule's model variants and feature ablation, fitted on the training features of one ``kvdiag fit``
run (its features.parquet), without the model: each variant is ``kvdiag.fit.fit_features`` on a subset of those
columns. Token rows (the cells' mean of each feature) come from cell rows (a ``--per-cell`` run, round 1) by their
mean, which is what ``kvdiag fit`` computes for token rows (``--aggregation mean_raw`` of the same raw features), or
are the run's own rows (round 2); cell-row variants need a ``--per-cell`` run.

Which variant becomes the rule is chosen on the training prompts alone (the highest out-of-fold AUROC, grouped by
prompt); the held-out prompts only judge it (analyze.py).

    python reports/learned-rule/fit_variants.py RUN_DIR/fit-all LABELS.parquet OUT_DIR TRACE_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl

# the live features (no history: a rule that runs in a live cache, replay and kvpress too), by group
GROUPS = {
    "attention": ("window_attention", "newest_attention"),
    "rule_ranks": ("rank_snapkv", "rank_cake", "rank_tova", "rank_avokv_e", "rank_vase", "rank_rkv", "rank_obcache"),
    "position": ("log_age", "is_prompt", "log_position", "relative_position"),  # log_position: round 2
    "geometry": ("key_norm", "value_norm", "redundancy"),
    "cell": ("cell_layer", "cell_kv_head"),
}
ALL = tuple(f for group in GROUPS.values() for f in group)
TOKEN = tuple(f for f in ALL if f not in GROUPS["cell"])
BASE = ("window_attention", "newest_attention", "key_norm", "value_norm", "redundancy", "log_age", "is_prompt")
# name: (features, rows, model); rows "cells" (one per cell) or "tokens" (the cells' mean)
VARIANTS = {
    "logistic-base-tokens": (BASE, "tokens", "logistic"),  # the earlier ceiling's live features, token rows
    "logistic-all-tokens": (TOKEN, "tokens", "logistic"),
    "boosted-all-tokens": (TOKEN, "tokens", "boosted"),
    "logistic-all-cells": (ALL, "cells", "logistic"),
    "boosted-all-cells": (ALL, "cells", "boosted"),
}
SCORER = {"logistic": "fitted_logreg", "boosted": "fitted_gbt"}


def ablations(base: tuple[str, ...], rows: str, model: str) -> dict[str, tuple]:
    """The chosen variant (features ``base``) without each feature group it has."""
    return {f"without-{g}": (tuple(f for f in base if f not in fs), rows, model) for g, fs in GROUPS.items()
            if set(fs) & set(base)}


def token_rows(cells: pl.DataFrame, names: tuple[str, ...]) -> pl.DataFrame:
    """Token rows from cell rows: each feature's mean over the token's cells (keys in first-appearance order)."""
    key = ["prompt_id", "checkpoint", "position"]
    return (cells.group_by(key, maintain_order=True).agg(pl.col(n).mean() for n in names)
            .with_columns(granularity=pl.lit("token"), layer=pl.lit(-1, cells.schema["layer"]),
                          kv_head=pl.lit(-1, cells.schema["kv_head"]))
            .select("prompt_id", "checkpoint", "position", "granularity", "layer", "kv_head", *names))


def fit_one(name: str, spec: tuple, cells: pl.DataFrame, labels: pl.DataFrame, labels_meta: dict, out: Path,
            trace) -> dict:
    from kvdiag.fit import FitConfig, fit_features

    feats, rows, model = spec
    cfg = FitConfig(features=feats, rule=model, aggregation="cells" if rows == "cells" else "mean_raw", n_boot=1000)
    table = token_rows(cells, feats) if rows == "tokens" and (cells["granularity"] == "head").any() else cells
    res = fit_features(table, labels, None, out / name, cfg, labels_meta=labels_meta, trace=trace)
    m = res["metrics"].filter((pl.col("scope") == "pooled") & (pl.col("metric") == "auroc")
                              & (pl.col("scorer") == SCORER[model])).row(0, named=True)
    return {"variant": name, "rows": rows, "model": model, "features": len(feats), "oof_auroc": m["value"],
            "oof_ci_low": m["ci_low"], "oof_ci_high": m["ci_high"]}


def main(fit_dir: str, labels_path: str, out: str, trace_dir: str) -> None:
    from kvdiag.core.io import read_meta
    from kvdiag.trace import Trace

    out = Path(out)
    cells = pl.read_parquet(Path(fit_dir) / "features.parquet")
    labels = pl.read_parquet(labels_path)
    meta, trace = read_meta(labels_path), Trace(trace_dir)
    per_cell = bool((cells["granularity"] == "head").any())  # cell-row variants need a --per-cell run
    have = [f for f in ALL if f in cells.columns]
    variants = {name: (tuple(f for f in feats if f in have), rows, model)
                for name, (feats, rows, model) in VARIANTS.items() if per_cell or rows == "tokens"}
    rows = [fit_one(name, spec, cells, labels, meta, out, trace) for name, spec in variants.items()]
    best = max(rows[1:], key=lambda r: r["oof_auroc"])  # chosen on the training prompts' out-of-fold AUROC
    for name, spec in ablations(*variants[best["variant"]]).items():
        rows.append({**fit_one(name, spec, cells, labels, meta, out, trace), "ablation_of": best["variant"]})
    pl.DataFrame(rows).write_csv(out / "variants.csv")
    # the rule: the highest out-of-fold AUROC of every model fitted, the variants' ablations too (a model without a
    # feature group is a cheaper rule, and no worse where it ties)
    rule = max(rows[1:], key=lambda r: r["oof_auroc"])
    (out / "chosen.json").write_text(json.dumps({
        "variant": rule["variant"], "best_variant": best["variant"],
        "by": "out-of-fold AUROC on the training prompts (grouped by prompt), over the variants and the best "
              "variant's ablations"}, indent=1) + "\n")
    print(pl.DataFrame(rows))


if __name__ == "__main__":
    main(*sys.argv[1:])
