"""Ranking metrics of eviction scores against a binary harm label (pure numpy).

Conventions (docs/rank-eval.md): harmful = positive (``y = 1``); a score says how much an entry
should be *kept* (higher = keep); at eviction fraction ``rho`` the evicted set of one checkpoint is
its ``floor(rho * C)`` lowest-scored candidates.

Ties never favour either class: every metric is the expected value over a uniformly random order
inside each group of tied scores. AUROC counts a tied (harmful, safe) pair as 1/2; the tie group that
straddles a top-k or eviction boundary contributes in proportion to its harmful share.

Batching, so that neither checkpoints nor bootstrap resamples need a Python loop:

- ``segments [N]`` (integer codes, e.g. the checkpoint of each row): every metric is computed within
  each segment separately, one value per segment (K segments, in ascending code order);
- ``w [N, B]`` row weights: B weightings at once. An integer weight m is exactly the same as repeating
  the row m times; the cluster bootstrap passes prompt multiplicities.

Undefined values (AUROC without positives, Spearman of a constant) are NaN; callers say why.

Each metric is registered here with its definition (``kvdiag.rankeval.registry``): rank-eval, the tables, the
budget curves, the component figure and the report list the metrics from the registry.
"""

from __future__ import annotations

import numpy as np

from kvdiag.rankeval.registry import METRICS, Counts, register_metric

# floor(rho * C) with a tolerance, so that e.g. 0.29 * 100 = 28.999999999999996 evicts 29
_FLOOR_EPS = 1e-9
# x / max(n, _TINY) is 0 where x = n = 0 (an empty tie group contributes nothing)
_TINY = np.finfo(float).tiny

def n_evicted(rho: float, n_candidates):
    """How many of ``n_candidates`` (int or array) are evicted at fraction ``rho``: ``floor(rho * C)``."""
    return np.floor(rho * np.asarray(n_candidates) + _FLOOR_EPS).astype(int)


def _div(a, b, fill: float = np.nan) -> np.ndarray:
    """a / b, ``fill`` where b == 0."""
    a, b = np.broadcast_arrays(np.asarray(a, float), np.asarray(b, float))
    return np.divide(a, b, out=np.full(a.shape, fill), where=b != 0)


def _weights(w: np.ndarray | None, n: int) -> tuple[np.ndarray, bool]:
    """Weights as [N, B] and whether the caller passed one weighting (or none)."""
    if w is None:
        return np.ones((n, 1)), True
    w = np.asarray(w, dtype=float)
    if w.shape[0] != n or w.ndim not in (1, 2):
        raise ValueError(f"weights of shape {w.shape} do not match {n} rows")
    return (w[:, None], True) if w.ndim == 1 else (w, False)


class _Groups:
    """Rows sorted by (segment, value); tie groups = runs of equal (segment, value), G of them.

    ``x [N]`` without NaN, ``segments [N]`` integer codes or None (one segment).
    """

    def __init__(self, x: np.ndarray, segments: np.ndarray | None = None):
        x = np.asarray(x)
        if segments is None:
            self.order = np.argsort(x, kind="stable")
            seg_new = np.zeros(len(x), dtype=bool)
            seg_new[0] = True
        else:
            self.order = np.lexsort((x, segments))
            ss = np.asarray(segments)[self.order]
            seg_new = np.r_[True, ss[1:] != ss[:-1]]
        xs = x[self.order]
        self.starts = np.flatnonzero(seg_new | np.r_[True, xs[1:] != xs[:-1]])
        self.sizes = np.diff(np.r_[self.starts, len(x)])
        opens = seg_new[self.starts]  # tie groups that open a segment
        self.seg_starts = np.flatnonzero(opens)
        self.seg = np.cumsum(opens) - 1  # [G] segment index of each group
        self.n_seg = len(self.seg_starts)

    def sums(self, v: np.ndarray) -> np.ndarray:
        """Per-group sums of row values ``v [N, B]`` -> [G, B]."""
        if len(self.starts) == len(self.order):  # no ties: a plain gather is much faster
            return v[self.order]
        return np.add.reduceat(v[self.order], self.starts, axis=0)

    def seg_sums(self, g: np.ndarray) -> np.ndarray:
        """Per-segment sums of group values ``g [G, B]`` -> [K, B]."""
        if self.n_seg == 1:
            return g.sum(axis=0, keepdims=True)
        return np.add.reduceat(g, self.seg_starts, axis=0)

    def seg_dot(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per-segment sums of ``a * b`` ([G, B] each) -> [K, B]."""
        if self.n_seg == 1:
            return np.einsum("gb,gb->b", a, b)[None]
        return np.add.reduceat(a * b, self.seg_starts, axis=0)

    def expand(self, t: np.ndarray) -> np.ndarray:
        """A per-segment value ``t [K, B]`` for every group (broadcastable to [G, B])."""
        return t if self.n_seg == 1 else t[self.seg]

    def cumsum(self, g: np.ndarray) -> np.ndarray:
        """Inclusive cumulative sum of ``g [G, B]`` within each segment (integer-valued: exact)."""
        c = np.cumsum(g, axis=0)
        if self.n_seg > 1:
            c -= (c[self.seg_starts] - g[self.seg_starts])[self.seg]
        return c


class TieStats:
    """One score's tie groups, ascending: weighted harmful ``pos`` and total ``tot`` counts [G, B], their
    within-segment cumulative sums ``cpos``, ``ctot``, and segment totals ``npos``, ``ntot`` [K, B]; for rank
    correlations also ``gwdx [G, B]`` (per group, the sum of weight × centered damage rank) and ``damage``."""

    def __init__(self, groups: _Groups, pos: np.ndarray, tot: np.ndarray, gwdx: np.ndarray | None = None,
                 damage: _DamageRanks | None = None):
        self.groups, self.pos, self.tot, self.gwdx, self.damage = groups, pos, tot, gwdx, damage
        self.cpos, self.ctot = groups.cumsum(pos), groups.cumsum(tot)
        self.npos, self.ntot = groups.seg_sums(pos), groups.seg_sums(tot)

    @classmethod
    def of(cls, y: np.ndarray, s: np.ndarray, w: np.ndarray, segments: np.ndarray | None = None) -> TieStats:
        groups = _Groups(s, segments)
        return cls(groups, groups.sums(w * np.asarray(y, float)[:, None]), groups.sums(w))


def _share(taken: np.ndarray, tot: np.ndarray) -> np.ndarray:
    """Share of each tie group taken, given how many entries are still to be taken when it is reached
    (in place); its expected harmful count taken is then ``share * pos``."""
    np.clip(taken, 0.0, tot, out=taken)
    taken /= np.maximum(tot, _TINY)
    return taken


@register_metric("auroc", "rank", title="AUROC", random=lambda prevalence, rho: 0.5, needs=("harmful", "safe"),
                 table=True, figure=True)
def _auroc(st: TieStats) -> np.ndarray:
    # Mann-Whitney: each harmful entry beats the safe entries scored below it, ties count 1/2
    safe_below = st.ctot - st.cpos
    safe_below -= 0.5 * (st.tot - st.pos)
    return _div(st.groups.seg_dot(st.pos, safe_below), st.npos * (st.ntot - st.npos))


@register_metric("ap", "rank", title="AP", random=lambda prevalence, rho: prevalence, needs=("harmful", "safe"),
                 table=True, figure=True)
def _average_precision(st: TieStats) -> np.ndarray:
    # scikit-learn's non-interpolated AP: sum over thresholds (one per distinct score, descending)
    # of recall increment * precision; the threshold at group g keeps g and the groups above it
    g = st.groups
    precision = g.expand(st.npos) - st.cpos + st.pos
    precision /= np.maximum(g.expand(st.ntot) - st.ctot + st.tot, _TINY)
    return _div(g.seg_dot(st.pos, precision), st.npos)


@register_metric("prevalence", "ratio", title="Prevalence", random=lambda prevalence, rho: prevalence, per_scorer=False)
def _prevalence(c: Counts) -> tuple[np.ndarray, np.ndarray]:
    # share of harmful entries: a property of the labels, printed beside AP
    return c.harmful, c.n


@register_metric(
    "topk_recall", "rank", title="Top-k recall", random=lambda prevalence, rho: prevalence, needs=("harmful",),
    table=True, figure=True,
)
def _topk_recall(st: TieStats) -> np.ndarray:
    # k = number of harmful entries; taken from the top: k minus the weight scored above the group
    g = st.groups
    taken = g.expand(st.npos) - (g.expand(st.ntot) - st.ctot)
    return _div(g.seg_dot(st.pos, _share(taken, st.tot)), st.npos)


def _harmful_evicted(st: TieStats, n: np.ndarray) -> np.ndarray:
    # the n [K, B] lowest-scored are evicted: n minus the weight scored below the group
    taken = st.groups.expand(n) - (st.ctot - st.tot)
    return st.groups.seg_dot(st.pos, _share(taken, st.tot))


@register_metric("fsr", "ratio", title="False-safe rate", random=lambda prevalence, rho: prevalence, needs=("evicted",),
                 lower_is_better=True, table=True, figure=True, curve="FSR@ρ (harmful share of the evicted)")
def _false_safe_rate(c: Counts) -> tuple[np.ndarray, np.ndarray]:
    # reading A of "false-safe rate": the share of the evicted entries that are harmful (false omission rate)
    return c.harmful_evicted, c.evicted


@register_metric("fnr", "ratio", title="FNR", random=lambda prevalence, rho: rho, needs=("harmful",),
                 lower_is_better=True, curve="FNR@ρ (share of the harmful evicted)")
def _false_negative_rate(c: Counts) -> tuple[np.ndarray, np.ndarray]:
    # reading B: the share of the harmful entries that were evicted (miss rate)
    return c.harmful_evicted, c.harmful


def _centered_ranks(groups: _Groups, tot: np.ndarray, ctot: np.ndarray, ntot: np.ndarray):
    """Average ranks of the groups in the weighted (= duplicated) data minus their segment's weighted
    mean ``d [G, B]``; the weighted sum of squares and the number of distinct values present [K, B]."""
    d = ctot - 0.5 * (tot - 1)
    d -= groups.expand(_div(groups.seg_dot(tot, d), ntot))
    return d, groups.seg_dot(tot * d, d), groups.seg_sums((tot > 0).astype(float))


class _DamageRanks:
    """Weighted centered ranks of the continuous damage (tie groups ``groups`` of ``x [N]``), shared by
    every scorer: ``wdx [N, B]`` (weight * centered rank), ``var``, ``distinct`` [K, B]."""

    def __init__(self, groups: _Groups, w: np.ndarray):
        tot = groups.sums(w)
        d, self.var, self.distinct = _centered_ranks(groups, tot, groups.cumsum(tot), groups.seg_sums(tot))
        dx = np.empty_like(w)
        dx[groups.order] = np.repeat(d, groups.sizes, axis=0)
        self.wdx = w * dx


@register_metric("spearman", "rank", title="Spearman", random=lambda prevalence, rho: 0.0, table=True)
def _spearman(st: TieStats) -> np.ndarray:
    # Pearson correlation of average ranks; st.gwdx [G, B]: per score group, sum of weight * damage rank
    d, var, distinct = _centered_ranks(st.groups, st.tot, st.ctot, st.ntot)
    rho = _div(st.groups.seg_dot(st.gwdx, d), np.sqrt(st.damage.var * var))
    return np.where((distinct > 1) & (st.damage.distinct > 1), rho, np.nan)


def _single(metric, y, s, w):
    w, single = _weights(w, len(y))
    out = metric(TieStats.of(y, s, w))[0]
    return float(out[0]) if single else out


def auroc(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """P(score of a harmful entry > score of a safe one), ties 1/2. ``y [N]`` in {0, 1}, ``s [N]``,
    weights ``w [N]`` or ``[N, B]`` (-> [B]). Harmful entries should be *kept*, so a good scorer has AUROC
    near 1. NaN without both classes."""
    return _single(_auroc, y, s, w)


def average_precision(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """scikit-learn's ``average_precision_score`` with harmful as positive; NaN without positives."""
    return _single(_average_precision, y, s, w)


def topk_recall(y: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """Share of the harmful entries found among the k highest scores, k = number of harmful entries
    (so a perfect scorer gets 1 and a random one the prevalence). NaN without positives."""
    return _single(_topk_recall, y, s, w)


def spearman(x: np.ndarray, s: np.ndarray, w: np.ndarray | None = None) -> float | np.ndarray:
    """Spearman correlation of ``s [N]`` and ``x [N]`` (average ranks); NaN if either is constant."""
    w, single = _weights(w, len(x))
    damage = _DamageRanks(_Groups(x), w)
    groups = _Groups(s)
    tot = groups.sums(w)
    st = TieStats(groups, np.zeros_like(tot), tot, groups.sums(damage.wdx), damage)  # ranks need only the counts
    out = _spearman(st)[0]
    return float(out[0]) if single else out


class Rankings:
    """The ``rank`` metrics (AUROC, AP, top-k recall, Spearman(score, x), ...) of several scorers under many row
    weightings.

    ``y [N]`` harm label, ``scores [S, N]``, ``x [N]`` continuous damage (log KL), ``segments [N]`` or
    None. Every score is sorted once; ``rankings(w)`` evaluates weights ``w [N, B]`` (None: all 1) and
    returns ``{metric: [S, K, B]}``.
    """

    def __init__(self, y: np.ndarray, scores: np.ndarray, x: np.ndarray, segments: np.ndarray | None = None):
        self.y = np.asarray(y, float)
        self.damage_groups = _Groups(x, segments)
        self.score_groups = [_Groups(s, segments) for s in np.atleast_2d(scores)]

    def __call__(self, w: np.ndarray | None = None) -> dict[str, np.ndarray]:
        w, _ = _weights(w, len(self.y))
        n_b = w.shape[1]
        damage = _DamageRanks(self.damage_groups, w)
        # one gather + one segmented sum per scorer for the three row quantities
        rows = np.concatenate([w * self.y[:, None], w, damage.wdx], axis=1)  # [N, 3B]
        metrics = [m for m in METRICS.values() if m.kind == "rank"]
        per_scorer = []
        for groups in self.score_groups:
            sums = groups.sums(rows)
            st = TieStats(groups, sums[:, :n_b], sums[:, n_b : 2 * n_b], sums[:, 2 * n_b :], damage)
            per_scorer.append({m.name: m.compute(st) for m in metrics})
        return {m.name: np.stack([r[m.name] for r in per_scorer]) for m in metrics}


def ranking_metrics(
    y: np.ndarray, scores: np.ndarray, x: np.ndarray, w: np.ndarray | None = None, segments: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """``Rankings(y, scores, x, segments)(w)``: ``{metric: [S, K, B]}``."""
    return Rankings(y, scores, x, segments)(w)


def eviction_counts(
    y: np.ndarray, s: np.ndarray, rho: float, segments: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Evict the ``floor(rho * C)`` lowest-scored of each checkpoint's ``C`` candidates.

    ``y [N]`` harm label, ``s [N]`` score, ``segments [N]`` checkpoint codes (None: one checkpoint).
    Returns (number evicted [K], expected number of harmful entries evicted [K]); the latter is
    fractional only when a tie group straddles the boundary. FSR = harmful evicted / evicted,
    FNR = harmful evicted / harmful.
    """
    st = TieStats.of(y, s, np.ones((len(y), 1)), segments)
    n = n_evicted(rho, st.ntot)
    return n[:, 0], _harmful_evicted(st, n.astype(float))[:, 0]
