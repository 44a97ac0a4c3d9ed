"""``kvdiag fit``'s stage: the features, the grouped cross-validation, the ranking and model.json (the package
docstring says what the ceiling is)."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.io import write_csv, write_json, write_table, write_text
from kvdiag.core.provenance import provenance
from kvdiag.fit.config import FitConfig, check_config
from kvdiag.scorers.fitted_file import KIND

MODELS = ("fitted_logreg", "fitted_gbt")


def feature_table(trace, keys: pl.DataFrame, names: tuple[str, ...], progress: bool = False,
                  cells: bool = False) -> pl.DataFrame:
    """The label keys with one column per feature: token rows, the mean over layers and KV heads; or, with
    ``cells``, one head row per (layer, KV head) cell of each key (the keys' order, cells in layer then head order)."""
    from kvdiag.scorers import score_trace
    from kvdiag.scorers.entry_features import EntryFeature

    if cells:
        grid = pl.DataFrame({"layer": [layer for layer in range(trace.num_layers) for _ in range(trace.num_kv_heads)],
                             "kv_head": list(range(trace.num_kv_heads)) * trace.num_layers}, schema={
                                 "layer": keys.schema["layer"], "kv_head": keys.schema["kv_head"]})
        keys = (keys.select("prompt_id", "checkpoint", "position").join(grid, how="cross", maintain_order="left")
                .with_columns(granularity=pl.lit("head", keys.schema["granularity"])).select(keys.columns))
    df, _ = score_trace(trace, keys=keys, scorers={n: EntryFeature(feature=n) for n in names}, aggregation="mean_raw",
                        progress=progress)
    return df


def _cell_rows(feats: pl.DataFrame, labels: pl.DataFrame) -> np.ndarray:
    """[N_rows] the index of each feature row's token among ``labels``' rows (token rows: ``arange``; cell rows:
    their token's); every label must have its rows."""
    from kvdiag.rankeval import KEYS

    token = ["prompt_id", "checkpoint", "position"]
    if (feats["granularity"] == "token").all():
        if feats.select(KEYS).rows() != labels.select(KEYS).rows():
            raise UserError("the features' keys are not the analysed token labels' (in their order): compute them "
                            "from these labels")
        return np.arange(labels.height)
    rows = feats.select(token).join(labels.select(token).with_row_index("_row"), on=token, how="left",
                                    maintain_order="left")["_row"]
    counts = np.bincount(rows.drop_nulls().to_numpy(), minlength=labels.height)
    if rows.null_count() or counts.min() == 0 or counts.min() != counts.max():
        raise UserError("the features' cell rows are not those of the analysed token labels (each label's every "
                        "cell): compute them from these labels")
    return rows.to_numpy()


def _labels_y(labels: pl.DataFrame, cfg: FitConfig) -> tuple[pl.DataFrame, np.ndarray, float]:
    """The evaluated labels (resolved unless include_unresolved) and their harm label, as rank-eval makes them."""
    labels = cfg.harm_spec.analysed(labels)
    kl = labels["kl_mean"].to_numpy()
    threshold = cfg.harm_spec.threshold(kl)
    y = (kl > threshold).astype(int)
    if y.min() == y.max():
        raise UserError(f"--harm {cfg.harm} leaves one class only among {len(y)} labels: choose another threshold")
    return labels, y, threshold


def _models(cfg: FitConfig):
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return {
        "fitted_logreg": make_pipeline(StandardScaler(), LogisticRegression(C=cfg.logreg_c, max_iter=2000)),
        # numeric splits only (no categorical features): what the fitted rule's trees evaluate (boosted_json)
        "fitted_gbt": HistGradientBoostingClassifier(max_iter=cfg.gbt_max_iter, learning_rate=cfg.gbt_learning_rate,
                                                     max_leaf_nodes=cfg.gbt_max_leaf_nodes, random_state=cfg.seed,
                                                     categorical_features=None),
    }


def fit_ceiling(trace, labels: pl.DataFrame, scores: pl.DataFrame | None, out: str | Path, cfg: FitConfig,
                labels_meta: dict | None = None, scores_meta: dict | None = None, progress: bool = False) -> dict:
    """Fit, cross-validate and rank the ceiling models; write the outputs into ``out`` and return the summary.

    Outputs: ``features.parquet`` (keys, features, label), ``oof_scores.parquet`` (keys, the models' out-of-fold
    keep scores ``P(harmful)``: keep what would hurt to evict, and the hand-made rules' scores),
    ``metrics.csv``/``table.md`` (rank-eval of all),
    ``importances.csv``, ``model.json`` (both models fitted on all entries, the fitted rule: ``cfg.rule`` names the
    one it runs; its training prompts, labels' horizon and model), ``config.json``.
    """
    from kvdiag.rankeval import KEYS

    names = check_config(cfg)
    t0 = time.perf_counter()
    labels = _token_labels(labels)
    feats = feature_table(trace, _labels_y(labels, cfg)[0].select(KEYS), names, progress,
                          cells=cfg.aggregation == "cells")
    return fit_features(feats, labels, scores, out, cfg, labels_meta, scores_meta, trace, t0)


def _token_labels(labels: pl.DataFrame) -> pl.DataFrame:
    labels = labels.filter(pl.col("granularity") == "token")
    if labels.height == 0:
        raise UserError("the labels hold no token-granularity rows: fit learns the token label; label with "
                        "--granularity token")
    return labels


def fit_features(feats: pl.DataFrame, labels: pl.DataFrame, scores: pl.DataFrame | None, out: str | Path,
                 cfg: FitConfig, labels_meta: dict | None = None, scores_meta: dict | None = None,
                 trace=None, t0: float | None = None) -> dict:
    """:func:`fit_ceiling` from the features already computed: ``feats`` holds the keys of the analysed token labels,
    in their order, and one column per feature (``feature_table``; a run's ``features.parquet``). No tensors, no
    model: the report's tables regenerate from the committed features (tests/test_reports.py). ``trace`` (a Trace or
    its ``TraceFiles``, or None) gives model.json the training prompts' texts and the Trace's provenance."""
    from kvdiag.rankeval import KEYS, to_markdown

    names = check_config(cfg)
    out = Path(out)
    t0 = time.perf_counter() if t0 is None else t0
    labels, y, threshold = _labels_y(_token_labels(labels), cfg)
    token_of = _cell_rows(feats, labels)  # [rows] each feature row's label
    if (cfg.aggregation == "cells") != (len(token_of) != len(y)):
        raise UserError(f"aggregation {cfg.aggregation} needs {'cell' if cfg.aggregation == 'cells' else 'token'} "
                        "rows of features: compute them with the same setting")
    X = feats.select(names).to_numpy().astype(float)
    groups = labels["prompt_id"].to_numpy()
    n_prompts = _check_prompts(groups)
    oof, importance = cross_validate(X, y[token_of], groups[token_of], cfg)
    if len(token_of) != len(y):  # cell rows: a token's score is the mean of its cells' logits (the rule's mean_raw)
        from scipy.special import expit, logit

        n_cells = np.bincount(token_of, minlength=len(y))
        oof = {m: expit(np.bincount(token_of, weights=logit(np.clip(p, 1e-15, 1 - 1e-15)), minlength=len(y))
                        / n_cells) for m, p in oof.items()}

    ranked = labels.select(KEYS).with_columns(pl.Series(m, oof[m]) for m in MODELS)  # keep what is likely harmful
    if scores is not None:
        rules = [c for c in scores.columns if c not in KEYS and c not in MODELS]
        ranked = ranked.join(scores.select(*KEYS, *rules), on=list(KEYS), how="left")
    result = rank_fitted(labels, ranked, cfg, scores_meta)

    models = _models(cfg)
    y_rows = y[token_of]
    final = models["fitted_logreg"].fit(X, y_rows)
    scaler, logreg = final[0], final[-1]
    imp = importance_table(names, final, importance)
    model = {
        "kind": KIND, **provenance(), "rule": cfg.rule, "features": list(names),
        "logistic": {"mean": scaler.mean_.tolist(), "scale": scaler.scale_.tolist(), "coef": logreg.coef_[0].tolist(),
                     "intercept": float(logreg.intercept_[0])},
        "boosted": boosted_json(models["fitted_gbt"].fit(X, y_rows)),
        "harm": cfg.harm, "harm_threshold": threshold, "aggregation": cfg.aggregation,
        "trained_on": {"n": len(y), "n_harmful": int(y.sum()), "prompts": training_prompts(groups, trace),
                       "horizon": ((labels_meta or {}).get("config") or {}).get("horizon"),
                       "model": trained_model(labels_meta, trace)},
        "labels": labels_meta, "trace": getattr(trace, "provenance", None),
    }

    out.mkdir(parents=True, exist_ok=True)
    write_table(
        feats.select(*KEYS, *names).with_columns(harmful=pl.Series(y_rows)), out / "features.parquet",
        {"kind": "fit_features", "features": list(names)},
    )
    write_table(ranked, out / "oof_scores.parquet", {"kind": "scores", "trace": (labels_meta or {}).get("trace"),
                                                     "scorers": {**((scores_meta or {}).get("scorers") or {}),
                                                                 **{m: {"out_of_fold": True} for m in MODELS}}})
    write_csv(result.metrics, out / "metrics.csv")
    write_text(out / "table.md", to_markdown(result, "pooled"))
    write_csv(imp, out / "importances.csv")
    write_json(out / "model.json", model)
    summary = {
        "n": len(y), "rows": len(y_rows), "n_harmful": int(y.sum()), "harm_threshold": threshold, "prompts": n_prompts,
        "folds": min(cfg.n_splits, n_prompts), "features": list(names), "seconds": round(time.perf_counter() - t0, 1),
        "rank_eval": result.summary,
    }
    write_json(out / "config.json", {"command": "fit", **provenance(), "config": asdict(cfg),
                                     "summary": summary, "inputs": {"labels": labels_meta, "scores": scores_meta}})
    return {"summary": summary, "metrics": result.metrics, "importances": imp, "result": result}


def boosted_json(clf) -> dict:
    """The trees of the fitted binary ``HistGradientBoostingClassifier`` ``clf`` as model.json's ``boosted`` section:
    ``baseline`` (``_baseline_prediction``, the log-odds before any tree) and per tree the lists of
    ``kvdiag.scorers.fitted_file.NODE_FIELDS`` from its ``TreePredictor.nodes``. Its ``decision_function`` on raw
    features is the baseline plus each tree's leaf (``_predict_one_from_raw_data``): ``num_threshold`` is on raw
    values, so no binning is needed; a split on missing values has threshold +inf, written null (JSON has no inf)."""
    trees = []
    for (predictor,) in clf._predictors:  # one tree per iteration (binary)
        nodes = predictor.nodes
        trees.append({
            "feature": nodes["feature_idx"].tolist(),
            "threshold": [None if np.isposinf(x) else float(x) for x in nodes["num_threshold"]],
            "missing_left": nodes["missing_go_to_left"].astype(bool).tolist(),
            "left": nodes["left"].tolist(), "right": nodes["right"].tolist(),
            "leaf": nodes["is_leaf"].astype(bool).tolist(), "value": nodes["value"].tolist(),
        })
    return {"baseline": float(clf._baseline_prediction[0, 0]), "trees": trees}


def training_prompts(groups: np.ndarray, trace=None) -> list[dict]:
    """model.json's training prompts: each prompt of ``groups`` (the labels' prompt ids) with the sha256 of its text
    from ``trace``'s manifest (null without a Trace): a fitted rule is refused on any prompt of the same text (or, where
    a text is missing, the same id)."""
    from kvdiag.scorers.fitted_file import text_digest

    prompts = trace.manifest["prompts"] if trace is not None else {}
    texts = {pid: (prompts.get(pid) or {}).get("text") for pid in np.unique(groups).tolist()}
    return [{"id": pid, "text_sha256": None if text is None else text_digest(text)} for pid, text in texts.items()]


def trained_model(labels_meta: dict | None, trace=None) -> dict | None:
    """The model the labels were made with (the Trace's manifest records it, else the labels' metadata): spec,
    architecture, weights hash and family (its ``model_type``; a fitted rule is refused on a model of another
    family)."""
    model = trace.manifest["model"] if trace is not None else (labels_meta or {}).get("model")
    if model is None:
        return None
    return {"spec": model.get("spec"), "architecture": model.get("architecture"),
            "weights_hash": model.get("weights_hash"), "family": (model.get("attention") or {}).get("family")}


def folds_of(y: np.ndarray, groups: np.ndarray, cfg: FitConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (train, held-out) row indices of ``min(n_splits, prompts)`` folds grouped by prompt (``groups [N]``),
    refused unless each side of every fold holds both classes of ``y [N]``: a classifier cannot learn one class, nor
    AUROC score it (sklearn's error was an internal one)."""
    from sklearn.model_selection import GroupKFold

    splits = list(GroupKFold(n_splits=min(cfg.n_splits, len(np.unique(groups)))).split(y, y, groups))
    for i, (train, test) in enumerate(splits):
        for part, rows in (("training", train), ("held-out", test)):
            if y[rows].min() == y[rows].max():
                prompts = ", ".join(sorted(map(str, np.unique(groups[rows]))))
                raise UserError(f"fold {i + 1}: its {part} prompts ({prompts}) hold only "
                                f"{'harmful' if y[rows][0] else 'harmless'} labels under --harm {cfg.harm}; every "
                                "fold needs both classes: label more prompts, pass fewer --folds or another --harm")
    return splits


def check_labels(labels: pl.DataFrame, cfg: FitConfig) -> None:
    """What the labels alone must allow, before the Trace's tensors or any features: token rows, two classes under
    ``--harm``, at least 2 prompts and both classes in every grouped fold (of the token rows; a per-cell fit repeats
    each token's rows once per cell, and :func:`cross_validate` checks its own folds again)."""
    labels, y, _ = _labels_y(_token_labels(labels), cfg)
    groups = labels["prompt_id"].to_numpy()
    _check_prompts(groups)
    folds_of(y, groups, cfg)


def _check_prompts(groups: np.ndarray) -> int:
    """The prompts ``groups`` cover, refused below 2."""
    if (n := len(np.unique(groups))) < 2:
        raise UserError(f"the labels cover {n} prompt: grouped cross-validation needs at least 2 prompts")
    return n


def cross_validate(X: np.ndarray, y: np.ndarray, groups: np.ndarray, cfg: FitConfig) -> tuple[dict, dict]:
    """Each model over ``min(n_splits, prompts)`` folds grouped by prompt: features ``X [N, F]``, harm labels
    ``y [N]``, prompts ``groups [N]``. Returns ``({model: out-of-fold P(harmful) [N]}, {model: permutation AUROC
    drop [F]})``, the drops averaged over folds weighted by their held-out rows (5 seeded repeats per fold)."""
    from sklearn.inspection import permutation_importance

    splits = folds_of(y, groups, cfg)
    oof = {m: np.zeros(len(y)) for m in MODELS}
    importance = {m: np.zeros(X.shape[1]) for m in MODELS}
    for train, test in splits:
        for name, model in _models(cfg).items():
            model.fit(X[train], y[train])
            oof[name][test] = model.predict_proba(X[test])[:, 1]
            imp = permutation_importance(model, X[test], y[test], scoring="roc_auc", n_repeats=5, random_state=cfg.seed)
            importance[name] += imp.importances_mean * len(test) / len(y)
    return oof, importance


IMPORTANCES_SCHEMA = {"feature": pl.String, "logreg_std_coef": pl.Float64, "logreg_permutation_auroc_drop": pl.Float64,
                      "gbt_permutation_auroc_drop": pl.Float64}


def importance_table(names: tuple[str, ...], final, importance: dict[str, np.ndarray]) -> pl.DataFrame:
    """importances.csv: per feature the standardized coefficient of the logistic regression fitted on every entry
    (``final``, a scaler + logistic regression pipeline) and each model's out-of-fold permutation AUROC drop
    (:func:`cross_validate`), by the trees' drop."""
    std_coef = dict(zip(names, final[-1].coef_[0].tolist(), strict=True))
    return pl.DataFrame({
        "feature": list(names), "logreg_std_coef": [std_coef[n] for n in names],
        "logreg_permutation_auroc_drop": importance["fitted_logreg"].tolist(),
        "gbt_permutation_auroc_drop": importance["fitted_gbt"].tolist(),
    }, schema=IMPORTANCES_SCHEMA).sort("gbt_permutation_auroc_drop", descending=True, maintain_order=True)


def fit_files(trace: str | Path, labels: str | Path, scores: str | Path | None, out: str | Path, cfg: FitConfig,
              progress: bool = True) -> dict:
    """What ``kvdiag fit`` runs: read the Trace, labels and (optional) scores, refuse inputs that do not belong
    together or an unwritable ``out`` before any work, then :func:`fit_ceiling`."""
    from kvdiag.core.contracts import belongs, read_labels, read_scores
    from kvdiag.core.io import check_writable
    from kvdiag.rankeval import check_inputs
    from kvdiag.trace.manifest import TraceFiles

    check_config(cfg)
    check_writable(out, "--out", "dir")
    trace_files = TraceFiles(trace)
    label_df, label_meta = read_labels(labels)
    belongs(trace_files, label_meta, f"--labels {labels}")
    score_df, score_meta = read_scores(scores) if scores is not None else (None, None)
    if scores is not None:
        belongs(trace_files, score_meta, f"--scores {scores}")
        check_inputs(label_meta, score_meta)
    check_labels(label_df, cfg)
    from kvdiag.trace import Trace  # torch, once the arguments and files are checked

    tr = Trace(trace)
    return fit_ceiling(
        tr, label_df, score_df, out, cfg, labels_meta=label_meta, scores_meta=score_meta, progress=progress
    )


def rank_fitted(labels: pl.DataFrame, ranked: pl.DataFrame, cfg: FitConfig, scores_meta: dict | None = None):
    """rank-eval of the out-of-fold scores ``ranked`` (a run's oof_scores.parquet) beside the rules, against the
    analysed token rows of ``labels``, with ``fitted_logreg`` as the reference: what metrics.csv and table.md hold."""
    from kvdiag.rankeval import rank_eval

    return rank_eval(
        cfg.harm_spec.analysed(_token_labels(labels)), ranked, harm=cfg.harm, include_unresolved=cfg.include_unresolved,
        noise_mult=cfg.noise_mult, n_boot=cfg.n_boot, seed=cfg.seed, reference="fitted_logreg", granularity="token",
        scores_meta=scores_meta,
    )


def load_summary(path: str | Path) -> dict:
    """What ``kvdiag fit`` wrote into the directory ``path``: ``{"config": config.json, "table.md": text,
    "importances": DataFrame}``; an unfinished directory is a ``UserError``."""
    from kvdiag.core.io import read_csv, read_json

    path = Path(path)
    missing = [f for f in ("config.json", "table.md", "importances.csv") if not (path / f).is_file()]
    if missing:
        raise UserError(f"{', '.join(missing)} missing (kvdiag fit did not finish)")
    config = read_json(path / "config.json", "config.json")
    summary = config.get("summary") if isinstance(config, dict) else None
    if not (isinstance(summary, dict) and isinstance(summary.get("features"), list)
            and all(isinstance(summary.get(k), int) and not isinstance(summary.get(k), bool)
                    for k in ("n", "n_harmful", "folds"))):
        raise UserError(f"config.json {path / 'config.json'} is not the object kvdiag fit writes (its summary's "
                        "features, n, n_harmful, folds); re-run kvdiag fit")
    return {"config": config, "table.md": (path / "table.md").read_text(),
            "importances": read_csv(path / "importances.csv", IMPORTANCES_SCHEMA, "--run", "re-run kvdiag fit",
                                    keys=("feature",))}
