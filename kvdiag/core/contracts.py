"""One input contract per file kind: the checked readers every command uses (before any model loads).

A reader refuses, in one ``UserError`` line naming the file and the fix: a missing or unreadable Parquet file
(``kvdiag.core.io.read_table``), missing or mistyped columns, no rows, missing key values, a key that occurs twice, and
non-finite values where values must be finite (every score; ``kl_mean``). ``belongs`` refuses a table that does not
name the Trace it was made from, or names another. No torch: these run before it is imported.
"""

from __future__ import annotations

import os

import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_table
from kvdiag.core.schema import KEY_SCHEMA, KEYS, check_keys, keyed

LABEL_SCHEMA = {
    **KEY_SCHEMA, "horizon": pl.Int64, "kl_mean": pl.Float64, "kl_max": pl.Float64,
    "kl_steps": pl.List(pl.Float64), "js_mean": pl.Float64, "nll_delta": pl.Float64, "top1_flips": pl.Int64,
    "noise_floor": pl.Float64, "age": pl.Int64, "token_id": pl.Int64,
}


def check_rows(df: pl.DataFrame, what: str, fix: str) -> pl.DataFrame:
    """``df`` keyed (:func:`kvdiag.core.schema.keyed`), refused when it has no rows, a missing key value or a key row
    that
    occurs twice (a join on it would count that candidate twice)."""
    df = keyed(df, what, fix)
    if df.height == 0:
        raise UserError(f"{what} has no rows: {fix}")
    nulls = [k for k in KEYS if df[k].null_count()]
    if nulls:
        raise UserError(f"{what} has missing values in its key column {nulls[0]}: {fix}")
    dup = df.select(KEYS).filter(pl.struct(KEYS).is_duplicated())
    if dup.height:
        row = dup.row(0, named=True)
        raise UserError(f"{what} holds the key ({', '.join(str(row[k]) for k in KEYS)}) {dup.height} times: each "
                        f"candidate must occur once; {fix}")
    return df


def check_finite(df: pl.DataFrame, columns: list[str], what: str, fix: str) -> None:
    """Refuse a null, NaN or infinite value in any of the numeric ``columns`` of ``df``."""
    for c in columns:
        col = df[c].cast(pl.Float64)
        bad = col.null_count() + int((~col.drop_nulls().is_finite()).sum())
        if bad:
            raise UserError(f"{what} column {c!r} is null, NaN or infinite in {bad} of {df.height} rows: every value "
                            f"must be finite; {fix}")


def score_columns(df: pl.DataFrame) -> list[str]:
    """The score columns of a scores table: every numeric column that is not a key."""
    return [c for c in df.columns if c not in KEYS and df.schema[c].is_numeric()]


def read_scores(path: str | os.PathLike, what: str = "--scores") -> tuple[pl.DataFrame, dict]:
    """A scores table written by ``kvdiag score`` and its metadata: keyed, non-empty, unique keys, at least one score
    column, every score finite (``Scorer.scores`` refuses non-finite scores when they are made)."""
    fix = "pass a scores file written by `kvdiag score` (or rescore)"
    df, meta = read_table(path, what)  # its messages name the path after ``what``
    what = f"{what} {path}"
    df = check_rows(df, what, fix)
    columns = score_columns(df)
    if not columns:
        raise UserError(f"{what} has no score column: {fix}")
    # a score column of another type would be left out of every ranking without a word: refuse it
    if other := [f"{c} ({df.schema[c]})" for c in df.columns if c not in KEYS and c not in columns]:
        raise UserError(f"{what} has columns that are neither keys nor numeric scores: {', '.join(other)}; {fix}")
    check_finite(df, columns, what, fix)
    return df, meta


def read_labels(path: str | os.PathLike, what: str = "--labels", full: bool = True) -> tuple[pl.DataFrame, dict]:
    """A labels table written by ``kvdiag label`` and its metadata: every column of :data:`LABEL_SCHEMA` (``full``;
    else the keys, ``kl_mean`` and ``noise_floor``: all that rank-eval reads), keyed, non-empty, unique keys,
    ``kl_mean`` finite, ``noise_floor`` finite where given."""
    fix = "pass a labels file written by `kvdiag label` (or relabel)"
    df, meta = read_table(path, what)  # its messages name the path after ``what``
    what = f"{what} {path}"
    missing = sorted(set(LABEL_SCHEMA if full else [*KEYS, "kl_mean", "noise_floor"]) - set(df.columns))
    if missing:
        raise UserError(f"{what} lacks columns {missing}: it is not a kvdiag labels file; {fix}")
    check_types(df, {c: t for c, t in LABEL_SCHEMA.items() if c not in KEYS}, what, fix)  # keys: check_rows
    df = check_rows(df, what, fix)
    check_finite(df, ["kl_mean"], what, fix)
    floor = df["noise_floor"].cast(pl.Float64).drop_nulls().drop_nans()
    if floor.len() and not bool(floor.is_finite().all()):
        raise UserError(f"{what} column 'noise_floor' is infinite in {int((~floor.is_finite()).sum())} rows; {fix}")
    # kvdiag writes a divergence clamped at 0 (rounding) and a floor that is one: below 0 the file was altered
    for c in ("kl_mean", "noise_floor", *(["kl_max", "js_mean"] if full else [])):
        below = int((df[c].cast(pl.Float64).fill_nan(None) < 0).sum())
        if below:
            raise UserError(f"{what} column {c!r} is negative in {below} of {df.height} rows: a divergence is at "
                            f"least 0; {fix}")
    if full and (short := int((df["horizon"] < 1).sum())):
        raise UserError(f"{what} column 'horizon' is below 1 in {short} rows: a label reads at least one step; {fix}")
    return df, meta


def check_types(df: pl.DataFrame, schema: dict, what: str, fix: str) -> None:
    """Refuse a column of ``df`` that ``schema`` types otherwise (:func:`_fits`): a label or a checkpoint as text would
    pass a cast or a filter and fail deep in a stage."""
    wrong = [f"{c} ({df.schema[c]}, not {want})" for c, want in schema.items()
             if c in df.columns and not _fits(df.schema[c], want)]
    if wrong:
        raise UserError(f"{what} has columns of another type: {', '.join(wrong)}; {fix}")


def _fits(have: pl.DataType, want: pl.DataType) -> bool:
    """Whether a column of type ``have`` can stand for ``want``: an integer for an integer, a number for a float (an
    integer column of KL is still numbers), a list of numbers for a list of numbers, nulls only for anything, else
    the same type."""
    if have == pl.Null:
        return True
    if want.is_integer():  # a checkpoint or a count: 217.0 would not join with 217
        return have.is_integer()
    if want.is_numeric():
        return have.is_numeric()
    if isinstance(want, pl.List):
        return isinstance(have, pl.List) and (have.inner.is_numeric() or have.inner == pl.Null)
    return have == want



def read_keys(trace, path: str | os.PathLike, what: str = "--labels") -> pl.DataFrame:
    """The distinct key rows of the labels table at ``path``, read through its contract (:func:`read_labels`: the
    keys, ``kl_mean`` and ``noise_floor``, unique keys), which must record ``trace`` (a ``kvdiag.trace.Trace`` or,
    before torch, its ``TraceFiles``) as the Trace it was made from (:func:`belongs`), checked by
    ``kvdiag.core.schema.check_keys`` against it."""
    keys, meta = read_labels(path, what, full=False)
    belongs(trace, meta, f"{what} {path}")
    return check_keys(trace, keys, f"{what} {path}")

# one decision row: a rule and a reference may share a name (random), a stochastic selection has samples
DECISION_KEYS = ["prompt_id", "checkpoint", "kind", "decision", "budget", "sample"]
# the columns of decisions.parquet (kvdiag decisions writes them; read_decisions checks their types)
DECISION_SCHEMA = {
    "prompt_id": pl.String, "checkpoint": pl.Int64, "decision": pl.String, "kind": pl.String, "budget": pl.String,
    "kept": pl.Int64, "evicted": pl.Int64, "selection": pl.String, "horizon": pl.Int64, "status": pl.String,
    "protected": pl.Int64, "kl_mean": pl.Float64, "kl_max": pl.Float64, "kl_steps": pl.List(pl.Float64),
    "js_mean": pl.Float64, "nll_delta": pl.Float64, "top1_flips": pl.Int64, "noise_floor": pl.Float64,
    "sum_single": pl.Float64, "evicted_positions": pl.List(pl.Int64), "evicted_heads": pl.List(pl.Int64),
    "cost_rows": pl.Int64, "cost_seconds": pl.Float64, "sample": pl.Int64, "draw_seed": pl.Int64,
    "evicted_mask": pl.Binary, "search_start": pl.String, "search_improvement": pl.Float64, "read_steps": pl.Int64,
    "search_converged": pl.Boolean,
}


def read_decisions(path: str | os.PathLike, what: str = "decisions") -> tuple[pl.DataFrame, dict]:
    """A ``decisions.parquet`` written by ``kvdiag decisions`` and its metadata: its key and status columns,
    non-empty, one row per (prompt, checkpoint, kind, decision, budget, sample), ``kl_mean`` finite where labeled."""
    fix = "pass the decisions.parquet of a finished `kvdiag decisions` run"
    df, meta = read_table(path, what)  # its messages name the path after ``what``
    what = f"{what} {path}"
    missing = sorted({*DECISION_KEYS, "status", "kl_mean"} - set(df.columns))
    if missing:
        raise UserError(f"{what} lacks columns {missing}: {fix}")
    check_types(df, DECISION_SCHEMA, what, fix)
    if df.height == 0:
        raise UserError(f"{what} has no rows: {fix}")
    dup = df.filter(pl.struct(DECISION_KEYS).is_duplicated())
    if dup.height:
        raise UserError(f"{what} holds {dup.height} rows that repeat a (prompt, checkpoint, kind, decision, budget, "
                        f"sample): {fix}")
    check_finite(df.filter(pl.col("status") == "ok"), ["kl_mean"], what, fix)
    return df, meta


# generations.parquet (kvdiag replay): one row per (prompt, scorer, budget, sample); older replays lack ``sample``
GENERATION_KEYS = ["prompt_id", "scorer", "budget", "sample"]
GENERATION_SCHEMA = {"prompt_id": pl.String, "scorer": pl.String, "budget": pl.Int64, "mode": pl.String,
                     "generated": pl.Int64, "compressions": pl.Int64, "peak_kv": pl.Int64, "mean_kv": pl.Float64,
                     "kl_mean": pl.Float64, "seconds": pl.Float64}
NEVER_NULL = ["prompt_id", "scorer", "mode", "generated", "compressions", "peak_kv", "mean_kv", "seconds"]
REPLAY_MODES = ("free", "teacher_forced")
FULL_KV = "full_kv"  # the uncompressed reference rows: the only ones without a budget


def read_generations(path: str | os.PathLike, what: str = "generations") -> tuple[pl.DataFrame, dict]:
    """A ``generations.parquet`` written by ``kvdiag replay`` and its metadata: the columns of
    :data:`GENERATION_SCHEMA` with their types, non-empty, no null where a value is always written (a budget only for
    the FullKV rows), one row per (prompt, scorer, budget, sample), every number finite (null KL: not measured), and
    the run it came from: a replay's metadata (mode, settings, the prompt ids it replayed, and, teacher-forced, its
    Trace's fingerprint) that names every row's prompt and mode."""
    fix = "pass the generations.parquet of a finished `kvdiag replay` run (or rerun it)"
    df, meta = read_table(path, what)  # its messages name the path after ``what``
    what = f"{what} {path}"
    missing = sorted(set(GENERATION_SCHEMA) - set(df.columns))
    if missing:
        raise UserError(f"{what} lacks columns {missing}: it is not a kvdiag replay's generations; {fix}")
    keys = [k for k in GENERATION_KEYS if k in df.columns]
    check_types(df, {**GENERATION_SCHEMA, "sample": pl.Int64}, what, fix)
    if df.height == 0:
        raise UserError(f"{what} has no rows; {fix}")
    for c in NEVER_NULL + (["sample"] if "sample" in df.columns else []):
        if n := df[c].null_count():
            raise UserError(f"{what} column {c!r} is missing in {n} of {df.height} rows; {fix}")
    if n := df.filter(pl.col("budget").is_null() & (pl.col("scorer") != FULL_KV)).height:
        raise UserError(f"{what} has {n} compressed rows without a budget; {fix}")
    if n := df.select(keys).is_duplicated().sum():
        raise UserError(f"{what} holds {n} rows that repeat a ({', '.join(keys)}): each generation must occur once; "
                        f"{fix}")
    for c in [c for c in df.columns if df.schema[c].is_numeric()]:
        col = df[c].cast(pl.Float64).drop_nulls()
        if bad := int((~col.is_finite()).sum()):
            raise UserError(f"{what} column {c!r} is NaN or infinite in {bad} of {df.height} rows; {fix}")
    mode, prompt_ids = meta.get("mode"), meta.get("prompt_ids")
    if meta.get("kind") != "replay" or mode not in REPLAY_MODES or not isinstance(prompt_ids, list) \
            or not isinstance(meta.get("settings"), dict):
        raise UserError(f"{what} does not record the replay it came from (kind, mode, settings, prompt ids in its "
                        f"metadata); {fix}")
    if mode == "teacher_forced":
        trace_of(meta, what)
    if (other := set(df["mode"].unique().to_list()) - {mode}):
        raise UserError(f"{what} holds {sorted(other)[0]} rows in a {mode} replay; {fix}")
    if stray := sorted(set(df["prompt_id"].unique().to_list()) - set(prompt_ids)):
        raise UserError(f"{what} holds generations of prompt {stray[0]!r}, which its replay did not replay "
                        f"({len(stray)} such prompts); {fix}")
    return df, meta


def trace_of(meta: dict, what: str) -> str:
    """The fingerprint of the Trace a table's metadata ``meta`` records; refused when it records none (a table
    without provenance could come from any Trace)."""
    fp = (meta.get("trace") or {}).get("fingerprint")
    if not fp:
        raise UserError(f"{what} does not record the Trace it was made from (no trace fingerprint in its metadata): "
                        "pass a file written by kvdiag (label, score) for this Trace")
    return fp


def belongs(trace, meta: dict, what: str) -> None:
    """Refuse a table whose metadata does not name the Trace it was made from, or names another than ``trace`` (a
    ``kvdiag.trace.Trace`` or, read without torch, a ``kvdiag.trace.manifest.TraceFiles``)."""
    theirs = trace_of(meta, what)
    if theirs != trace.fingerprint:
        raise UserError(f"{what} was made from another Trace (fingerprint {theirs}; --trace {trace.path} has "
                        f"{trace.fingerprint}): pass the matching --trace")


def same_trace(metas: dict[str, dict]) -> str:
    """The one Trace fingerprint that the tables ``metas`` (what -> metadata) all record; refused when one records
    none or two differ (tables compared row by row must be about the same tokens)."""
    fps = {what: trace_of(meta, what) for what, meta in metas.items()}
    (a, fa), *rest = fps.items()
    for b, fb in rest:
        if fb != fa:
            raise UserError(f"{b} was made from another Trace than {a} (fingerprints {fb} and {fa}): pass tables of "
                            "the same Trace")
    return fa


__all__ = ["DECISION_KEYS", "GENERATION_SCHEMA", "LABEL_SCHEMA", "belongs", "check_finite", "check_rows",
           "read_decisions", "read_generations", "read_keys", "read_labels", "read_scores", "same_trace",
           "score_columns", "trace_of"]
