"""kvdiag.core.stats against closed forms and scipy: exact paired tests, the test each comparison picks, per-cluster
ratio
summaries, Spearman's n, Kendall's exact p, Wilson, McNemar, Mann–Whitney and the one p-value formatter."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.stats import spearmanr

from kvdiag.core.stats import (
    EXACT_BELOW,
    PromptBootstrap,
    cluster_means,
    compare,
    format_p,
    format_test,
    kendall,
    mann_whitney,
    mcnemar,
    paired_test,
    permutation_test,
    rank_biserial,
    ratio_summary,
    sign_test,
    spearman_ci,
    wilson,
)


def test_sign_test_is_the_exact_binomial_tail():
    t = sign_test(np.array([-1.0] * 9 + [2.0]))
    # two-sided: 2 * P(X <= 1), X ~ Bin(10, 1/2) = 2 * 11 / 1024
    assert (t.test, t.n, t.below, t.above, t.ties) == ("sign", 10, 9, 1, 0)
    assert t.p == pytest.approx(22 / 1024, rel=1e-12)
    assert sign_test(np.ones(5)).p == pytest.approx(2 / 32, rel=1e-12)  # 5 of 5: TOVA's 0.0625
    assert sign_test(np.array([-1.0] * 8 + [1.0] * 2)).p == pytest.approx(2 * 56 / 1024, rel=1e-12)
    tied = sign_test(np.array([0.0, 0.0, 1.0, np.nan]))  # ties dropped (and counted), NaN not entered
    assert (tied.n, tied.ties, tied.above, tied.p) == (3, 2, 1, 1.0)


def test_permutation_test_enumerates_every_sign_flip():
    d = np.array([1.0, 2.0, 3.0, -0.5, 4.0, 0.7])
    flips = np.array(list(itertools.product([1, -1], repeat=len(d))))
    means = (flips * d).mean(1)
    want = np.mean(np.abs(means) >= abs(d.mean()) - 1e-12)  # two-sided, by hand over all 64 flips
    t = permutation_test(d)
    assert t.test == "permutation" and t.resolution == 0 and t.p == pytest.approx(want, rel=1e-12)
    big = permutation_test(np.random.default_rng(0).normal(1.0, 1.0, 25), n_resamples=999)
    assert big.test == "permutation (Monte Carlo)" and big.resolution == pytest.approx(1 / 1000) and big.p < 0.01
    one = permutation_test(np.array([0.3]))  # one cluster: both flips are as extreme as the observed mean
    assert (one.test, one.p, one.n, one.above) == ("permutation", 1.0, 1, 1)


def test_paired_test_is_exact_below_30_clusters_and_says_which_test():
    rng = np.random.default_rng(1)
    reps = rng.normal(1.0, 0.1, 1000)  # replicates of a mean difference far from 0
    small = paired_test(np.ones(EXACT_BELOW - 1), reps)
    assert small.test == "sign" and small.p == pytest.approx(2 * 0.5 ** (EXACT_BELOW - 1))
    large = paired_test(np.ones(EXACT_BELOW), reps)
    assert large.test == "bootstrap" and large.p == 0.0 and large.resolution == pytest.approx(2 / 1000)
    assert paired_test(np.ones(40), None).test == "sign"  # no replicates: exact
    assert paired_test(np.arange(1.0, 6.0), reps, exact="permutation").test == "permutation"


def test_format_p_prints_the_resolution_and_names_the_test():
    assert format_p(0.0, 2 / 1000) == "< 0.002" and format_p(0.0214) == "0.021" and format_p(None) == "n/a"
    assert format_p(float("nan")) == "n/a" and format_p(3.14e-5) == "3.1e-05" and format_p(1.0) == "1"
    assert format_test(sign_test(np.array([-1.0] * 9 + [2.0]))) == "p = 0.021 (exact sign test, lower in 9 of 10)"
    boot = paired_test(np.ones(40), np.ones(500))
    assert format_test(boot) == "p < 0.004 (paired bootstrap, 40 clusters)"
    assert format_test({**boot.as_dict(), "resolution": boot.resolution}) == format_test(boot)


def test_cluster_means_drop_nan_and_sort_clusters():
    ids, means = cluster_means(np.array([1.0, 3.0, np.nan, 5.0]), np.array(["b", "b", "a", "a"]))
    assert ids.tolist() == ["a", "b"] and means.tolist() == [5.0, 2.0]


def test_ratio_summary_is_per_cluster():
    # cluster a: rows with ratios 2 and 8 (geometric mean 4); cluster b: ratio 0.5; c: a zero side, dropped
    x, y = np.array([2.0, 8.0, 1.0, 0.0]), np.array([1.0, 1.0, 2.0, 1.0])
    prompts = np.array(["a", "a", "b", "c"])
    boot = PromptBootstrap(["a", "b", "c"], 400, 0, 0.95)
    r = ratio_summary(boot, x, y, prompts)
    assert r["geomean"] == pytest.approx(math.sqrt(4 * 0.5), rel=1e-12)
    # the plain median of two clusters' ratios (4 and 0.5): their midpoint, not the geometric mean's sqrt(2)
    assert r["median"] == pytest.approx((4 + 0.5) / 2, rel=1e-12)
    assert (r["below"], r["n"], r["dropped"]) == (1, 2, 1)
    assert 0.5 - 1e-9 <= r["geomean_ci"][0] <= r["geomean"] <= r["geomean_ci"][1] <= 4 + 1e-9


def test_compare_reports_difference_ratio_and_exact_test():
    rng = np.random.default_rng(2)
    prompts = np.repeat([f"p{i}" for i in range(8)], 3)
    y = rng.uniform(1, 2, 24)
    x = y * 1.5
    c = compare(PromptBootstrap(list(set(prompts)), 300, 0, 0.95), x, y, prompts)
    assert c["diff"] == pytest.approx((x - y).mean()) and c["ratio"] == pytest.approx(1.5)
    assert c["ratios"]["geomean"] == pytest.approx(1.5) and c["ratios"]["below"] == 0
    assert c["test"].test == "sign" and c["test"].n == 8 and c["test"].p == pytest.approx(2 / 256)
    assert c["n"] == 24 and c["clusters"] == 8


def test_spearman_n_counts_the_pairs_that_entered():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=40), rng.normal(size=40)
    x[:5] = np.nan
    y[5:12] = np.nan  # 28 pairs where both are defined, 35 finite x
    prompts = np.repeat([f"p{i}" for i in range(10)], 4)
    r = spearman_ci(PromptBootstrap(list(set(prompts)), 200, 0, 0.95), x, y, prompts)
    ok = np.isfinite(x) & np.isfinite(y)
    assert r["n"] == 28 and r["spearman"] == pytest.approx(spearmanr(x[ok], y[ok])[0], rel=1e-12)
    assert r["ci_low"] <= r["spearman"] <= r["ci_high"]


def test_kendall_p_is_exact_over_every_permutation():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    y = np.array([2.0, 1.0, 4.0, 3.0, 7.0, 5.0, 6.0])

    def tau(a, b):  # no ties: (concordant - discordant) / all pairs
        s = [np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in itertools.combinations(range(len(a)), 2)]
        return sum(s) / len(s)

    taus = np.array([tau(x, y[list(perm)]) for perm in itertools.permutations(range(len(y)))])  # all 5,040
    want = np.mean(np.abs(taus) >= abs(tau(x, y)) - 1e-12)  # two-sided, by hand
    k = kendall(np.append(x, np.nan), np.append(y, 1.0))  # the NaN pair does not enter
    assert (k["test"], k["n"]) == ("exact", 7) and k["tau"] == pytest.approx(tau(x, y), rel=1e-12)
    assert k["p_value"] == pytest.approx(want, rel=1e-9)
    tied = kendall(np.array([1.0, 1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0, 4.0]))
    assert tied["test"] == "asymptotic" and 0 < tied["p_value"] < 1
    assert math.isnan(kendall(np.array([1.0, 2.0]), np.array([2.0, 1.0]))["p_value"])


def test_wilson_and_mcnemar_closed_forms():
    z = 1.959963984540054
    centre, half = (4 + z**2 / 2) / (10 + z**2), z * math.sqrt(4 * 6 / 10 + z**2 / 4) / (10 + z**2)
    assert wilson(4, 10) == pytest.approx((centre - half, centre + half), rel=1e-9)
    assert all(math.isnan(v) for v in wilson(0, 0))
    a = np.array([1, 1, 1, 1, 1, 1, 0, 0], bool)
    b = np.array([0, 0, 0, 0, 0, 1, 0, 1], bool)  # 5 discordant one way, 1 the other
    assert mcnemar(a, b) == pytest.approx(2 * (1 + 6) / 64, rel=1e-12) and mcnemar(a, a) == 1.0


def test_mann_whitney_and_rank_biserial_equal_cliffs_delta():
    x, y = np.array([3.0, 4.0, 5.0, 5.0]), np.array([1.0, 2.0, 5.0])
    delta = np.mean([np.sign(a - b) for a in x for b in y])  # P(X > Y) - P(X < Y)
    rows, note = mann_whitney(x, y, 3, "test")
    s = {r["statistic"]: r["value"] for r in rows}
    assert note == "" and s["rank_biserial"] == pytest.approx(delta)
    assert rank_biserial(s["mwu_u"], 4, 3) == pytest.approx(delta)
    rows, note = mann_whitney(x, y[:2], 3, "test")
    assert "too few" in note and all(math.isnan(r["value"]) for r in rows)
