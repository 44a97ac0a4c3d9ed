"""``make_figures``: the figures of one run, their CSVs and statistics, and the checks of its inputs."""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from pathlib import Path

import polars as pl

from kvdiag.core.contracts import belongs
from kvdiag.core.errors import UserError

# importing each module registers its figure, in this order (of make_figures, figures.json and the report)
from kvdiag.figures import blind_spot, delayed_reads, components  # noqa: F401  # isort: skip
from kvdiag.core.io import check_writable, read_json, writable_dir, write_json
from kvdiag.core.progress import progress_bar
from kvdiag.core.provenance import provenance
from kvdiag.core.schema import KEYS, check_keys, keyed
from kvdiag.figures.config import FigureParams
from kvdiag.figures.registry import FIGURES, FigureContext
from kvdiag.rankeval import check_inputs
from kvdiag.scorers.token_features import read_token_features, usable_features

TRACE_FREE = {"blind_spot", "components"}  # figures that need no Trace when the scores' token features are usable
READS_FREE = TRACE_FREE | {"delayed_reads"}  # ... and when the entries' first reads are given too
LABEL_COLUMNS = ("prompt_id", "checkpoint", "position", "granularity", "kl_mean", "noise_floor")


def check_figure_inputs(trace, labels: pl.DataFrame, scores: pl.DataFrame | None, labels_meta: dict | None = None,
                        scores_meta: dict | None = None) -> pl.DataFrame:
    """Refuse inputs that do not belong together; returns the labels with typed key columns.

    Recorded Trace fingerprints must agree; every label key must fit the Trace (prompt, 0 <= position < t <= T);
    a ``token_id`` column must equal the Trace's tokens; scores must share candidates with the labels.
    """
    missing = [c for c in LABEL_COLUMNS if c not in labels.columns]
    if missing:
        raise UserError(f"labels lack column(s) {', '.join(missing)}: pass a labels.parquet written by kvdiag label")
    check_inputs(labels_meta or {}, scores_meta or {})
    if trace is not None:  # a table's metadata, when given, must record this Trace (kvdiag.core.contracts.belongs)
        for meta, what in ((labels_meta, "--labels"), (scores_meta, "--scores")):
            if meta is not None:
                belongs(trace, meta, what)
    labels = labels.with_columns(
        pl.col("layer").fill_null(-1) if "layer" in labels.columns else pl.lit(-1, pl.Int64).alias("layer"),
        pl.col("kv_head").fill_null(-1) if "kv_head" in labels.columns else pl.lit(-1, pl.Int64).alias("kv_head"),
    )
    if labels.height and trace is not None:  # None: figures drawn without the Trace (make_figures ``only``)
        check_keys(trace, labels, "--labels")
    if "token_id" in labels.columns and trace is not None:
        for (pid,), grp in labels.group_by("prompt_id"):
            ids = trace.token_ids(pid).numpy()
            bad = grp.filter(pl.Series(ids[grp["position"].to_numpy()]) != pl.col("token_id"))
            if bad.height:
                r = bad.row(0, named=True)
                raise UserError(f"--labels: token_id {r['token_id']} at position {r['position']} of {pid!r} differs "
                                "from the Trace's "
                                f"token {ids[r['position']]}: the labels come from another Trace; pass the matching "
                                "--trace")
    if scores is not None:
        keyed(scores, "--scores", "pass a scores.parquet written by kvdiag score")
        shared = labels.select(KEYS).join(scores.select(KEYS), on=list(KEYS), how="semi").height
        if labels.height and not shared:
            raise UserError("--scores share no candidate with --labels: score this labels file (kvdiag score --labels "
                            "...)")
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
    trace, labels: pl.DataFrame, scores: pl.DataFrame | None = None, out_dir: str | os.PathLike = "figures",
    params: FigureParams | None = None, *, labels_meta: dict | None = None, scores_meta: dict | None = None,
    metrics: pl.DataFrame | None = None, features: tuple[pl.DataFrame, dict] | None = None,
    command: list[str] | None = None, progress: bool = False, only: tuple[str, ...] | None = None,
    reads: tuple[pl.DataFrame, dict] | None = None,
) -> dict:
    """Draw the Appendix D figures and the component figure of one run into ``out_dir``.

    Parameters
    ----------
    trace : a :class:`kvdiag.trace.Trace` (or an object with its reader API).
    labels, scores : the labels and scores tables (``scores`` may be None: no component figure, a note instead).
    params : thresholds and definitions (:class:`FigureParams`).
    labels_meta, scores_meta : the tables' provenance (``kvdiag.core.io.read_meta``), checked against each other and the
    Trace.
    metrics : rank-eval's metrics table (metrics.csv) to reuse; computed from labels and scores when None.
    features : the scores' token features and their metadata (``kvdiag.scorers.token_features.read_token_features``),
        used for read pressure and payload when made with ``params``' definitions from this Trace; None, or
        other definitions: computed from the Trace (figures.json records which).
    command : the argv that produced this call, recorded in figures.json.
    only : the figures to draw (names of ``FIGURES``; None: all). Those that read no Trace (``blind_spot`` with
        ``features``, ``components``, ``delayed_reads`` with ``reads``) may be drawn with ``trace`` None: a report's
        tables from its committed files.
    reads : the labeled entries' first reads and their metadata (``first_reads.parquet`` that an earlier call wrote,
        ``kvdiag.core.io.read_table``), made with ``params``' read settings from the same Trace; None: from the Trace.

    Returns ``{"blind_spot": {statistic: value}, "delayed_reads": {...}, "components": [rows], "notes": [...],
    "files": [paths]}``. Writes blind_spot.*, delayed_reads.*, components.* and figures.json.
    Inputs that do not belong together and an unwritable ``out_dir`` raise ``UserError``; too few candidates
    for a statistic give NaN with a note (in the CSV and on the figure).
    """
    params = params or FigureParams()
    chosen = {name: figure for name, figure in FIGURES.items() if only is None or name in only}
    labels = check_figure_inputs(trace, labels, scores, labels_meta, scores_meta)
    features, features_source = usable_features(
        features, params.token_features, trace
    )  # refused before anything is written
    given_reads, reads_trace = _usable_reads(reads, params, trace)
    trace_free = READS_FREE if given_reads is not None else TRACE_FREE
    if trace is None and ((features is None and "blind_spot" in chosen) or not set(chosen) <= trace_free):
        raise ValueError(f"without a Trace only {sorted(READS_FREE)} can be drawn, blind_spot from usable features, "
                         "delayed_reads from given first reads")
    out = writable_dir(out_dir)
    with progress_bar(progress) as bar:
        def task(description: str, total: int):
            tid = bar.add_task(description, total=total)
            return lambda: bar.advance(tid)

        ctx = FigureContext(trace, labels, scores, params, out, scores_meta, metrics, task, features, features_source,
                            given_reads, reads_trace)
        drawn = {name: figure.draw(ctx) for name, figure in chosen.items()}

    files = [f for d in drawn.values() for f in d.files] + [out / "figures.json"]
    result = {name: d.result for name, d in drawn.items()}
    result |= {
        "notes": list(dict.fromkeys(n for d in drawn.values() for n in d.notes)), "files": [str(f) for f in files],
    }
    record = {
        "command": "figures",
        "argv": command,
        **provenance(),
        "params": asdict(params),
        "inputs": {
            "trace": getattr(trace, "provenance", None),
            "labels": labels_meta,
            "scores": scores_meta,
            "metrics": "given (rank-eval metrics.csv)"
            if metrics is not None
            else "computed with rank_eval from labels and scores",
            "read_pressure_payload": ctx.features_source,
            "first_reads": "computed from the Trace" if given_reads is None else "given (first_reads.parquet)",
        },
        # statistics of each figure (a table's rows stay in its CSV) and the notes
        "summary": {name: d.result for name, d in drawn.items() if isinstance(d.result, dict)}
        | {"notes": result["notes"]},
        "outputs": [f.name for f in files],
    }
    write_json(out / "figures.json", _jsonable(record))
    return result


def _usable_reads(reads: tuple[pl.DataFrame, dict] | None, params: FigureParams,
                  trace) -> tuple[pl.DataFrame | None, dict | None]:
    """The given first reads (table, metadata) when made with ``params``' read settings (``delayed_reads.
    READ_SETTINGS``) from ``trace``, and the provenance of the Trace they come from; other settings or another Trace:
    ``UserError``."""
    read_settings = delayed_reads.read_settings
    if reads is None:
        return None, getattr(trace, "provenance", None)
    df, meta = reads
    if meta.get("kind") != "first_reads" or meta.get("params") != read_settings(params):
        raise UserError(f"the first reads were made with {meta.get('params')} (kind {meta.get('kind')!r}), the figures "
                        f"use {read_settings(params)}: pass first_reads.parquet of a kvdiag figures run with these")
    if trace is not None:
        belongs(trace, meta, "first_reads.parquet")
    return df, meta.get("trace")


def figures_files(
    trace: str | os.PathLike, labels: str | os.PathLike, scores: str | os.PathLike, out: str | os.PathLike,
    params: FigureParams, rank_eval: str | os.PathLike | None = None, command: list[str] | None = None,
    progress: bool = True,
) -> dict:
    """What ``kvdiag figures`` runs: read the Trace, labels, scores and (``rank_eval``, a rank-eval directory) its
    metrics.csv, refusing bad input before the slow part, then :func:`make_figures`."""
    from kvdiag.core.contracts import read_labels, read_scores
    from kvdiag.trace import Trace

    check_writable(out, "--out", "dir")  # fail before the slow part, creating nothing
    if params.eligible is not None:
        from kvdiag.rankeval.candidates import eligible_scorer

        eligible_scorer(params.eligible, None)  # a registered scorer
    tr = Trace(trace)
    label_df, label_meta = read_labels(labels)
    score_df, score_meta = read_scores(scores)
    belongs(tr, label_meta, f"--labels {labels}")
    belongs(tr, score_meta, f"--scores {scores}")
    features = read_token_features(scores)
    metrics = None
    if rank_eval is not None:
        from kvdiag.rankeval.run import load_metrics

        filters = (("--min-age", params.min_age), ("--max-age", params.max_age), ("--eligible", params.eligible))
        for flag, value in filters:
            if value is not None:
                raise UserError(f"{flag} does not apply with --rank-eval (its metrics were computed on its own "
                                "candidates; pass the filters to kvdiag rank-eval); drop it")
        metrics = load_metrics(rank_eval)
    return make_figures(tr, label_df, score_df, out, params, labels_meta=label_meta, scores_meta=score_meta,
                        metrics=metrics, features=features, command=command, progress=progress)


def load_summary(path: str | os.PathLike) -> dict:
    """What ``kvdiag figures`` wrote into the directory ``path``: figures.json (params, inputs, summary, files, argv);
    a directory without it (figures did not finish) is a ``UserError``."""
    info = Path(path) / "figures.json"
    if not info.is_file():
        raise UserError("figures.json is missing (kvdiag figures did not finish)")
    summary = read_json(info, "figures.json")
    if not isinstance(summary, dict) or not all(isinstance(summary.get(k, {}), dict) for k in ("params", "summary")):
        raise UserError(f"figures.json {info} is not the JSON object kvdiag figures writes; re-run it")
    return summary
