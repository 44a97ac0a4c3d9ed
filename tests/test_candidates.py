"""Candidate filters (--min-age, --max-age, --eligible) and budget curves, checked against a recomputation by hand;
each rule's ``protected`` set agrees with the entries its scores keep."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.rankeval import KEYS, rank_eval
from kvdiag.scorers import SCORERS, ScoreContext
from tests.conftest import make_scorer, random_qkv

N_CAND = 60  # ages 1..60 at every checkpoint


def tables(n_prompts=6, n_ckpt=3, seed=0):
    rng = np.random.default_rng(seed)
    parts = []
    for p in range(n_prompts):
        for c in range(n_ckpt):
            t = 100 + 20 * c
            kl = np.exp(rng.normal(-5, 2, N_CAND))
            parts.append(pl.DataFrame({
                "prompt_id": f"p{p}", "checkpoint": t, "position": t - 1 - np.arange(N_CAND), "granularity": "token",
                "layer": -1, "kv_head": -1, "kl_mean": kl, "noise_floor": 1e-12,
            }))
    labels = pl.concat(parts)
    logkl = np.log(labels["kl_mean"].to_numpy())
    scores = labels.select(KEYS).with_columns(
        noisy=pl.Series(logkl + rng.normal(0, 2.0, labels.height)), random=pl.Series(rng.random(labels.height)),
    )
    return labels, scores


def values(result) -> dict:
    return {(r["scorer"], r["metric"], r["scope"]): r["value"] for r in result.metrics.iter_rows(named=True)}


def assert_same(a, b):
    va, vb = values(a), values(b)
    assert va.keys() == vb.keys()
    for key in va:  # the same rows through the same code: equal up to summation order
        assert va[key] == pytest.approx(vb[key], rel=1e-12, abs=1e-12, nan_ok=True), key


SETTINGS = dict(n_boot=0, harm="abs:0.02", reference=None)


def test_age_filters_equal_filtering_by_hand():
    labels, scores = tables()
    age = pl.col("checkpoint") - pl.col("position")
    got = rank_eval(labels, scores, min_age=10, max_age=40, **SETTINGS)
    want = rank_eval(labels.filter((age >= 10) & (age <= 40)), scores, **SETTINGS)
    assert_same(got, want)
    assert got.summary["n_evaluated"] == 6 * 3 * 31
    assert got.summary["candidates"] == "age >= 10; age <= 40"


def test_eligible_equals_filtering_by_hand():
    """avokv_e protects its delay buffer (age <= w_delay); --eligible takes w_delay from the scores' metadata."""
    labels, scores = tables()
    meta = {"scorers": {"avokv_e": {"w_obs": 8, "w_delay": 24}}}
    got = rank_eval(labels, scores, eligible="avokv_e", scores_meta=meta, **SETTINGS)
    want = rank_eval(labels.filter(pl.col("checkpoint") - pl.col("position") > 24), scores, **SETTINGS)
    assert_same(got, want)
    assert got.summary["n_evaluated"] == 6 * 3 * (N_CAND - 24)
    assert "eligible under avokv_e" in got.summary["candidates"] and "w_delay=24" in got.summary["candidates"]
    # without metadata: the scorer's defaults (w_delay = 128 protects every candidate of these tables)
    with pytest.raises(UserError, match="no candidate is left"):
        rank_eval(labels, scores, eligible="avokv_e", **SETTINGS)
    with pytest.raises(UserError, match="--eligible nope"):
        rank_eval(labels, scores, eligible="nope", **SETTINGS)
    with pytest.raises(UserError, match="--min-age 0"):
        rank_eval(labels, scores, min_age=0, **SETTINGS)


def fsr_fnr_by_hand(labels: pl.DataFrame, scores: pl.DataFrame, name: str, rho: float, threshold: float):
    """Evict floor(rho*C) lowest-scored per checkpoint (continuous scores: no ties); pooled FSR and FNR."""
    df = labels.join(scores, on=list(KEYS))
    evicted = harmful_evicted = harmful = 0
    for _, g in df.group_by("prompt_id", "checkpoint"):
        y = (g["kl_mean"].to_numpy() > threshold)
        order = np.argsort(g[name].to_numpy())
        n = int(np.floor(rho * len(y) + 1e-9))
        evicted += n
        harmful_evicted += int(y[order[:n]].sum())
        harmful += int(y.sum())
    return harmful_evicted / evicted, harmful_evicted / harmful


def test_budget_curves_equal_eviction_by_hand():
    labels, scores = tables()
    grid = (0.1, 0.3, 0.5, 0.85)
    r = rank_eval(labels, scores, rho_grid=grid, **SETTINGS)
    curves = r.budget_curves
    assert curves.filter(pl.col("scorer") == "noisy").height == 2 * len(grid)
    for rho in grid:
        fsr, fnr = fsr_fnr_by_hand(labels, scores, "noisy", rho, 0.02)
        at_rho = curves.filter((pl.col("scorer") == "noisy") & (pl.col("rho") == rho))
        got = {m: at_rho.filter(pl.col("metric") == m)["value"].item() for m in ("fsr", "fnr")}
        assert got["fsr"] == pytest.approx(fsr, rel=1e-12) and got["fnr"] == pytest.approx(fnr, rel=1e-12)
        rand = curves.filter((pl.col("scorer") == "random (expected)") & (pl.col("rho") == rho))
        assert rand.filter(pl.col("metric") == "fnr")["value"].item() == rho
    # the main table's rho is one point of the curve
    at_half = curves.filter((pl.col("rho") == 0.5) & (pl.col("scorer") == "noisy") & (pl.col("metric") == "fsr"))[
        "value"
    ].item()
    assert at_half == pytest.approx(values(r)[("noisy", "fsr", "pooled")], rel=1e-12)


PROTECTING = ["h2o", "lazyeviction", "rkv", "snapkv", "streamingllm", "value_norm", "vatp", "avokv_e",
              "avokv_e_no_delay", "avokv_e_no_payload", "avokv_e_no_redundancy", "avokv_e_raw", "vase", "cake",
              "obcache"]
PARAMS = {
    "h2o": {"recent_size": 6},
    "lazyeviction": {"window": 6},
    "rkv": {"window": 6},
    "snapkv": {"window": 6},
    "vase": {"window": 6, "n_large": 8},
    "cake": {"window": 6},
    "obcache": {"window": 6},
    **{
        name: {"w_obs": 4, "w_delay": 10}
        for name in PROTECTING
        if name.startswith("avokv_e") and name != "avokv_e_no_delay"
    },
    "avokv_e_no_delay": {"w_obs": 4},
}


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_protected_entries_are_the_kept_ones(name):
    """On a full cache, ``Scorer.protected`` marks exactly the entries whose score is the kept score: above every
    other entry of their head, all tied; a rule without protection marks none."""
    q, k, v = random_qkv(T=40)
    ctx = ScoreContext(q, k, v, 0.3, prompt_len=8)
    scorer = make_scorer(name, **PARAMS.get(name, {}))
    positions = torch.arange(ctx.t)
    mask = scorer.protected(ctx.checkpoint - positions if ctx.checkpoint else ctx.t - positions, positions)
    assert mask.dtype == torch.bool and mask.shape == (ctx.t,)
    if name not in PROTECTING:
        assert not mask.any()
        return
    assert 0 < int(mask.sum()) < ctx.t
    s = scorer.scores(ctx)
    assert (s[:, mask].amin(1) > s[:, ~mask].amax(1)).all()
    assert (s[:, mask] == s[:, mask][:, :1]).all()
