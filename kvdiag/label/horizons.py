"""Labels at shorter horizons, derived from one run's per-step KL (``kl_steps``), not recomputed.

A label at horizon h is the mean of the first h steps of a row's ``kl_steps``: the same teacher-forced continuation
with the same eviction, so a run at ``--horizon rest`` (or any N) gives the label at every shorter horizon. A row whose
own horizon is shorter than h has no label at h (null): it is never stretched or clipped silently.
"""

from __future__ import annotations

import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import REST, parse_horizon
from kvdiag.core.schema import KEYS

SUMMARY_HORIZONS = (8, 16, 32, 64, 128, 256, REST)


def at_horizons(labels: pl.DataFrame, horizons=SUMMARY_HORIZONS, keys=tuple(KEYS)) -> pl.DataFrame:
    """One row per (label row, horizon): the keys, ``at`` (the horizon asked: N, or rest), ``steps`` (the steps
    averaged: N, or the row's own horizon for rest) and ``kl_mean`` (null where the row's horizon is shorter than N).

    labels: a labels table with ``kl_steps`` (exact rows; an approximate method's rows have none and are refused), or
    any table of such rows with its own ``keys`` (the labeled sets of ``kvdiag decisions``: their joint damage)."""
    asked = [parse_horizon(h) for h in horizons]
    keys = list(keys)
    missing = sorted({*keys, "horizon", "kl_steps"} - set(labels.columns))
    if missing:
        raise UserError(f"labels lack columns {missing}: derive horizons from a labels file of `kvdiag label`")
    if labels["kl_steps"].null_count():
        raise UserError(f"{labels['kl_steps'].null_count()} label rows have no per-step KL (an approximate method's "
                        "estimates): shorter horizons derive from exact rows only; filter on method != 'fast'")
    lengths = labels["kl_steps"].list.len()
    if not (lengths == labels["horizon"]).all():
        raise UserError("labels whose kl_steps do not hold one KL per horizon step: relabel with `kvdiag label`")
    frames = []
    for h in asked:
        steps = pl.col("horizon") if h == REST else pl.lit(h, pl.Int64)
        frames.append(labels.select(
            *keys, at=pl.lit(str(h)), steps=steps,
            kl_mean=pl.when(pl.col("horizon") >= steps).then(pl.col("kl_steps").list.head(steps).list.mean()),
        ))
    return pl.concat(frames)


def horizons_summary(labels: pl.DataFrame, horizons=SUMMARY_HORIZONS) -> pl.DataFrame:
    """Per horizon asked: the rows that reach it (n), their median and mean label (nats), from ``at_horizons``."""
    return (at_horizons(labels, horizons).group_by("at", maintain_order=True)
            .agg(n=pl.col("kl_mean").is_not_null().sum(), median=pl.col("kl_mean").median(),
                 mean=pl.col("kl_mean").mean()))
