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
        if len(self.starts) == len(self.order):  # no ties: a plain gather is much faster
            return v[self.order]
        return np.add.reduceat(v[self.order], self.starts, axis=0)


# The metrics below work on the tie groups of one score, ascending: ``pos [G, B]`` weighted harmful
# count, ``tot [G, B]`` weighted count, and their cumulative sums ``cpos``, ``ctot`` (weights are
# integer-valued, so the differences of cumulative sums are exact). They run on B bootstrap resamples
# at once, hence the in-place arithmetic and einsum reductions.

# x / max(n, _TINY) is 0 where x = n = 0 (an empty group contributes nothing)
_TINY = np.finfo(float).tiny


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Column-wise dot product of [G, B] arrays -> [B]."""
    return np.einsum("gb,gb->b", a, b)


def _auroc(pos, tot, cpos, ctot):
    # Mann-Whitney: each harmful entry beats the safe entries scored below it, ties count 1/2
    safe_below = ctot - cpos
    safe_below -= 0.5 * (tot - pos)
    return _div(_dot(pos, safe_below), cpos[-1] * (ctot[-1] - cpos[-1]))


def _average_precision(pos, tot, cpos, ctot):
    # scikit-learn's non-interpolated AP: sum over thresholds (one per distinct score, descending)
    # of recall increment * precision; the threshold at group g keeps groups >= g
    precision = cpos[-1] - cpos + pos
    precision /= np.maximum(ctot[-1] - ctot + tot, _TINY)
    return _div(_dot(pos, precision), cpos[-1])


def _topk_recall(pos, tot, cpos, ctot):
    k = cpos[-1]
    taken = k - (ctot[-1] - ctot)  # k minus the weight scored strictly higher than group g
    np.clip(taken, 0.0, tot, out=taken)
    taken /= np.maximum(tot, _TINY)  # share of the group taken (its harmful share, in expectation)
    return _div(_dot(pos, taken), k)


def _centered_ranks(tot, ctot):
    """Average ranks of the groups in the weighted (= duplicated) data, minus their weighted mean:
    ``d [G, B]``, its weighted sum of squares ``[B]`` and the number of distinct values present ``[B]``."""
    d = ctot - 0.5 * (tot - 1)
    d -= _div(_dot(tot, d), ctot[-1])
    return d, _dot(tot * d, d), np.count_nonzero(tot, axis=0)


class _DamageRanks:
    """Weighted centered ranks of the continuous damage ``x [N]`` under weights ``w [N, B]``, shared
    by every scorer: ``wdx [N, B]`` (weight * centered rank), ``var [B]``, ``distinct [B]``."""

    def __init__(self, x: np.ndarray, w: np.ndarray):
        groups = _TieGroups(np.asarray(x))
        tot = groups.sums(w)
        d, self.var, self.distinct = _centered_ranks(tot, np.cumsum(tot, axis=0))
        dx = np.empty_like(w)
        dx[groups.order] = np.repeat(d, groups.sizes, axis=0)
        self.wdx = w * dx


def _spearman(tot, ctot, gwdx, damage: _DamageRanks):
    # Pearson correlation of average ranks; gwdx [G, B]: per score group, sum of weight * damage rank
    d, var, distinct = _centered_ranks(tot, ctot)
    rho = _div(_dot(gwdx, d), np.sqrt(damage.var * var))
    return np.where((distinct > 1) & (damage.distinct > 1), rho, np.nan)


def _score_groups(y: np.ndarray, s: np.ndarray, w: np.ndarray):
    """``pos, tot, cpos, ctot`` of score ``s [N]`` under weights ``w [N, B]``."""
    groups = _TieGroups(np.asarray(s))
    pos, tot = groups.sums(w * np.asarray(y, float)[:, None]), groups.sums(w)
    return pos, tot, np.cumsum(pos, axis=0), np.cumsum(tot, axis=0)


def auroc(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """P(score of a harmful entry > score of a safe one), ties 1/2. ``y [N]`` in {0, 1}, ``s [N]``.

    Harmful entries should be *kept*, so a good scorer has AUROC near 1. NaN without both classes.
    """
    w, scalar = _weights(w, len(y))
    return _out(_auroc(*_score_groups(y, s, w)), scalar)


def average_precision(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """scikit-learn's ``average_precision_score`` with harmful as positive; NaN without positives."""
    w, scalar = _weights(w, len(y))
    return _out(_average_precision(*_score_groups(y, s, w)), scalar)


def topk_recall(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """Share of the harmful entries found among the k highest scores, k = number of harmful entries
    (so a perfect scorer gets 1 and a random one the prevalence). NaN without positives."""
    w, scalar = _weights(w, len(y))
    return _out(_topk_recall(*_score_groups(y, s, w)), scalar)


def spearman(x: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """Spearman correlation of ``s [N]`` and ``x [N]`` (average ranks); NaN if either is constant."""
    w, scalar = _weights(w, len(x))
    damage = _DamageRanks(x, w)
    groups = _TieGroups(np.asarray(s))
    tot = groups.sums(w)
    return _out(_spearman(tot, np.cumsum(tot, axis=0), groups.sums(damage.wdx), damage), scalar)


RANKING_METRICS = ("auroc", "ap", "topk_recall", "spearman")


def ranking_metrics(y: np.ndarray, scores: np.ndarray, x: np.ndarray, w: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """AUROC, AP, top-k recall and Spearman(score, x) of several scorers, one sort per scorer.

    ``y [N]`` harm label, ``scores [S, N]``, ``x [N]`` continuous damage (log KL), ``w [N, B]`` weights
    or None (all 1). Returns ``{metric: [S, B]}``.
    """
    scores = np.atleast_2d(scores)
    w, _ = _weights(w, len(y))
    n_b = w.shape[1]
    damage = _DamageRanks(x, w)
    # one gather + one segmented sum per scorer for the three row quantities
    rows = np.concatenate([w * np.asarray(y, float)[:, None], w, damage.wdx], axis=1)  # [N, 3B]
    out = {m: np.empty((len(scores), n_b)) for m in RANKING_METRICS}
    for j, s in enumerate(scores):
        sums = _TieGroups(s).sums(rows)
        pos, tot, gwdx = sums[:, :n_b], sums[:, n_b : 2 * n_b], sums[:, 2 * n_b :]
        cpos, ctot = np.cumsum(pos, axis=0), np.cumsum(tot, axis=0)
        out["auroc"][j] = _auroc(pos, tot, cpos, ctot)
        out["ap"][j] = _average_precision(pos, tot, cpos, ctot)
        out["topk_recall"][j] = _topk_recall(pos, tot, cpos, ctot)
        out["spearman"][j] = _spearman(tot, ctot, gwdx, damage)
    return out


def eviction_counts(y: np.ndarray, s: np.ndarray, rho: float) -> tuple[int, float]:
    """Evict the ``floor(rho * C)`` lowest-scored of one checkpoint's ``C`` candidates.

    ``y [C]`` harm label, ``s [C]`` score. Returns (number evicted, expected number of harmful
    entries evicted); the latter is fractional only when a tie group straddles the boundary.
    FSR = harmful evicted / evicted, FNR = harmful evicted / harmful.
    """
    n = n_evicted(rho, len(y))
    pos, tot, _, ctot = _score_groups(y, s, np.ones((len(y), 1)))
    taken = np.clip(n - (ctot - tot), 0.0, tot)  # lowest first
    return n, float(_dot(pos, taken / np.maximum(tot, _TINY))[0])
