"""What every stage agrees on: the key columns of labels and scores, the granularities, the checkpoint
schedule, and the defaults several settings share (one definition each).

A key row ``(prompt_id, checkpoint, position, granularity, layer, kv_head)`` names one candidate: cached entry
``position < checkpoint`` of a prompt, evicted from every layer and KV head (``token``: layer = kv_head = -1),
from one layer (``layer``: kv_head = -1) or from one layer and KV head (``head``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from kvdiag.core.errors import UserError

if TYPE_CHECKING:
    import polars as pl

# polars is imported where a table is read, not here: the CLI imports these defaults at start-up (tests/test_layout.py)
KEYS = ["prompt_id", "checkpoint", "position", "granularity", "layer", "kv_head"]
GRANULARITIES = ("token", "layer", "head")

# shared defaults (docs/oracle.md)
CHECKPOINT_INTERVAL = 128  # a checkpoint every 128 generated tokens: R-KV's compression interval
CHECKPOINTS = f"every:{CHECKPOINT_INTERVAL}"
W_OBS = 32  # observation window W_obs: the queries [t - W_obs, t) a compressor reads
W_DELAY = 128  # AvoKV-E's delay buffer: one compression interval
HORIZON = 16  # teacher-forced steps H of a label
# a label's H steps run in chunks of this many (kvdiag.label.engine): the logits of one chunk are alive at a time, so
# memory does not grow with H beyond the rows' continuation caches; at H <= CHUNK one forward, as before chunking
CHUNK = 16
HARM = "quantile:0.9"  # harmful: kl_mean above the 0.9-quantile of the analysed labels (kvdiag.core.harm)
NOISE_MULT = 1.0  # unresolved: kl_mean <= NOISE_MULT x the checkpoint's noise floor
N_BOOT = 1000  # cluster-bootstrap resamples over prompts
RHO = 0.5  # eviction fraction of the ranking metrics: the floor(rho * C) lowest-scored candidates are evicted


@functools.cache
def key_schema() -> dict:
    """The key columns' polars dtypes (polars loads on the first call, not at import)."""
    import polars as pl

    return {"prompt_id": pl.String, "checkpoint": pl.Int64, "position": pl.Int64, "granularity": pl.String,
            "layer": pl.Int64, "kv_head": pl.Int64}


def __getattr__(name: str):
    """``KEY_SCHEMA`` = :func:`key_schema`, for the modules that import it by name."""
    if name == "KEY_SCHEMA":
        return key_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_checkpoints(prompt_len: int, length: int, interval: int = CHECKPOINT_INTERVAL, horizon: int = 0,
                        w_obs: int = 0) -> list[int]:
    """The checkpoint schedule of one prompt: ``t = prompt_len + k·interval`` for ``k >= 1``, with
    ``t - prompt_len >= w_obs`` and ``t + horizon <= length`` (scoring: no horizon, no window)."""
    return [t for t in range(prompt_len + interval, length - horizon + 1, interval) if t - prompt_len >= w_obs]


def keyed(df: pl.DataFrame, what: str, fix: str) -> pl.DataFrame:
    """``df`` with its key columns cast to :data:`KEY_SCHEMA`; a missing or mistyped key column is a ``UserError``
    naming ``what`` and ``fix``."""
    import polars as pl

    missing = [k for k in KEYS if k not in df.columns]
    if missing:
        raise UserError(f"{what} lacks key column(s) {', '.join(missing)}: {fix}")
    try:
        return df.with_columns(pl.col(k).cast(t) for k, t in key_schema().items())
    except pl.exceptions.PolarsError as err:
        raise UserError(f"{what} has key columns of the wrong type ({err.__class__.__name__}): {fix}") from err


def check_checkpoint(trace, pid: str, t: int) -> None:
    """A ``UserError`` unless ``t`` is a checkpoint of prompt ``pid`` of the Trace (``1 <= t <= T``)."""
    T = trace.length(pid)
    if not 1 <= t <= T:
        raise UserError(f"checkpoint {t} of prompt {pid!r} is not in the Trace (it has positions 0..{T - 1}; a "
                        f"checkpoint t is in 1..{T})")


def check_keys(trace, keys: pl.DataFrame, what: str = "labels") -> pl.DataFrame:
    """The distinct key rows of ``keys`` (first-seen order), validated against the Trace: known prompts,
    checkpoints in the Trace, ``0 <= position < checkpoint``, layer and KV head indices that fit its model."""
    import polars as pl

    keys = keyed(keys, what, "pass a labels table written by `kvdiag label`").select(KEYS).unique(maintain_order=True)
    if keys.height == 0:
        raise UserError(f"{what} has no rows: nothing to score")
    if keys.null_count().sum_horizontal().item():
        raise UserError(f"{what} has missing values in its key columns; regenerate it")
    unknown = sorted(set(keys["prompt_id"].unique().to_list()) - set(trace.prompt_ids))
    if unknown:
        raise UserError(f"{what} names prompt {unknown[0]!r}, which is not in the Trace {getattr(trace, 'path', '')}; "
                        "pass the matching --trace")
    bad_g = sorted(set(keys["granularity"].unique().to_list()) - set(GRANULARITIES))
    if bad_g:
        raise UserError(f"{what} has granularity {bad_g[0]!r}; only token, layer and head exist")
    for pid, t in keys.select("prompt_id", "checkpoint").unique().iter_rows():
        check_checkpoint(trace, pid, t)
    bad = keys.filter((pl.col("position") < 0) | (pl.col("position") >= pl.col("checkpoint")))
    if bad.height:
        row = bad.row(0, named=True)
        raise UserError(f"{what}: position {row['position']} is not cached at checkpoint {row['checkpoint']} (need 0 "
                        "<= position < checkpoint)")
    L, Hkv = trace.num_layers, trace.num_kv_heads
    bad = keys.filter(
        ((pl.col("granularity") == "token") & ((pl.col("layer") != -1) | (pl.col("kv_head") != -1)))
        | ((pl.col("granularity") != "token") & ((pl.col("layer") < 0) | (pl.col("layer") >= L)))
        | ((pl.col("granularity") == "layer") & (pl.col("kv_head") != -1))
        | ((pl.col("granularity") == "head") & ((pl.col("kv_head") < 0) | (pl.col("kv_head") >= Hkv)))
    )
    if bad.height:
        row = bad.row(0, named=True)
        raise UserError(f"{what}: granularity {row['granularity']} with layer {row['layer']}, kv_head "
                        f"{row['kv_head']} does not fit "
                        f"a Trace of {L} layers and {Hkv} KV heads (token rows use -1, -1; layer rows kv_head -1)")
    return keys
