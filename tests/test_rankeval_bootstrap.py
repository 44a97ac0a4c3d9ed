"""Cluster bootstrap over prompts: resamples are prompts, intervals cover, paired p-values and Holm."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from scipy.stats import norm

from kvdiag.rankeval import (
    METRICS,
    SCOPES,
    evaluate,
    holm,
    paired_p_value,
    percentile_ci,
    prompt_multiplicities,
    rank_eval,
)


def _tables(prompt_rows: list[tuple[np.ndarray, dict[str, np.ndarray]]], n_ckpt: int = 1):
    """labels + scores from per-prompt (kl_mean [n], {scorer: [n]}); each prompt's rows split into checkpoints."""
    labels, scores = [], []
    for p, (kl, sc) in enumerate(prompt_rows):
        n = len(kl)
        keys = pl.DataFrame(
            {
                "prompt_id": f"p{p:03d}", "checkpoint": 100 * (1 + np.arange(n) * n_ckpt // n),
                "position": np.arange(n), "granularity": "token", "layer": -1, "kv_head": -1,
            }
        )
        labels.append(keys.with_columns(kl_mean=pl.Series(kl), noise_floor=pl.lit(0.0)))
        scores.append(keys.with_columns(**{k: pl.Series(v) for k, v in sc.items()}))
    return pl.concat(labels), pl.concat(scores)


def test_prompt_multiplicities_resample_prompts_with_replacement():
    mult = prompt_multiplicities(7, 500, np.random.default_rng(3))
    assert mult.shape == (500, 7) and (mult.sum(axis=1) == 7).all()
    assert mult.mean() == pytest.approx(1.0, abs=0.05)
    assert (mult == prompt_multiplicities(7, 500, np.random.default_rng(3))).all()


def test_replicates_are_the_metrics_of_the_resampled_prompts(monkeypatch):
    # the batched (weighted) bootstrap must equal rank_eval run on the explicitly resampled table, in which
    # a prompt drawn twice is two clusters (its checkpoints count twice in macro averages)
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(5):
        kl = np.exp(rng.normal(-4, 2, 60))
        prompts.append((kl, {"a": np.log(kl) + rng.normal(0, 2, 60), "b": rng.integers(0, 3, 60).astype(float)}))
    labels, scores = _tables(prompts, n_ckpt=3)
    calls = []
    real = evaluate.prompt_multiplicities
    monkeypatch.setattr(evaluate, "prompt_multiplicities", lambda *a: calls.append(a[:2]) or real(*a))
    r = rank_eval(labels, scores, n_boot=4, seed=11, reference="a", rho=0.3)
    assert calls == [(5, 4)]  # 5 prompts are resampled, not 300 candidates

    mult = real(5, 4, np.random.default_rng(11))
    pids = sorted(labels["prompt_id"].unique())
    for b in range(4):
        copies = [
            t.filter(pl.col("prompt_id") == pid).with_columns(prompt_id=pl.lit(f"{pid}#{k}"))
            for t in (labels, scores)
            for pid, m in zip(pids, mult[b], strict=True)
            for k in range(m)
        ]
        half = len(copies) // 2
        lab_b, sco_b = pl.concat(copies[:half]), pl.concat(copies[half:])
        ref = rank_eval(lab_b, sco_b, harm=f"abs:{r.summary['harm_threshold']}", n_boot=0, reference="a", rho=0.3)
        for scorer in ("a", "b"):
            for metric in METRICS:
                for scope in SCOPES:
                    want = ref.metrics.filter(scorer=scorer, metric=metric, scope=scope)["value"].item()
                    got = r.replicates[(scorer, metric, scope)][b]
                    assert got == pytest.approx(want, abs=1e-12, nan_ok=True), (b, scorer, metric, scope)


def test_interval_reflects_between_prompt_variation():
    # harm clusters by prompt (2% or 40% harmful): a candidate-level bootstrap would give about the
    # binomial width; resampling prompts gives several times more
    rng = np.random.default_rng(1)
    prompts = []
    for p in range(30):
        kl = np.where(rng.random(100) < (0.02 if p % 2 else 0.4), 1.0, 1e-3)
        prompts.append((kl, {"s": rng.random(100)}))
    labels, scores = _tables(prompts)
    r = rank_eval(labels, scores, harm="abs:0.5", n_boot=400, reference=None)
    row = r.metrics.filter(scorer="s", metric="prevalence", scope="pooled").row(0, named=True)
    prevalence, n = row["value"], labels.height
    iid_width = 2 * 1.96 * np.sqrt(prevalence * (1 - prevalence) / n)
    assert row["ci_high"] - row["ci_low"] > 3 * iid_width


def test_cluster_bootstrap_intervals_cover_the_true_auroc():
    # each prompt has its own separation delta_p ~ N(mu, tau^2): harmful scores N(delta_p, 1), safe N(0, 1),
    # 4 harmful of 20 per checkpoint. Pooled and macro AUROC both estimate E[Phi(delta/sqrt 2)] = Phi(mu / sqrt(2 +
    # tau^2))
    mu, tau = 1.0, 0.8
    truth = norm.cdf(mu / np.sqrt(2 + tau**2))
    rng = np.random.default_rng(2024)
    n_sims, n_prompts, hits = 200, 25, {"pooled": 0, "macro": 0}
    y = np.tile(np.r_[np.ones(4), np.zeros(16)], 2)
    labels, scores = _tables([(np.where(y == 1, 1.0, 1e-3), {"s": y})] * n_prompts, n_ckpt=2)
    y_all = np.tile(y, n_prompts)
    for _ in range(n_sims):
        deltas = np.repeat(rng.normal(mu, tau, n_prompts), len(y))
        scores = scores.with_columns(s=pl.Series(deltas * y_all + rng.normal(size=len(y_all))))
        r = rank_eval(labels, scores, harm="abs:0.5", n_boot=200, seed=int(rng.integers(2**31)), reference=None)
        for scope in hits:
            row = r.metrics.filter(scorer="s", metric="auroc", scope=scope).row(0, named=True)
            hits[scope] += row["ci_low"] <= truth <= row["ci_high"]
    for scope, h in hits.items():
        assert 0.88 <= h / n_sims <= 0.99, (scope, h / n_sims)


def test_percentile_interval_and_paired_p_value_by_hand():
    values = np.arange(1.0, 101.0)
    low, high, n = percentile_ci(np.r_[values, np.nan], 0.9)  # NaN replicates are dropped
    assert (low, high, n) == (pytest.approx(np.quantile(values, 0.05)), pytest.approx(np.quantile(values, 0.95)), 100)
    assert percentile_ci(np.full(3, np.nan))[2] == 0
    assert paired_p_value(np.array([1.0, 2.0, 3.0, -1.0])) == 0.5  # 2 * (1 of 4 at or below 0)
    assert paired_p_value(np.zeros(10)) == 1.0
    assert paired_p_value(np.array([0.5, 0.2, np.nan])) == 0.0


def test_holm_by_hand():
    # sorted p: 0.01 * 3 = 0.03, 0.03 * 2 = 0.06, 0.04 * 1 = 0.04 -> monotone: 0.03, 0.06, 0.06
    got = holm(np.array([0.01, 0.04, 0.03, np.nan]))
    assert got[:3] == pytest.approx([0.03, 0.06, 0.06]) and np.isnan(got[3])
    assert holm(np.array([0.5, 0.9])) == pytest.approx([1.0, 1.0])
