"""#56: the fitted rule ``kvdiag fit`` saves (model.json: both models, no pickles) scores exactly as scikit-learn's
``decision_function``, runs live (``EvictingCache``, ``as_press``), and is refused on its own training prompts or on
another model family."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.fit import FitConfig, boosted_json, fit_ceiling, fit_features
from kvdiag.fit.run import _cell_rows, _labels_y, _models, _token_labels
from kvdiag.rankeval import KEYS
from kvdiag.scorers.entry_features import CELL_FEATURES, LIVE, entry_features
from kvdiag.scorers.fitted import Boosted
from kvdiag.scorers.fitted_file import Evaluation, check_fitted, text_digest, trace_evaluation

ATOL = 1e-9  # float64 on both sides: only the order of the trees' sum (and of the dot product) differs


@pytest.fixture(scope="module", params=["mean_raw", "cells"])
def fitted(request, tiny_trace, tmp_path_factory):
    """``kvdiag fit`` of exact labels (H = 4) of the tiny Trace on token rows (cell-mean features) or on cell rows
    (``--per-cell``), the boosted rule saved: (model.json path, the features.parquet table, its config)."""
    from kvdiag.core.io import read_meta
    from kvdiag.label import LabelConfig, label_trace
    from kvdiag.model.load import load_model

    root = tmp_path_factory.mktemp("fitted")
    labels_path = label_trace(
        tiny_trace, load_model("tiny:llama"), root / "labels.parquet",
        LabelConfig(checkpoints="every:8", w_obs=8, horizon=4, candidates="16"), show_progress=False,
    )
    cfg = FitConfig(n_boot=0, n_splits=2, rule="boosted", gbt_max_iter=40, aggregation=request.param)
    fit_ceiling(tiny_trace, pl.read_parquet(labels_path), None, root / "fit", cfg, labels_meta=read_meta(labels_path))
    return root / "fit" / "model.json", pl.read_parquet(root / "fit" / "features.parquet"), cfg, labels_path


def cell_features(trace, names, pid, t, layer) -> tuple[object, np.ndarray]:
    """(the ScoreContext of ``layer`` at checkpoint ``t``, its entries' features [Hkv * t, F] float64)."""
    from kvdiag.scorers import ScoreContext

    qkv = trace.layer(pid, layer)
    ctx = ScoreContext(qkv.q[:, :t], qkv.k[:, :t], qkv.v[:, :t], trace.layer_attention(layer), trace.prompt_len(pid),
                       layer, pid)
    return ctx, entry_features(ctx, names).double().flatten(1).T.numpy()


def with_rule(path, rule: str, tmp_path):
    """A copy of the model.json at ``path`` that runs ``rule``."""
    model = json.loads(path.read_text())
    copy = tmp_path / f"{rule}.json"
    copy.write_text(json.dumps({**model, "rule": rule}))
    return copy


def test_both_fitted_models_score_as_sklearn_decides(fitted, tiny_trace, tmp_path, restore_scorers):
    """The saved rule's raw score of every entry of every (layer, KV head) cell equals the sklearn model's
    ``decision_function`` on that cell's feature matrix, within 1e-9 (float64 both sides): the trees (boosted) and the
    standardized logistic regression, refitted here on the fit's own features (sklearn is deterministic at a seed)."""
    from kvdiag.scorers import get_scorer

    path, feats, cfg, labels_path = fitted
    model = json.loads(path.read_text())
    names = model["features"]
    labels, y, _ = _labels_y(_token_labels(pl.read_parquet(labels_path)), cfg)
    token_of = _cell_rows(feats, labels)
    per_cell = cfg.aggregation == "cells"
    assert len(token_of) == labels.height * (tiny_trace.num_layers * tiny_trace.num_kv_heads if per_cell else 1)
    assert ("cell_layer" in names) == per_cell  # the cell's own features only where each cell is a row
    y = y[token_of]
    assert (feats["harmful"].to_numpy() == y).all()
    X = feats.select(names).to_numpy().astype(float)
    sk = {"boosted": _models(cfg)["fitted_gbt"].fit(X, y), "logistic": _models(cfg)["fitted_logreg"].fit(X, y)}
    assert model["boosted"] == json.loads(json.dumps(boosted_json(sk["boosted"])))  # the refit is the saved fit
    assert model["rule"] == "boosted" and len(model["boosted"]["trees"]) == 40
    pid = tiny_trace.prompt_ids[0]
    for rule in ("boosted", "logistic"):
        scorer = get_scorer("fitted", path=str(with_rule(path, rule, tmp_path)))
        for layer in range(tiny_trace.num_layers):
            for t in (24, tiny_trace.length(pid)):
                ctx, cells = cell_features(tiny_trace, names, pid, t, layer)
                got = scorer.score(ctx)
                assert got.dtype == torch.float64 and got.shape == (tiny_trace.num_kv_heads, t)
                want = sk[rule].decision_function(cells).reshape(tiny_trace.num_kv_heads, t)
                np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=ATOL, err_msg=f"{rule} layer {layer}")
                assert np.unique(want).size > 1  # the trees split these entries


def test_cell_rows_hold_each_cells_own_features(fitted, tiny_trace):
    """``--per-cell``: a labelled token's rows in features.parquet are its (layer, KV head) cells in order, each with
    the features the rule computes in that cell (same code and shapes, compared within 1e-6 for float32)."""
    path, feats, cfg, _ = fitted
    if cfg.aggregation != "cells":
        pytest.skip("token rows: the cell-mean features")
    names = json.loads(path.read_text())["features"]
    pid, t, pos = feats.row(0, named=True)["prompt_id"], feats["checkpoint"][0], feats["position"][0]
    rows = feats.filter((pl.col("prompt_id") == pid) & (pl.col("checkpoint") == t) & (pl.col("position") == pos))
    L, Hkv = tiny_trace.num_layers, tiny_trace.num_kv_heads
    assert rows.select("layer", "kv_head").rows() == [(layer, h) for layer in range(L) for h in range(Hkv)]
    for layer in range(L):
        _, cells = cell_features(tiny_trace, names, pid, t, layer)
        got = rows.filter(pl.col("layer") == layer).select(names).to_numpy()
        np.testing.assert_allclose(got, cells[[h * t + pos for h in range(Hkv)]], rtol=1e-6, atol=1e-6)


def test_the_file_records_its_training_prompts_horizon_and_model(fitted, tiny_trace):
    model = json.loads(fitted[0].read_text())
    trained = model["trained_on"]
    manifest = tiny_trace.manifest
    assert trained["prompts"] == [{"id": pid, "text_sha256": text_digest(manifest["prompts"][pid]["text"])}
                                  for pid in sorted(tiny_trace.prompt_ids)]
    assert trained["horizon"] == 4
    assert trained["model"] == {"spec": "tiny:llama", "architecture": "LlamaForCausalLM", "family": "llama",
                                "weights_hash": manifest["model"]["weights_hash"]}
    assert set(model) >= {"logistic", "boosted"} and model["kind"] == "kvdiag_fitted_rule"


def test_boosted_trees_follow_missing_values_and_splits_on_them():
    """Trees grown on features with NaN: a NaN goes where ``missing_go_to_left`` says, and a split on missing
    values only (threshold +inf, null in the file) sends every number left; torch equals ``decision_function``."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 3))
    X[rng.random(600) < 0.3, 0] = np.nan
    y = (np.isnan(X[:, 0]) ^ (X[:, 1] > 0.5)).astype(int)  # missingness carries the label
    clf = HistGradientBoostingClassifier(max_iter=30, max_leaf_nodes=8, random_state=0, categorical_features=None)
    section = json.loads(json.dumps(boosted_json(clf.fit(X, y))))
    nodes = [(tree["leaf"][i], tree["threshold"][i], tree["missing_left"][i]) for tree in section["trees"]
             for i in range(len(tree["leaf"]))]
    assert any(not leaf and thr is None for leaf, thr, _ in nodes)  # a split on missing values
    assert any(not leaf and ml for leaf, _, ml in nodes) and any(not leaf and not ml for leaf, _, ml in nodes)
    test = rng.normal(size=(400, 3))
    test[rng.random(400) < 0.3, 0] = np.nan
    test[:5, 2] = np.inf  # beyond every threshold
    got = Boosted.from_json(section)(torch.from_numpy(test.T.copy()))
    np.testing.assert_allclose(got.numpy(), clf.decision_function(test), rtol=0, atol=ATOL)


def live_model(tmp_path, rule: str):
    """model.json of a fit on the live features only (synthetic keys and labels, 8 prompts), running ``rule``."""
    rng = np.random.default_rng(1)
    rows = [pl.DataFrame({"prompt_id": f"p{p}", "checkpoint": 100, "position": np.arange(60), "granularity": "token",
                          "layer": -1, "kv_head": -1, "kl_mean": np.exp(rng.normal(-5, 2, 60)), "noise_floor": 1e-12})
            for p in range(8)]
    labels = pl.concat(rows)
    live = tuple(n for n in LIVE if n not in CELL_FEATURES)
    feats = labels.select(KEYS).with_columns(pl.Series(n, rng.normal(size=labels.height)) for n in live)
    feats = feats.with_columns(window_attention=np.log(labels["kl_mean"].to_numpy()))  # a feature that ranks
    fit_features(feats, labels, None, tmp_path / rule, FitConfig(features=live, n_boot=0, n_splits=2, rule=rule,
                                                                 gbt_max_iter=20))
    return tmp_path / rule / "model.json"


@pytest.mark.parametrize("rule", ["boosted", "logistic"])
def test_a_fitted_rule_runs_in_an_evicting_cache_and_a_press(rule, tiny_llama, tmp_path, restore_scorers):
    """``EvictingCache(model, "fitted:PATH")`` generates under the budget, and ``as_press("fitted:PATH")`` runs in
    kvpress's pipeline: a fitted rule on features without ``history`` is a live rule by name."""
    from kvdiag.generate import EvictingCache

    name = f"fitted:{live_model(tmp_path, rule)}"
    ids = torch.tensor([list(range(40, 60))])
    cache = EvictingCache(tiny_llama.model, name, budget=16, interval=8)
    out = tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=24,
                                    do_sample=False)
    assert out.shape[1] == 44 and len(cache.compressions) >= 2
    assert all(layer.positions.shape[-1] <= 16 + 8 for layer in cache.layers)
    kvpress = pytest.importorskip("kvpress")
    from kvdiag.generate.kvpress_export import as_press

    pipe = kvpress.KVPressTextGenerationPipeline(model=tiny_llama.model, tokenizer=tiny_llama.tokenizer)
    press = as_press(name, tiny_llama.model, budget=16, interval=8)
    answer = pipe("Alice has 3 apples and Bob has 4 apples. ", question="How many apples?", press=press,
                  max_new_tokens=20)["answer"]
    assert isinstance(answer, str)
    assert all(press.prefilling_press.shared[layer].shape[-1] == 16 for layer in range(tiny_llama.attention.num_layers))


def test_training_prompts_and_family_are_refused(fitted, tiny_trace, tmp_path):
    """The overlap rule: the same text (whatever the id), or the same id where a text is missing; another family."""
    path, *_ = fitted
    names = [f"fitted:{path}"]
    manifest = tiny_trace.manifest
    with pytest.raises(UserError, match=r"trained on 2 of the 2 prompts of --trace T \(arith000, arith001\)"):
        check_fitted(names, {}, trace_evaluation(manifest, "--trace T"))
    renamed = {f"x{i}": p["text"] for i, p in enumerate(manifest["prompts"].values())}
    with pytest.raises(UserError, match=r"trained on 2 of the 2 prompts of --prompts P \(x0, x1\)"):
        check_fitted(names, {}, Evaluation("--prompts P", renamed, "tiny:llama", "llama"))
    with pytest.raises(UserError, match=r"trained on 1 of the 2"):  # no text: told by the id
        check_fitted(names, {}, Evaluation("--prompts P", {"arith000": None, "new": "another question"}, "m", "llama"))
    check_fitted(names, {}, Evaluation("--prompts P", {"arith000": "another question"}, "m", "llama"))  # new text
    with pytest.raises(UserError, match=r"trained on tiny:llama \(family llama\); --trace T runs tiny:qwen3 "
                                        r"\(family qwen3\)"):
        check_fitted(names, {}, Evaluation("--trace T", {"new": "another question"}, "tiny:qwen3", "qwen3"))
    check_fitted(["fitted"], {"fitted": {"path": str(path)}}, Evaluation("--trace T", {"new": "x"}, "m", None))
