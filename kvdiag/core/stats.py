"""Every statistic a report prints: the cluster bootstrap over prompts, percentile intervals, paired tests (exact
sign / permutation tests below ``EXACT_BELOW`` clusters, the bootstrap p-value above), per-cluster ratio summaries,
Spearman with its CI, Kendall's tau with its exact p, Wilson intervals, Clopper-Pearson upper bounds, McNemar,
Mann–Whitney, Holm, and the one p-value formatter.

Candidates of one prompt share a cache and a model state, so they are not independent: the
bootstrap resamples *prompts* with replacement and keeps all their checkpoints and candidates. A
resample is a vector of prompt multiplicities; a prompt drawn twice counts as two clusters (its
checkpoints count twice in macro averages, its rows twice in pooled metrics). Scorers are compared on
the *same* resamples (paired bootstrap).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def prompt_multiplicities(n_prompts: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """How often each prompt is drawn when ``n_prompts`` prompts are resampled with replacement,
    ``n_boot`` times: int [B, P], every row sums to P."""
    return rng.multinomial(n_prompts, np.full(n_prompts, 1.0 / n_prompts), size=n_boot)


def percentile_ci(reps: np.ndarray, level: float = 0.95) -> tuple[float, float, int]:
    """Percentile interval of the defined (finite) bootstrap replicates ``reps [B]``.

    Returns (low, high, number of defined replicates); (NaN, NaN, 0) when none is defined.
    """
    ok = reps[np.isfinite(reps)]
    if ok.size == 0:
        return float("nan"), float("nan"), 0
    alpha = (1.0 - level) / 2
    low, high = np.quantile(ok, [alpha, 1.0 - alpha])
    return float(low), float(high), int(ok.size)


def paired_p_value(diffs: np.ndarray) -> float:
    """Two-sided bootstrap p-value of a paired difference being 0, from its replicates ``diffs [B]``.

    ``2 * min(share of replicates <= 0, share >= 0)``, capped at 1; NaN replicates are dropped.
    Its resolution is ``2 / B``: 0 means "below 2 / B" (:func:`format_p`). Reports use :func:`paired_test`.
    """
    ok = diffs[np.isfinite(diffs)]
    if ok.size == 0:
        return float("nan")
    return float(min(1.0, 2.0 * min(np.mean(ok <= 0), np.mean(ok >= 0))))


def holm(p: np.ndarray) -> np.ndarray:
    """Holm step-down adjusted p-values of one family of tests ``p [m]`` (NaN entries stay NaN and are
    not counted in the family)."""
    p = np.asarray(p, dtype=float)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    order = idx[np.argsort(p[idx], kind="stable")]
    m = len(order)
    out[order] = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    return out


class PromptBootstrap:
    """The cluster bootstrap of one run: prompts sorted, multiplicities ``mult [B, P]`` (None when ``n_boot`` is 0)."""

    def __init__(self, prompts: list[str], n_boot: int, seed: int, level: float):
        self.prompts = sorted(prompts)
        self.index = {p: i for i, p in enumerate(self.prompts)}
        self.mult = prompt_multiplicities(len(self.prompts), n_boot, np.random.default_rng(seed)) if n_boot else None
        self.level = level

    def mean(self, values: np.ndarray, prompts: np.ndarray) -> tuple[float, np.ndarray]:
        """(mean of ``values [N]``, its replicates [B]); each value weighs its prompt's multiplicity."""
        if not len(values):
            return float("nan"), np.full(0 if self.mult is None else len(self.mult), np.nan)
        if self.mult is None:
            return float(values.mean()), np.empty(0)
        w = self.mult[:, [self.index[p] for p in prompts]].astype(float)  # [B, N]
        with np.errstate(invalid="ignore", divide="ignore"):
            return float(values.mean()), (w @ values) / w.sum(1)

    def ci(self, reps: np.ndarray) -> tuple[float, float]:
        low, high, _ = percentile_ci(reps, self.level) if len(reps) else (float("nan"), float("nan"), 0)
        return low, high


# --------------------------------------------------------------------------- paired comparisons

EXACT_BELOW = 30  # clusters: below this a paired comparison uses an exact test, not the bootstrap p-value
EXACT_ENUMERATION = 20  # clusters up to which the permutation test enumerates all 2^n sign flips


@dataclass(frozen=True)
class PairedTest:
    """A paired test of ``a - b = 0`` over clusters: which test, its two-sided p, the clusters that entered
    (``n``), how many of them had ``a < b`` (``below``: a won, for a damage), ``a > b`` (``above``) and ties;
    ``resolution``: the smallest p the test can tell from 0 (a bootstrap p of 0 means "below it"), 0 for exact."""

    test: str  # "sign" (exact sign test), "permutation" (exact sign-flip permutation), "bootstrap"
    p: float
    n: int
    below: int
    above: int
    ties: int
    resolution: float = 0.0

    def as_dict(self) -> dict:
        return {"test": self.test, "p_value": self.p, "n": self.n, "below": self.below, "above": self.above,
                "ties": self.ties}


def _counts(d: np.ndarray) -> tuple[int, int, int]:
    return int((d < 0).sum()), int((d > 0).sum()), int((d == 0).sum())


def sign_test(diffs: np.ndarray) -> PairedTest:
    """Exact two-sided sign test of the paired differences ``diffs [n]`` (one per cluster): under H0 each nonzero
    difference is positive with probability 1/2; ties are dropped (and counted). p is 1 when every one ties."""
    from scipy.stats import binomtest

    d = np.asarray(diffs, dtype=float)
    d = d[np.isfinite(d)]
    below, above, ties = _counts(d)
    p = float(binomtest(above, below + above).pvalue) if below + above else 1.0
    return PairedTest("sign", p, len(d), below, above, ties)


def permutation_test(diffs: np.ndarray, n_resamples: int = 9999, seed: int = 0) -> PairedTest:
    """Two-sided paired permutation test of the mean difference (``diffs [n]``, one per cluster): the signs of the
    differences are flipped; exact (all ``2^n`` flips) up to ``EXACT_ENUMERATION`` clusters, else ``n_resamples``
    random flips (test "permutation (Monte Carlo)")."""
    from scipy.stats import permutation_test as scipy_permutation

    d = np.asarray(diffs, dtype=float)
    d = d[np.isfinite(d)]
    below, above, ties = _counts(d)
    if len(d) < 2 or not np.any(d):  # one cluster: both flips are as extreme (scipy needs two)
        return PairedTest("permutation", 1.0 if len(d) else float("nan"), len(d), below, above, ties)
    exact = len(d) <= EXACT_ENUMERATION
    res = scipy_permutation((d,), np.mean, permutation_type="samples", alternative="two-sided",
                            n_resamples=np.inf if exact else n_resamples, rng=np.random.default_rng(seed))
    return PairedTest("permutation" if exact else "permutation (Monte Carlo)", float(min(1.0, res.pvalue)), len(d),
                      below, above, ties, 0.0 if exact else 1.0 / (n_resamples + 1))


def bootstrap_test(diff_reps: np.ndarray, diffs: np.ndarray) -> PairedTest:
    """The paired bootstrap p-value (:func:`paired_p_value` of the mean difference's replicates ``diff_reps [B]``)
    with the cluster counts of ``diffs [n]`` (one per cluster); resolution ``2 / B``."""
    d = np.asarray(diffs, dtype=float)
    d = d[np.isfinite(d)]
    ok = int(np.isfinite(diff_reps).sum())
    return PairedTest("bootstrap", paired_p_value(diff_reps), len(d), *_counts(d), 2.0 / ok if ok else float("nan"))


def paired_test(diffs: np.ndarray, diff_reps: np.ndarray | None = None, exact: str = "sign") -> PairedTest:
    """The paired test of per-cluster differences ``diffs [n]``: with fewer than ``EXACT_BELOW`` clusters (or
    without bootstrap replicates) the exact ``exact`` test ("sign" or "permutation"), else the bootstrap p-value of
    the replicates ``diff_reps [B]`` of the mean difference. The result names the test it used."""
    d = np.asarray(diffs, dtype=float)
    if np.isfinite(d).sum() < EXACT_BELOW or diff_reps is None or not len(diff_reps):
        return sign_test(d) if exact == "sign" else permutation_test(d)
    return bootstrap_test(diff_reps, d)


def cluster_means(values: np.ndarray, clusters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean of ``values [N]`` within each cluster of ``clusters [N]``: (cluster ids [C] sorted, means [C]);
    NaN values are dropped first (a cluster left empty is dropped)."""
    values, clusters = np.asarray(values, dtype=float), np.asarray(clusters)
    ok = np.isfinite(values)
    ids, inv = np.unique(clusters[ok], return_inverse=True)
    sums = np.bincount(inv, weights=values[ok], minlength=len(ids))
    return ids, sums / np.bincount(inv, minlength=len(ids))


def compare(boot: PromptBootstrap, x: np.ndarray, y: np.ndarray, prompts: np.ndarray, exact: str = "sign") -> dict:
    """``x`` against ``y`` (paired rows ``[N]`` clustered by ``prompts``): the mean difference ``x - y`` and the ratio
    of means, each with its cluster-bootstrap CI, the per-cluster ratio summary (:func:`ratio_summary`) and the
    paired test of the per-cluster mean differences (:func:`paired_test`); ``n`` rows, ``clusters``."""
    x, y, prompts = np.asarray(x, dtype=float), np.asarray(y, dtype=float), np.asarray(prompts)
    diff, dr = boot.mean(x - y, prompts)
    (mx, xr), (my, yr) = boot.mean(x, prompts), boot.mean(y, prompts)
    with np.errstate(invalid="ignore", divide="ignore"):
        rr = xr / yr
        ratio = mx / my if my else float("nan")
    test = paired_test(cluster_means(x - y, prompts)[1], dr, exact)
    return {"diff": diff, "diff_ci": list(boot.ci(dr)), "ratio": ratio, "ratio_ci": list(boot.ci(rr)),
            "test": test, "p_value": test.p, "n": len(x), "clusters": test.n,
            "ratios": ratio_summary(boot, x, y, prompts)}


def ratio_summary(boot: PromptBootstrap, x: np.ndarray, y: np.ndarray, prompts: np.ndarray) -> dict:
    """The per-cluster ratio ``x / y`` of paired positive rows ``[N]`` clustered by ``prompts``: each cluster's ratio
    is the geometric mean of its rows' ratios; over clusters, their geometric mean with its cluster-bootstrap CI,
    their plain median (of the ratios, not exp of the median log: the two differ for an even number of clusters),
    and ``below``: the clusters with a ratio below 1 (of ``n``). Rows where either side is not positive cannot enter
    a ratio: ``dropped`` counts them."""
    x, y, prompts = np.asarray(x, dtype=float), np.asarray(y, dtype=float), np.asarray(prompts)
    ok = (x > 0) & (y > 0)
    ids, logs = cluster_means(np.log(x[ok]) - np.log(y[ok]), prompts[ok]) if ok.any() else ([], np.empty(0))
    out = {"geomean": float("nan"), "geomean_ci": [float("nan"), float("nan")], "median": float("nan"),
           "below": int((logs < 0).sum()), "n": len(logs), "dropped": int((~ok).sum())}
    if len(logs):
        g, reps = boot.mean(logs, np.asarray(ids))
        low, high = boot.ci(reps)
        out.update(geomean=float(np.exp(g)), geomean_ci=[float(np.exp(low)), float(np.exp(high))],
                   median=float(np.median(np.exp(logs))))  # the plain median of the clusters' ratios
    return out


# --------------------------------------------------------------------------- correlations, rates, two samples


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho over the pairs where both are finite; NaN with fewer than 3 pairs or a constant side."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return float("nan")
    return float(spearmanr(x[ok], y[ok])[0])


def spearman_ci(boot: PromptBootstrap, x: np.ndarray, y: np.ndarray, prompts: np.ndarray) -> dict:
    """Spearman(x, y) over rows ``[N]`` clustered by ``prompts`` and its cluster-bootstrap CI (a prompt drawn k times
    contributes its rows k times); ``n``: the pairs that entered (both finite)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    rho = spearman(x, y)
    reps = np.empty(0)
    if boot.mult is not None:
        idx = np.array([boot.index[p] for p in prompts], dtype=int)
        reps = np.array([spearman(np.repeat(x, m[idx]), np.repeat(y, m[idx])) for m in boot.mult])
    low, high = boot.ci(reps)
    return {"spearman": rho, "ci_low": low, "ci_high": high, "n": int((np.isfinite(x) & np.isfinite(y)).sum())}


def kendall(x: np.ndarray, y: np.ndarray) -> dict:
    """Kendall's tau-b of ``x [n]`` and ``y [n]`` over the pairs where both are finite, with the two-sided p of no
    association: exact (the permutation distribution of tau) when neither side has ties, else the normal
    approximation (``test`` says which); ``n``: the pairs that entered. tau and p are NaN below 3 pairs."""
    from scipy.stats import kendalltau

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    exact = len(np.unique(x)) == len(x) and len(np.unique(y)) == len(y)
    out = {"tau": float("nan"), "p_value": float("nan"), "n": int(ok.sum()), "test": "exact" if exact else "asymptotic"}
    if len(x) >= 3:
        res = kendalltau(x, y, method="exact" if exact else "asymptotic")
        out.update(tau=float(res.statistic), p_value=float(res.pvalue))
    return out


def clopper_pearson_upper(k: int, n: int, level: float = 0.95) -> float:
    """One-sided Clopper-Pearson (exact binomial) upper bound at ``level`` on a proportion with ``k`` successes out
    of ``n`` (1.0 when n is 0 or k is n): the ``level`` quantile of Beta(k + 1, n - k)."""
    from scipy.stats import beta

    return 1.0 if n == 0 or k >= n else float(beta.ppf(level, k + 1, n - k))


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes out of ``n`` (NaN, NaN when n is 0)."""
    from scipy.stats import binomtest

    if n == 0:
        return float("nan"), float("nan")
    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def mcnemar(a: np.ndarray, b: np.ndarray) -> float:
    """McNemar's exact two-sided p of paired binary outcomes ``a [n]``, ``b [n]``: a binomial test on the discordant
    pairs (1 when there is none)."""
    from scipy.stats import binomtest

    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    n10, n01 = int((a & ~b).sum()), int((~a & b).sum())
    return float(binomtest(n10, n10 + n01).pvalue) if n10 + n01 else 1.0


def rank_biserial(u: float, n1: int, n2: int) -> float:
    """Rank-biserial correlation from the Mann–Whitney ``U`` of the first sample: ``2U / (n1 n2) - 1``.

    Equals Cliff's delta ``P(X > Y) - P(X < Y)`` (ties count half in ``U``); in [-1, 1], 0 = no effect.
    """
    return 2.0 * u / (n1 * n2) - 1.0


def fisher_greater(table: np.ndarray, level: float = 0.95) -> dict[str, float]:
    """One-sided (greater) Fisher exact test of a 2x2 ``table`` with the conditional MLE odds ratio and its exact CI:
    ``fisher_odds_ratio`` (the sample odds ratio), ``fisher_p``, ``odds_ratio``, ``odds_ratio_ci_low/_high``."""
    from scipy.stats import fisher_exact
    from scipy.stats.contingency import odds_ratio

    fisher = fisher_exact(table, alternative="greater")
    cond = odds_ratio(table, kind="conditional")
    ci = cond.confidence_interval(confidence_level=level)
    return {"fisher_odds_ratio": float(fisher.statistic), "fisher_p": float(fisher.pvalue),
            "odds_ratio": float(cond.statistic), "odds_ratio_ci_low": float(ci.low),
            "odds_ratio_ci_high": float(ci.high)}


def fisher_two_sided(table: np.ndarray) -> float:
    """Fisher's exact test, two-sided, of a 2x2 count ``table`` (rows: groups, columns: success, failure): its p."""
    from scipy.stats import fisher_exact

    return float(fisher_exact(table, alternative="two-sided").pvalue)


def stat(name: str, value: float | None, note: str = "") -> dict:
    """One row of a ``*_stats.csv``: statistic, value (NaN when undefined), note."""
    value = float("nan") if value is None else float(value)
    return {"statistic": name, "value": value, "note": note}


def mann_whitney(x: np.ndarray, y: np.ndarray, min_group: int, what: str) -> tuple[list[dict], str]:
    """One-sided Mann–Whitney U (``x`` stochastically greater than ``y``) with the rank-biserial effect size.

    Returns stats rows ``mwu_u, mwu_p, rank_biserial`` (NaN with a note when a group has < ``min_group``
    values) and the note ("" when defined).
    """
    from scipy.stats import mannwhitneyu

    n1, n2 = len(x), len(y)
    if n1 < min_group or n2 < min_group:
        note = f"too few candidates for the Mann-Whitney test on {what}: {n1} vs {n2} (need >= {min_group} each)"
        return [stat("mwu_u", None, note), stat("mwu_p", None, note), stat("rank_biserial", None, note)], note
    res = mannwhitneyu(x, y, alternative="greater")
    return [
        stat("mwu_u", res.statistic), stat("mwu_p", res.pvalue),
        stat("rank_biserial", rank_biserial(res.statistic, n1, n2)),
    ], ""


# --------------------------------------------------------------------------- printing


TEST_NAMES = {"mcnemar": "McNemar's exact test", "sign": "exact sign test", "permutation": "exact permutation test",
              "permutation (Monte Carlo)": "permutation test", "bootstrap": "paired bootstrap"}


def format_p(p: float | None, resolution: float = 0.0, digits: int = 2) -> str:
    """A p-value as a table cell: "n/a" when undefined; below a test's ``resolution`` (a bootstrap p of 0 with B
    replicates: below 2/B) "< resolution"; else 2 significant digits ("0.021", "3.1e-05")."""
    if p is None or p != p:
        return "n/a"
    if resolution and p < resolution:
        return f"< {resolution:.{digits}g}"
    return f"{p:.{digits}g}"


def format_test(test: PairedTest | dict | None, wins: bool = True) -> str:
    """A paired test in running text, the test named: ``p = 0.021 (exact sign test, lower in 9 of 10)``,
    ``p < 0.002 (paired bootstrap, 40 clusters)``; ``dict``: :meth:`PairedTest.as_dict` (resolution 0)."""
    if test is None:
        return "p n/a"
    if isinstance(test, dict):
        test = PairedTest(test["test"], test["p_value"], test["n"], test["below"], test["above"], test["ties"],
                          test.get("resolution", 0.0))
    v = format_p(test.p, test.resolution)
    head = f"p {v}" if v.startswith("<") or v == "n/a" else f"p = {v}"
    detail = f"lower in {test.below} of {test.n}" if wins and test.test == "sign" else f"{test.n} clusters"
    return f"{head} ({TEST_NAMES.get(test.test, test.test)}, {detail})"
