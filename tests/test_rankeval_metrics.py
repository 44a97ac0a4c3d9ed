"""Ranking metrics: equal to scikit-learn / scipy, weights equal duplication, hand-computed cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import spearmanr
from sklearn.metrics import average_precision_score, roc_auc_score

from kvdiag.rankeval import (
    auroc,
    average_precision,
    eviction_counts,
    n_evicted,
    ranking_metrics,
    spearman,
    topk_recall,
)


def _cases(n_cases: int = 60, seed: int = 0):
    """Random (y, s, x) with both classes; half of the scorers have many ties."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n_cases:
        n = int(rng.integers(2, 80))
        y = (rng.random(n) < rng.uniform(0.05, 0.6)).astype(float)
        if y.min() == y.max():
            continue
        s = rng.integers(0, 4, n).astype(float) if len(out) % 2 else rng.normal(size=n) + y
        out.append((y, s, rng.normal(size=n) + s))
    return out


def test_auroc_and_ap_equal_sklearn():
    for y, s, _ in _cases():
        assert auroc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
        assert average_precision(y, s) == pytest.approx(average_precision_score(y, s), abs=1e-12)


def test_spearman_equals_scipy():
    for _, s, x in _cases():
        assert spearman(x, s) == pytest.approx(spearmanr(x, s).statistic, abs=1e-12)


def test_ranking_metrics_match_single_metric_functions_for_several_scorers():
    y, s, x = _cases(1, seed=3)[0]
    scores = np.stack([s, -s, x])
    got = ranking_metrics(y, scores, x)
    for j, sj in enumerate(scores):
        assert got["auroc"][j, 0, 0] == pytest.approx(roc_auc_score(y, sj))
        assert got["ap"][j, 0, 0] == pytest.approx(average_precision_score(y, sj))
        assert got["topk_recall"][j, 0, 0] == pytest.approx(topk_recall(y, sj))
        assert got["spearman"][j, 0, 0] == pytest.approx(spearmanr(x, sj).statistic)


def test_integer_weights_equal_repeated_rows():
    # the cluster bootstrap relies on this: a weight m is the row repeated m times
    rng = np.random.default_rng(1)
    for y, s, x in _cases(30, seed=2):
        w = rng.integers(0, 3, size=(len(y), 4)).astype(float)
        batched = ranking_metrics(y, s, x, w)
        for b in range(w.shape[1]):
            idx = np.repeat(np.arange(len(y)), w[:, b].astype(int))
            yy, ss, xx = y[idx], s[idx], x[idx]
            if yy.min() == yy.max() or ss.min() == ss.max():
                continue
            assert batched["auroc"][0, 0, b] == pytest.approx(roc_auc_score(yy, ss))
            assert batched["ap"][0, 0, b] == pytest.approx(average_precision_score(yy, ss))
            assert batched["topk_recall"][0, 0, b] == pytest.approx(topk_recall(yy, ss))
            assert batched["spearman"][0, 0, b] == pytest.approx(spearmanr(xx, ss).statistic)


def test_topk_recall_hand_cases():
    y = np.array([1, 0, 1, 0, 0.0])
    # top-2 by score: rows 0 (9) and 1 (8): one of the two harmful entries
    assert topk_recall(y, np.array([9, 8, 1, 2, 3.0])) == pytest.approx(0.5)
    assert topk_recall(y, np.array([9, 1, 8, 2, 3.0])) == pytest.approx(1.0)
    # a tie group straddling k: rows 0, 1, 2 tied on top, k = 2 -> expected 2 * (2/3) harmful of 2
    assert topk_recall(y, np.array([5, 5, 5, 0, 0.0])) == pytest.approx(2 / 3)


def test_tie_handling_is_the_mean_over_random_tie_breaks():
    # every metric on tied scores = the average over all orders of the tied rows
    y = np.array([1, 0, 0, 1, 0, 1.0])
    s = np.array([2, 2, 2, 1, 1, 0.0])
    breaks = [np.array(p, float) * 1e-3 for p in itertools.permutations(range(6))]
    assert topk_recall(y, s) == pytest.approx(np.mean([topk_recall(y, s + b) for b in breaks]))
    assert auroc(y, s) == pytest.approx(np.mean([auroc(y, s + b) for b in breaks]))
    n, h = eviction_counts(y, s, 0.5)
    assert n[0] == 3 and h[0] == pytest.approx(np.mean([eviction_counts(y, s + b, 0.5)[1][0] for b in breaks]))


def test_eviction_counts_hand_cases():
    y = np.array([1, 0, 0, 1, 0.0])
    # floor(0.5 * 5) = 2 lowest: rows 1 (score 0) and 3 (score 1) -> one harmful evicted
    assert [v.tolist() for v in eviction_counts(y, np.array([4, 0, 3, 1, 2.0]), 0.5)] == [[2], [1.0]]
    assert [v.tolist() for v in eviction_counts(y, np.array([4, 0, 3, 1, 2.0]), 0.1)] == [[0], [0.0]]
    assert n_evicted(0.29, 100) == 29  # 0.29 * 100 = 28.999999999999996 in floating point
    assert n_evicted(0.5, 7) == 3


def test_segments_equal_separate_calls():
    # all checkpoints in one vectorized pass = one call per checkpoint
    cases = _cases(12, seed=5)
    y, s, x = (np.concatenate(v) for v in zip(*cases, strict=True))
    seg = np.repeat(np.arange(len(cases))[::-1] * 7, [len(c[0]) for c in cases])  # any integer codes
    got = ranking_metrics(y, np.stack([s, x]), x, segments=seg)
    n, h = eviction_counts(y, s, 0.4, seg)
    for k, (yk, sk, xk) in enumerate(reversed(cases)):  # segments come in ascending code order
        want = ranking_metrics(yk, np.stack([sk, xk]), xk)
        for m in want:
            np.testing.assert_allclose(got[m][:, k], want[m][:, 0], atol=1e-12)
        nk, hk = eviction_counts(yk, sk, 0.4)
        assert (n[k], h[k]) == (nk[0], pytest.approx(hk[0]))


def test_undefined_cases_are_nan():
    assert np.isnan(auroc(np.zeros(4), np.arange(4.0)))
    assert np.isnan(average_precision(np.zeros(4), np.arange(4.0)))
    assert np.isnan(topk_recall(np.zeros(4), np.arange(4.0)))
    assert np.isnan(spearman(np.arange(4.0), np.ones(4)))
