"""Ranking metrics of one eviction score against a binary harm label (pure numpy).

Conventions (docs/rank-eval.md): harmful = positive (``y = 1``); a score says how much an entry
should be *kept* (higher = keep); at eviction fraction ``rho`` the evicted set of one checkpoint is
its ``floor(rho * C)`` lowest-scored candidates.

Ties never favour either class: every metric is the expected value over a uniformly random order
inside each group of tied scores. AUROC counts a tied (harmful, safe) pair as 1/2; the tie group that
straddles a top-k or eviction boundary contributes in proportion to its harmful share.

Row weights: the row-level metrics take optional non-negative weights ``w [N]`` or ``w [N, B]`` (one
column per bootstrap resample). An integer weight m is exactly the same as repeating the row m times, so
the cluster bootstrap evaluates B resamples (prompt multiplicities) in one batched call. Undefined values
(AUROC without positives, Spearman of a constant) are NaN; callers say why.
"""

from __future__ import annotations

import math

import numpy as np

# floor(rho * C) with a tolerance, so that e.g. 0.29 * 100 = 28.999999999999996 evicts 29
_FLOOR_EPS = 1e-9


def n_evicted(rho: float, n_candidates: int) -> int:
    """How many of ``n_candidates`` are evicted at fraction ``rho``: ``floor(rho * C)``."""
    return math.floor(rho * n_candidates + _FLOOR_EPS)


def _div(a: np.ndarray, b: np.ndarray, fill: float = np.nan) -> np.ndarray:
    """a / b, ``fill`` where b == 0."""
    a, b = np.broadcast_arrays(np.asarray(a, float), np.asarray(b, float))
    return np.divide(a, b, out=np.full(a.shape, fill), where=b != 0)


def _weights(w: np.ndarray | None, n: int) -> tuple[np.ndarray, bool]:
    """Weights as [N, B] and whether the caller wants a scalar back."""
    if w is None:
        return np.ones((n, 1)), True
    w = np.asarray(w, dtype=float)
    if w.shape[0] != n or w.ndim not in (1, 2):
        raise ValueError(f"weights of shape {w.shape} do not match {n} rows")
    return (w[:, None], True) if w.ndim == 1 else (w, False)


def _out(x: np.ndarray, scalar: bool) -> float | np.ndarray:
    return float(x[0]) if scalar else x


class _TieGroups:
    """Rows sorted ascending by a value, and the runs of equal values. ``x [N]`` without NaN."""

    def __init__(self, x: np.ndarray):
        self.order = np.argsort(x, kind="stable")
        xs = x[self.order]
        self.starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
        self.sizes = np.diff(np.r_[self.starts, len(x)])

    def sums(self, v: np.ndarray) -> np.ndarray:
        """Per-group sums of row values ``v [N, B]`` -> [G, B], groups ascending."""
        return np.add.reduceat(v[self.order], self.starts, axis=0)

    def ranks(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Average ranks ``[N, B]`` of the rows in the weighted (= duplicated) data, and the number
        of distinct values that carry weight ``[B]``."""
        gw = self.sums(w)
        grank = np.cumsum(gw, axis=0) - gw + (gw + 1) / 2
        ranks = np.empty_like(w)
        ranks[self.order] = np.repeat(grank, self.sizes, axis=0)
        return ranks, (gw > 0).sum(axis=0)


def _take(pos: np.ndarray, neg: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Expected harmful count among the first ``k [B]`` rows, groups ``pos/neg [G, B]`` in taking order."""
    tot = pos + neg
    before = np.cumsum(tot, axis=0) - tot
    taken = np.clip(k - before, 0.0, tot)
    return (taken * _div(pos, tot, fill=0.0)).sum(axis=0)


def _class_sums(y: np.ndarray, groups: _TieGroups, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted harmful and safe counts per tie group of the score, ascending: [G, B] each."""
    pos = groups.sums(w * y[:, None])
    return pos, groups.sums(w) - pos


def _auroc(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    # Mann-Whitney: each harmful entry beats the safe entries scored below it, ties count 1/2
    below = np.cumsum(neg, axis=0) - neg
    u = (pos * (below + 0.5 * neg)).sum(axis=0)
    return _div(u, pos.sum(axis=0) * neg.sum(axis=0))


def _average_precision(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    # scikit-learn's non-interpolated AP: sum over score thresholds (descending) of
    # (recall increment) * precision, one threshold per distinct score
    pos, neg = pos[::-1], neg[::-1]
    tp, fp = np.cumsum(pos, axis=0), np.cumsum(neg, axis=0)
    precision = _div(tp, tp + fp, fill=0.0)
    return _div((pos * precision).sum(axis=0), tp[-1])


def _topk_recall(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    k = pos.sum(axis=0)
    return _div(_take(pos[::-1], neg[::-1], k), k)


def _spearman(rx: np.ndarray, ry: np.ndarray, w: np.ndarray) -> np.ndarray:
    # Pearson correlation of average ranks, rows weighted by multiplicity
    tot = w.sum(axis=0)
    dx = rx - _div((w * rx).sum(axis=0), tot)
    dy = ry - _div((w * ry).sum(axis=0), tot)
    return _div((w * dx * dy).sum(axis=0), np.sqrt((w * dx * dx).sum(axis=0) * (w * dy * dy).sum(axis=0)))


def auroc(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """P(score of a harmful entry > score of a safe one), ties 1/2. ``y [N]`` in {0, 1}, ``s [N]``.

    Harmful entries should be *kept*, so a good scorer has AUROC near 1. NaN without both classes.
    """
    w, scalar = _weights(w, len(y))
    return _out(_auroc(*_class_sums(np.asarray(y, float), _TieGroups(np.asarray(s)), w)), scalar)


def average_precision(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """scikit-learn's ``average_precision_score`` with harmful as positive; NaN without positives."""
    w, scalar = _weights(w, len(y))
    return _out(_average_precision(*_class_sums(np.asarray(y, float), _TieGroups(np.asarray(s)), w)), scalar)


def topk_recall(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """Share of the harmful entries found among the k highest scores, k = number of harmful entries
    (so a perfect scorer gets 1 and a random one the prevalence). NaN without positives."""
    w, scalar = _weights(w, len(y))
    return _out(_topk_recall(*_class_sums(np.asarray(y, float), _TieGroups(np.asarray(s)), w)), scalar)


def spearman(x: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """Spearman correlation of ``s [N]`` and ``x [N]`` (average ranks); NaN if either is constant."""
    w, scalar = _weights(w, len(x))
    rx, nx = _TieGroups(np.asarray(x)).ranks(w)
    rs, ns = _TieGroups(np.asarray(s)).ranks(w)
    rho = _spearman(rx, rs, w)
    return _out(np.where((nx > 1) & (ns > 1), rho, np.nan), scalar)


def ranking_metrics(y: np.ndarray, s: np.ndarray, x: np.ndarray, w: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """AUROC, AP, top-k recall and Spearman(s, x) in one pass over one sort of ``s``.

    ``y [N]`` harm label, ``s [N]`` score, ``x [N]`` continuous damage (log KL), ``w [N, B]`` or None.
    Returns a dict of arrays ``[B]`` (``[1]`` when ``w`` is None).
    """
    w, _ = _weights(w, len(y))
    y = np.asarray(y, float)
    groups = _TieGroups(np.asarray(s))
    pos, neg = _class_sums(y, groups, w)
    rx, nx = _TieGroups(np.asarray(x)).ranks(w)
    rs, ns = groups.ranks(w)
    return {
        "auroc": _auroc(pos, neg),
        "ap": _average_precision(pos, neg),
        "topk_recall": _topk_recall(pos, neg),
        "spearman": np.where((nx > 1) & (ns > 1), _spearman(rx, rs, w), np.nan),
    }


def eviction_counts(y: np.ndarray, s: np.ndarray, rho: float) -> tuple[int, float]:
    """Evict the ``floor(rho * C)`` lowest-scored of one checkpoint's ``C`` candidates.

    ``y [C]`` harm label, ``s [C]`` score. Returns (number evicted, expected number of harmful
    entries evicted); the latter is fractional only when a tie group straddles the boundary.
    FSR = harmful evicted / evicted, FNR = harmful evicted / harmful.
    """
    y = np.asarray(y, float)
    n = n_evicted(rho, len(y))
    pos, neg = _class_sums(y, _TieGroups(np.asarray(s)), np.ones((len(y), 1)))
    return n, float(_take(pos, neg, np.array([float(n)]))[0])
