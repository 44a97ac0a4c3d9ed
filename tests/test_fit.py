"""kvdiag fit: out-of-fold predictions are honest (noise features give chance AUROC, a separating feature near 1),
and the saved model scores as the ``fitted`` scorer exactly as it predicts."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

import kvdiag.fit.run as fit_mod  # the stage's module: feature_table is patched where fit_ceiling reads it
from kvdiag.fit import FitConfig, fit_ceiling
from kvdiag.rankeval import KEYS


def synthetic_labels(n_prompts=8, n_ckpt=2, n=60, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_prompts):
        for c in range(n_ckpt):
            t = 100 + 40 * c
            rows.append(pl.DataFrame({
                "prompt_id": f"p{p}", "checkpoint": t, "position": np.arange(n), "granularity": "token", "layer": -1,
                "kv_head": -1, "kl_mean": np.exp(rng.normal(-5, 2, n)), "noise_floor": 1e-12,
            }))
    return pl.concat(rows)


def fake_features(signal: bool):
    """feature_table stand-in: 'noise' columns, plus (signal) one column that orders the KL exactly."""
    def table(trace, keys, names, progress=False, cells=False):
        rng = np.random.default_rng(1)
        cols = {n: rng.normal(size=keys.height) for n in names}
        if signal:
            cols[names[0]] = np.log(keys["_kl"].to_numpy())
        return keys.drop("_kl").with_columns(pl.Series(n, v) for n, v in cols.items())
    return table


@pytest.mark.parametrize("signal", [False, True])
def test_out_of_fold_predictions_are_honest(signal, monkeypatch, tmp_path):
    labels = synthetic_labels()
    keyed = labels.select(*KEYS, _kl=pl.col("kl_mean"))

    def table(trace, keys, names, progress=False, cells=False):
        return fake_features(signal)(trace, keys.join(keyed, on=list(KEYS)), names)

    monkeypatch.setattr(fit_mod, "feature_table", table)
    cfg = FitConfig(features=("window_attention", "key_norm", "value_norm"), n_boot=50, n_splits=4)
    res = fit_ceiling(None, labels, None, tmp_path, cfg)
    auroc = {
        r["scorer"]: r["value"] for r in res["metrics"].filter(metric="auroc", scope="pooled").iter_rows(named=True)
    }
    if signal:  # a feature that orders the label: both models rank almost perfectly out of fold
        assert auroc["fitted_logreg"] > 0.99 and auroc["fitted_gbt"] > 0.95
    else:  # noise: an in-sample fit of the trees would score near 1; out of fold it is chance
        assert abs(auroc["fitted_logreg"] - 0.5) < 0.1 and abs(auroc["fitted_gbt"] - 0.5) < 0.1
    assert res["summary"]["folds"] == 4
    assert {"model.json", "metrics.csv", "importances.csv", "oof_scores.parquet", "features.parquet"} <= {
        p.name for p in tmp_path.iterdir()
    }


def test_fitted_scorer_reproduces_the_model(tiny_trace, tmp_path, restore_scorers):
    """score --scorers fitted --aggregation mean_raw gives the logit of the saved model on the fit's own features."""
    from kvdiag.label import LabelConfig, label_trace
    from kvdiag.model.load import load_model
    from kvdiag.scorers import score_trace

    labels_path = label_trace(
        tiny_trace, load_model("tiny:llama"), tmp_path / "labels.parquet",
        LabelConfig(checkpoints="every:8", w_obs=8, horizon=4, candidates="16"), show_progress=False,
    )
    labels = pl.read_parquet(labels_path)
    out = tmp_path / "fit"
    fit_ceiling(tiny_trace, labels, None, out, FitConfig(n_boot=0, n_splits=2))
    model = json.loads((out / "model.json").read_text())
    feats = pl.read_parquet(out / "features.parquet")
    X = feats.select(model["features"]).to_numpy()
    lr = model["logistic"]
    logit = ((X - np.array(lr["mean"])) / np.array(lr["scale"])) @ np.array(lr["coef"]) + lr["intercept"]
    df, _ = score_trace(tiny_trace, keys=feats.select(KEYS), scorers="fitted",
                        params={"fitted": {"path": str(out / "model.json")}}, aggregation="mean_raw")
    # fp32 per-layer features and logits vs float64 on the averaged features
    np.testing.assert_allclose(df["fitted"].to_numpy(), logit, rtol=1e-4, atol=1e-4)
    named = f"fitted:{out / 'model.json'}"  # the same rule by name
    df2, meta = score_trace(tiny_trace, keys=feats.select(KEYS), scorers=named, aggregation="mean_raw")
    np.testing.assert_allclose(df2[named].to_numpy(), df["fitted"].to_numpy(), rtol=0, atol=1e-12)
    assert meta["scorers"][named] == {"path": str(out / "model.json")}


def test_a_fold_of_one_class_is_refused_before_any_feature(monkeypatch):
    """A fold whose training or held-out prompts hold only harmless (or only harmful) labels: sklearn's fit or the
    fold's AUROC failed with an internal error (kvdiag fit on two tiny prompts). check_labels refuses it from the
    labels alone (fit_files calls it before the Trace's tensors), naming the fold and its prompts; cross_validate
    refuses it again for a direct call. Labels of two prompts where one prompt holds every harmful entry."""
    from kvdiag.core.errors import UserError

    labels = synthetic_labels(n_prompts=2)
    labels = labels.with_columns(pl.when(pl.col("prompt_id") == "p0").then(1e-9).otherwise("kl_mean")
                                 .alias("kl_mean"))  # p0 below every threshold, p1's top 10 % above
    cfg = FitConfig(features=("key_norm",), n_boot=0, n_splits=2)
    with pytest.raises(UserError, match=r"fold \d: its (training|held-out) prompts \(p0\) hold only harmless labels"):
        fit_mod.check_labels(labels, cfg)
    y = (labels["prompt_id"] == "p1").to_numpy().astype(int)  # one class per prompt: each side of a fold is one class
    with pytest.raises(UserError, match=r"fold 1: its training prompts \(p\d\) hold only"):
        fit_mod.cross_validate(np.zeros((len(y), 1)), y, labels["prompt_id"].to_numpy(), cfg)
    fit_mod.check_labels(synthetic_labels(n_prompts=8), FitConfig(features=("key_norm",), n_splits=4))  # both classes
