"""Figures registered by name. A figure is one function ``draw(ctx: FigureContext) -> Drawn`` in its own file,
registered with ``@register_figure``; ``make_figures`` draws every registered figure (registration order) from
one context, and the report lists them from :data:`FIGURES`.

The context holds the checked inputs and the features the figures share, each made once on first use:
read pressure and value payload per analysed label (``points``: from the features ``kvdiag score`` wrote beside
the scores, ``kvdiag.scorers.token_features``; from the Trace when that file cannot serve them), the read strengths of
every future query per labeled entry (``reads``: from the Trace, since no scorer sees future queries, or from
a previous run's ``first_reads.parquet``);
rank-eval's metrics.csv when given (``given_metrics``, e.g. ``--rank-eval``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.registry import Registry
from kvdiag.core.schema import KEYS
from kvdiag.figures.config import FigureParams
from kvdiag.figures.features import trace_first_reads, trace_pressure_payload
from kvdiag.scorers.token_features import NO_FILE


@dataclass
class Drawn:
    """What a figure returns: its statistics (``{statistic: value}``, kept in figures.json's summary) or its table
    rows, the notes of undefined values (shown on the figure too) and the files it wrote."""

    result: dict[str, float] | list[dict]
    notes: list[str]
    files: list[Path]


@dataclass(frozen=True)
class Figure:
    name: str
    title: str  # the report's section title
    csvs: tuple[str, ...]  # the CSVs beside it: the report links them and tables the first (statistic, value, note)
    draw: Callable[[FigureContext], Drawn]


FIGURES: Registry[Figure] = Registry("figure", "kvdiag.figures")
READS_SCHEMA = {  # features.trace_first_reads' columns (first_reads.parquet)
    "prompt_id": pl.String, "position": pl.Int64, "prompt_len": pl.Int64, "length": pl.Int64,
    "window_complete": pl.Boolean, "first_window_peak": pl.Float64, "first_strong_read": pl.Int64,
    "future_queries": pl.Int64,
}


def register_figure(name: str, title: str, csvs: tuple[str, ...]) -> Callable:
    """Decorator: register ``draw(ctx) -> Drawn`` as the figure ``name``."""

    def add(draw: Callable[[FigureContext], Drawn]) -> Callable:
        FIGURES.add(name, Figure(name, title, tuple(csvs), draw))
        return draw

    return add


@dataclass
class FigureContext:
    """The inputs of one ``make_figures`` call and the features its figures share.

    ``labels``: checked labels of every granularity; ``token``: the token rows; ``analysed``: those analysed
    (resolved unless ``include_unresolved``, finite ``kl_mean``); ``threshold``: the harm threshold over them.
    ``given_metrics``: rank-eval's metrics table to reuse (None: a figure that needs metrics computes them).
    ``features``: the scores' token features (``kvdiag.scorers.token_features``, made with ``params.token_features``)
    or None; ``features_source`` says where ``points`` came from (figures.json).
    ``given_reads``: the labeled entries' first reads made with ``params`` (``first_reads.parquet`` of an earlier
    run of the same Trace) or None: ``reads`` computes them from the Trace.
    ``task(description, total)`` starts a progress task and returns its ``advance`` (a no-op without a bar).
    """

    trace: object
    labels: pl.DataFrame
    scores: pl.DataFrame | None
    params: FigureParams
    out: Path
    scores_meta: dict | None = None
    given_metrics: pl.DataFrame | None = None
    task: Callable[[str, int], Callable[[], None]] = lambda description, total: lambda: None
    features: pl.DataFrame | None = None
    features_source: str = NO_FILE
    given_reads: pl.DataFrame | None = None
    reads_trace: dict | None = None  # the provenance of the Trace the first reads come from (first_reads.parquet)
    token: pl.DataFrame = field(init=False)
    below_floor: pl.Expr = field(init=False)
    analysed: pl.DataFrame = field(init=False)
    threshold: float = field(init=False)

    def __post_init__(self):
        spec = self.params.harm_spec
        self.token = self.labels.filter(pl.col("granularity") == "token")
        self.below_floor = spec.unresolved()
        self.analysed = spec.analysed(self.token, what="token labels", require=False)  # none: each figure notes it
        self.threshold = spec.threshold(self.analysed["kl_mean"].to_numpy())

    @cached_property
    def points(self) -> pl.DataFrame:
        """(prompt_id, checkpoint, position, kl_mean) of every analysed label with ``read_pressure`` (NaN where the
        checkpoint has no entry of age > w_delay) and ``value_payload``, means over layers and KV heads."""
        p, keys = self.params, self.analysed.select("prompt_id", "checkpoint", "position", "kl_mean")
        if not keys.height:
            return keys.with_columns(read_pressure=pl.lit(None, pl.Float64), value_payload=pl.lit(None, pl.Float64))
        if self.features is not None:
            on = list(KEYS[:3])  # prompt_id, checkpoint, position
            joined = keys.join(
                self.features.select(*on, "read_pressure", "value_payload"), on=on, how="left", maintain_order="left"
            )
            missing = joined["value_payload"].null_count()
            if not missing:
                return joined
            self.features_source = f"computed from the Trace (the features file lacks {missing} analysed label(s))"
        advance = self.task(
            "figures: read pressure, prompt × layer", keys["prompt_id"].n_unique() * self.trace.num_layers
        )
        return trace_pressure_payload(self.trace, keys, p.token_features, advance)

    @cached_property
    def reads(self) -> pl.DataFrame:
        """``features.trace_first_reads`` of every labeled entry (unique prompt and position, resolved or not)."""
        p, entries = self.params, self.token.select("prompt_id", "position").unique(maintain_order=True)
        if not entries.height:
            return _empty_reads()
        if self.given_reads is not None:
            on = ["prompt_id", "position"]
            given = self.given_reads.select(list(READS_SCHEMA)).join(entries, on=on, how="semi")
            missing = entries.join(given, on=on, how="anti").height
            if not missing:
                return given  # in the order trace_first_reads wrote them
            if self.trace is None:
                raise UserError(f"the given first reads lack {missing} labeled entr(y/ies): pass the Trace")
        advance = self.task(
            "figures: read strengths, prompt × layer", entries["prompt_id"].n_unique() * self.trace.num_layers
        )
        return trace_first_reads(self.trace, entries, p.w_obs, p.strong_read_mult, p.read_reduce, p.chunk_elements,
                                 p.strength_elements, advance)


def _empty_reads() -> pl.DataFrame:
    return pl.DataFrame(schema=READS_SCHEMA)
