"""``make_figures``: the figures of one run, their CSVs and statistics, and the checks of its inputs."""

from __future__ import annotations

import math
import os
from dataclasses import asdict

import polars as pl
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvdiag import __version__
from kvdiag.errors import UserError
from kvdiag.figures.blind_spot import blind_spot_figure
from kvdiag.figures.common import stat, stats_dict
from kvdiag.figures.components import component_metrics, components_figure
from kvdiag.figures.delayed_reads import delayed_reads_figure
from kvdiag.figures.features import trace_first_reads, trace_pressure_payload
from kvdiag.figures.params import FigureParams
from kvdiag.io import writable_dir, write_json
from kvdiag.rankeval import KEYS, check_inputs, harm_threshold, unresolved


# figure name -> (title, the CSVs beside it); the report reads this
FIGURES = {
    "blind_spot": ("(a) Attention-only blind spot", ("blind_spot_stats.csv", "blind_spot_points.csv")),
    "delayed_reads": ("(b) Delayed-read effect", ("delayed_reads_stats.csv", "delayed_reads_hist.csv", "delayed_reads_entries.csv")),
    "components": ("AvoKV-E components (Table 4, diagnostic form)", ("components.csv",)),
}
LABEL_COLUMNS = ("prompt_id", "checkpoint", "position", "granularity", "kl_mean", "noise_floor")


def check_figure_inputs(trace, labels: pl.DataFrame, scores: pl.DataFrame | None, labels_meta: dict | None = None,
                        scores_meta: dict | None = None) -> pl.DataFrame:
    """Refuse inputs that do not belong together; returns the labels with typed key columns.

    Recorded Trace fingerprints must agree; every label key must fit the Trace (prompt, 0 <= position < t <= T);
    a ``token_id`` column must equal the Trace's tokens; scores must share candidates with the labels.
    """
    from kvdiag.scorers.score import check_keys

    missing = [c for c in LABEL_COLUMNS if c not in labels.columns]
    if missing:
        raise UserError(f"labels lack column(s) {', '.join(missing)}: pass a labels.parquet written by kvdiag label")
    labels_meta, scores_meta = labels_meta or {}, scores_meta or {}
    check_inputs(labels_meta, scores_meta)
    if hasattr(trace, "check_belongs"):
        trace.check_belongs(labels_meta, "--labels")
        trace.check_belongs(scores_meta, "--scores")
    labels = labels.with_columns(pl.col("layer").fill_null(-1) if "layer" in labels.columns else pl.lit(-1, pl.Int64).alias("layer"),
                                 pl.col("kv_head").fill_null(-1) if "kv_head" in labels.columns else pl.lit(-1, pl.Int64).alias("kv_head"))
    if labels.height:
        check_keys(trace, labels, "--labels")
    if "token_id" in labels.columns:
        for (pid,), grp in labels.group_by("prompt_id"):
            ids = trace.token_ids(pid).numpy()
            bad = grp.filter(pl.Series(ids[grp["position"].to_numpy()]) != pl.col("token_id"))
            if bad.height:
                r = bad.row(0, named=True)
                raise UserError(f"--labels: token_id {r['token_id']} at position {r['position']} of {pid!r} differs from the Trace's "
                                f"token {ids[r['position']]}: the labels come from another Trace; pass the matching --trace")
    if scores is not None:
        lack = [k for k in KEYS if k not in scores.columns]
        if lack:
            raise UserError(f"--scores lacks key column(s) {', '.join(lack)}: pass a scores.parquet written by kvdiag score")
        shared = labels.select(KEYS).join(scores.select(KEYS), on=list(KEYS), how="semi").height
        if labels.height and not shared:
            raise UserError("--scores share no candidate with --labels: score this labels file (kvdiag score --labels ...)")
    return labels


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def make_figures(
    trace,
    labels: pl.DataFrame,
    scores: pl.DataFrame | None = None,
    out_dir: str | os.PathLike = "figures",
    params: FigureParams | None = None,
    *,
    labels_meta: dict | None = None,
    scores_meta: dict | None = None,
    metrics: pl.DataFrame | None = None,
    command: list[str] | None = None,
    progress: bool = False,
) -> dict:
    """Draw the Appendix D figures and the component figure of one run into ``out_dir``.

    Parameters
    ----------
    trace : a :class:`kvdiag.trace.Trace` (or an object with its reader API).
    labels, scores : the labels and scores tables (``scores`` may be None: no component figure, a note instead).
    params : thresholds and definitions (:class:`FigureParams`).
    labels_meta, scores_meta : the tables' provenance (``kvdiag.io.read_meta``), checked against each other and the Trace.
    metrics : rank-eval's metrics table (metrics.csv) to reuse; computed from labels and scores when None.
    command : the argv that produced this call, recorded in figures.json.

    Returns ``{"blind_spot": {statistic: value}, "delayed_reads": {...}, "components": [rows], "notes": [...],
    "files": [paths]}``. Writes blind_spot.*, delayed_reads.*, components.* and figures.json.
    Inputs that do not belong together and an unwritable ``out_dir`` raise ``UserError``; too few candidates
    for a statistic give NaN with a note (in the CSV and on the figure).
    """
    params = params or FigureParams()
    out = writable_dir(out_dir)
    labels = check_figure_inputs(trace, labels, scores, labels_meta, scores_meta)
    token = labels.filter(pl.col("granularity") == "token")
    below_floor = unresolved(params.noise_mult).fill_null(False)
    analysed = token if params.include_unresolved else token.filter(~below_floor)
    analysed = analysed.filter(pl.col("kl_mean").is_not_null() & pl.col("kl_mean").is_not_nan())
    kl = analysed["kl_mean"].to_numpy()
    threshold = harm_threshold(kl, params.harm) if len(kl) else float("nan")

    entries = token.select("prompt_id", "position").unique(maintain_order=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress) as bar:
        n_prompts = analysed["prompt_id"].n_unique() + entries["prompt_id"].n_unique()
        task = bar.add_task("figures: prompt × layer", total=n_prompts * trace.num_layers)
        advance = lambda: bar.advance(task)  # noqa: E731
        keys = analysed.select("prompt_id", "checkpoint", "position", "kl_mean")
        points = trace_pressure_payload(trace, keys, params.w_obs, params.w_delay, params.payload, advance) if keys.height else \
            keys.with_columns(read_pressure=pl.lit(None, pl.Float64), value_payload=pl.lit(None, pl.Float64))
        reads = trace_first_reads(trace, entries, params.w_obs, params.strong_read_mult, params.read_reduce,
                                  params.chunk_elements, params.strength_elements, advance) if entries.height else _empty_reads()

    no_eligible = points.filter(pl.col("read_pressure").is_nan()).height
    points = points.filter(pl.col("read_pressure").is_not_nan())
    extra = [
        stat("n_token_labels", token.height),
        stat("n_unresolved_excluded", 0 if params.include_unresolved else token.filter(below_floor).height),
        stat("n_no_eligible_excluded", no_eligible,
             f"{no_eligible} rows at checkpoints t <= w_delay = {params.w_delay} (no entry to normalize p over)" if no_eligible else ""),
    ]
    rows_a, files_a = blind_spot_figure(points, threshold, params, out, extra)

    entry_kl = analysed.group_by("prompt_id", "position").agg(kl=pl.col("kl_mean").mean())
    reads = reads.join(entry_kl, on=["prompt_id", "position"], how="left", maintain_order="left")
    rows_b, files_b = delayed_reads_figure(reads, params, out)

    note, given = "", metrics is not None
    if not given:
        metrics, note = component_metrics(labels, scores, params, scores_meta)
    table, files_c = components_figure(metrics, note, params, out)

    notes = list(dict.fromkeys(r["note"] for r in rows_a + rows_b if r["note"]))
    notes += list(dict.fromkeys(n for n in table.filter(pl.col("value").is_nan())["note"].to_list() if n))
    files = [*files_a, *files_b, *files_c, out / "figures.json"]
    result = {
        "blind_spot": stats_dict(rows_a),
        "delayed_reads": stats_dict(rows_b),
        "components": table.to_dicts(),
        "notes": notes,
        "files": [str(f) for f in files],
    }
    record = {
        "command": "figures",
        "argv": command,
        "kvdiag_version": __version__,
        "params": asdict(params),
        "inputs": {"trace": getattr(trace, "provenance", None), "labels": labels_meta, "scores": scores_meta,
                   "metrics": "given (rank-eval metrics.csv)" if given else "computed with rank_eval from labels and scores"},
        "summary": {k: result[k] for k in ("blind_spot", "delayed_reads", "notes")},
        "outputs": [f.name for f in files],
    }
    write_json(out / "figures.json", _jsonable(record))
    return result


def _empty_reads() -> pl.DataFrame:
    return pl.DataFrame(schema={"prompt_id": pl.String, "position": pl.Int64, "prompt_len": pl.Int64, "length": pl.Int64,
                                "window_complete": pl.Boolean, "first_window_peak": pl.Float64, "first_strong_read": pl.Int64,
                                "future_queries": pl.Int64})

