"""The labels table: its columns (:data:`LABEL_SCHEMA`) and its reader, without torch (validate-labels, decisions,
fit and figures read labels; the CLI checks them before any heavy import)."""

from __future__ import annotations

import polars as pl

from kvdiag.errors import UserError
from kvdiag.schema import KEY_SCHEMA

LABEL_SCHEMA = {
    **KEY_SCHEMA, "horizon": pl.Int64, "kl_mean": pl.Float64, "kl_max": pl.Float64,
    "kl_steps": pl.List(pl.Float64), "js_mean": pl.Float64, "nll_delta": pl.Float64, "top1_flips": pl.Int64,
    "noise_floor": pl.Float64, "age": pl.Int64, "token_id": pl.Int64,
}


def read_labels(path) -> tuple[pl.DataFrame, dict]:
    from kvdiag.io import read_table

    df, meta = read_table(path, what="labels")
    missing = set(LABEL_SCHEMA) - set(df.columns)
    if missing:
        raise UserError(f"labels {path} lacks columns {sorted(missing)}: it is not a kvdiag labels file")
    return df, meta
