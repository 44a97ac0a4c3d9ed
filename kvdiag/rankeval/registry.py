"""Metrics defined once: each ranking metric is a :class:`Metric` registered by name. ``rank_eval`` computes every
registered metric (metrics.csv, paired.csv, the budget curves), and the Table-3 layout, the component figure and
the report take their columns from the flags here. Built-ins: ``kvdiag.rankeval.metrics``; a new metric is one
file with one ``@register_metric`` (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvdiag.core.registry import Registry


@dataclass(frozen=True)
class Counts:
    """Per-checkpoint counts of one scorer at one eviction fraction, each ``[K]``: candidates ``n``, ``harmful``
    ones, ``evicted`` ones (``floor(rho * n)``) and the expected ``harmful_evicted`` (ties split evenly)."""

    n: np.ndarray
    harmful: np.ndarray
    evicted: np.ndarray
    harmful_evicted: np.ndarray


@dataclass(frozen=True)
class Metric:
    """One ranking metric.

    ``kind`` says how ``compute`` works:

    - ``rank``: ``compute(st: TieStats) -> [K, B]``, from a score's tie groups (one value per checkpoint segment
      and row weighting); pooled = one segment, macro = the mean over checkpoints where it is defined;
    - ``ratio``: ``compute(c: Counts) -> (numerator [K], denominator [K])``; pooled = Σ numerator / Σ denominator
      over checkpoints, macro = the mean of the per-checkpoint ratios.

    A checkpoint counts toward the macro mean when it has what ``needs`` names (``harmful``, ``safe``: an entry of
    that class; ``evicted``: ``floor(rho * C) >= 1``) and, for ``rank`` metrics, a finite value.
    """

    name: str
    kind: str  # rank | ratio
    compute: Callable
    title: str  # column header of the tables and panel title of the component figure
    random: Callable[[float, float], float]  # a random scorer's expected value, from (prevalence, rho)
    needs: tuple[str, ...] = ()
    lower_is_better: bool = False
    per_scorer: bool = True  # False: a property of the labels (the same for every scorer), left out of paired.csv
    table: bool = False  # a column of the Table-3 layout (table.md, table.tex, the console table)
    figure: bool = False  # a panel of the component figure (and its table in the report)
    curve: str | None = None  # y label of its budget curve over rho (ratio metrics that depend on rho); None: no curve


# name -> Metric, in registration order (the row order of metrics.csv)
METRICS: Registry[Metric] = Registry("metric", "kvdiag.metrics")
KINDS = ("rank", "ratio")


def register_metric(name: str, kind: str, **fields) -> Callable[[Callable], Callable]:
    """Decorator: register ``compute`` as the metric ``name`` (``fields``: the rest of :class:`Metric`)."""

    def add(compute: Callable) -> Callable:
        if kind not in KINDS:
            raise ValueError(f"metric {name!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
        METRICS.add(name, Metric(name=name, kind=kind, compute=compute, **fields))
        return compute

    return add


def metrics_where(flag: str) -> list[Metric]:
    """The registered metrics with ``flag`` set (``table``, ``figure``, ``curve``, ``per_scorer``), in order."""
    return [m for m in METRICS.values() if getattr(m, flag)]
