"""rank_eval on synthetic label/score tables: metric properties, conventions and bad input."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.core.errors import UserError
from kvdiag.rankeval import KEYS, check_inputs, rank_eval, to_latex, to_markdown


def make_tables(n_prompts=6, n_ckpt=3, n_cand=40, seed=0, noise_floor=1e-9):
    """labels (lognormal KL) and scores: perfect (log KL), random, avokv_e (noisy log KL), constant."""
    rng = np.random.default_rng(seed)
    parts = []
    for p in range(n_prompts):
        for c in range(n_ckpt):
            parts.append(
                pl.DataFrame(
                    {
                        "prompt_id": f"p{p:02d}", "checkpoint": 128 * (c + 2), "position": np.arange(n_cand),
                        "granularity": "token", "layer": -1, "kv_head": -1,
                        "kl_mean": np.exp(rng.normal(-5, 2, n_cand)), "noise_floor": noise_floor,
                    }
                )
            )
    labels = pl.concat(parts)
    logkl = np.log(labels["kl_mean"].to_numpy())
    scores = labels.select(KEYS).with_columns(
        perfect=pl.Series(logkl), random=pl.Series(rng.random(labels.height)),
        avokv_e=pl.Series(logkl + rng.normal(0, 1.5, labels.height)), constant=pl.lit(0.0),
    )
    return labels, scores


def _value(result, scorer, metric, scope="pooled"):
    row = result.metrics.filter(scorer=scorer, metric=metric, scope=scope).row(0, named=True)
    return row["value"]


def test_perfect_scorer():
    labels, scores = make_tables()
    r = rank_eval(labels, scores, n_boot=50)
    for scope in ("pooled", "macro"):
        assert _value(r, "perfect", "auroc", scope) == 1.0
        assert _value(r, "perfect", "ap", scope) == pytest.approx(1.0)
        assert _value(r, "perfect", "topk_recall", scope) == pytest.approx(1.0)
        assert _value(r, "perfect", "fsr", scope) == 0.0
        assert _value(r, "perfect", "fnr", scope) == 0.0
        assert _value(r, "perfect", "spearman", scope) == pytest.approx(1.0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rho=st.sampled_from([0.25, 0.5, 0.75]))
def test_random_scorer_fsr_is_prevalence_and_fnr_is_rho(seed, rho):
    labels, scores = make_tables(n_prompts=20, n_ckpt=5, n_cand=100, seed=seed)
    r = rank_eval(labels, scores, rho=rho, n_boot=0, scorers=("random",), reference=None)
    prevalence = _value(r, "random", "prevalence")
    # sd of FNR ~ sqrt(rho (1 - rho) / 1000 harmful) <= 0.016; of FSR ~ 0.005
    assert _value(r, "random", "fsr") == pytest.approx(prevalence, abs=0.03)
    assert _value(r, "random", "fnr") == pytest.approx(rho, abs=0.07)
    assert _value(r, "random", "auroc") == pytest.approx(0.5, abs=0.07)


def test_constant_scorer_is_exactly_the_random_baseline():
    # all candidates tied: ties are split in expectation, so FSR = prevalence and FNR = floor(rho C) / C exactly
    labels, scores = make_tables(n_cand=30)
    r = rank_eval(labels, scores, rho=0.5, n_boot=20)
    assert _value(r, "constant", "fsr", "macro") == pytest.approx(_value(r, "constant", "prevalence", "macro"))
    assert _value(r, "constant", "fsr") == pytest.approx(_value(r, "constant", "prevalence"))
    assert _value(r, "constant", "fnr") == pytest.approx(15 / 30)
    assert _value(r, "constant", "auroc") == 0.5
    row = r.metrics.filter(scorer="constant", metric="spearman", scope="pooled").row(0, named=True)
    assert math.isnan(row["value"]) and row["note"].startswith("undefined: constant score")


def test_no_silent_nan_and_columns():
    labels, scores = make_tables()
    r = rank_eval(labels, scores, n_boot=30)
    assert r.metrics.columns[:6] == ["scorer", "metric", "scope", "value", "ci_low", "ci_high"]
    assert set(r.metrics["metric"]) == {"auroc", "ap", "prevalence", "topk_recall", "fsr", "fnr", "spearman"}
    assert r.metrics.height == 4 * 7 * 2
    for table in (r.metrics, r.paired):
        nan_rows = table.filter(pl.col("value").is_nan() | pl.col("ci_low").is_nan())
        assert nan_rows.height > 0  # the constant scorer
        assert all(note for note in nan_rows["note"])


def test_harm_threshold_quantile_and_abs():
    labels, scores = make_tables()
    kl = labels["kl_mean"].to_numpy()
    r = rank_eval(labels, scores, harm="quantile:0.8", n_boot=0)
    assert r.summary["harm_threshold"] == pytest.approx(np.quantile(kl, 0.8))
    assert r.summary["prevalence"] == pytest.approx(np.mean(kl > np.quantile(kl, 0.8)))
    r = rank_eval(labels, scores, harm="abs:0.01", n_boot=0)
    assert r.summary["harm_threshold"] == 0.01
    assert r.summary["n_harmful"] == int((kl > 0.01).sum())


def test_macro_skips_checkpoints_without_harm_and_says_so():
    labels, scores = make_tables(n_prompts=3, n_ckpt=2)
    # checkpoint 256 of p00: nothing harmful
    quiet = (pl.col("prompt_id") == "p00") & (pl.col("checkpoint") == 256)
    labels = labels.with_columns(kl_mean=pl.when(quiet).then(1e-6).otherwise(pl.col("kl_mean")))
    r = rank_eval(labels, scores, harm="abs:0.01", n_boot=20)
    row = r.metrics.filter(scorer="avokv_e", metric="auroc", scope="macro").row(0, named=True)
    assert row["n"] == 5
    assert "1 of 6 checkpoints skipped" in row["note"] and "no harmful entry" in row["note"]
    assert r.metrics.filter(scorer="avokv_e", metric="fsr", scope="macro")["n"].item() == 6


def test_unresolved_excluded_by_default_and_included_on_request():
    labels, scores = make_tables(noise_floor=np.exp(-7.0))
    below = int((labels["kl_mean"] <= np.exp(-7.0)).sum())
    assert below > 0
    r = rank_eval(labels, scores, n_boot=0)
    assert r.summary["n_unresolved"] == below and r.summary["n_evaluated"] == labels.height - below
    r = rank_eval(labels, scores, n_boot=0, include_unresolved=True)
    assert r.summary["n_evaluated"] == labels.height
    r = rank_eval(labels, scores, n_boot=0, noise_mult=0.0)  # kl_mean <= 0: none
    assert r.summary["n_unresolved"] == 0


def test_paired_against_reference():
    labels, scores = make_tables()
    scores = scores.with_columns(twin=pl.col("avokv_e"))
    r = rank_eval(labels, scores, n_boot=100)
    assert "avokv_e" not in set(r.paired["scorer"])
    twin = r.paired.filter(scorer="twin", metric="auroc", scope="pooled").row(0, named=True)
    assert (twin["diff"], twin["ci_low"], twin["ci_high"], twin["p_value"]) == (0.0, 0.0, 0.0, 1.0)
    worse = r.paired.filter(scorer="random", metric="auroc", scope="macro").row(0, named=True)
    assert worse["diff"] == pytest.approx(worse["value"] - worse["reference_value"])
    # below 30 prompts: the exact sign test of the per-prompt differences (random is worse on every prompt)
    n = labels["prompt_id"].n_unique()
    assert worse["ci_high"] < 0 and (worse["test"], worse["prompts"]) == ("sign", n)
    assert worse["p_value"] == pytest.approx(2 * 0.5**n)
    assert rank_eval(labels, scores, n_boot=0, reference=None).paired.height == 0
    many_labels, many_scores = make_tables(n_prompts=30)
    many = rank_eval(many_labels, many_scores, n_boot=100).paired
    row = many.filter(scorer="random", metric="auroc", scope="macro").row(0, named=True)
    assert (row["test"], row["prompts"], row["p_value"]) == ("bootstrap", 30, 0.0)  # 30 prompts: the bootstrap p


def test_one_prompt_marks_degenerate_intervals():
    labels, scores = make_tables(n_prompts=1)
    r = rank_eval(labels, scores, n_boot=20)
    row = r.metrics.filter(scorer="avokv_e", metric="auroc", scope="pooled").row(0, named=True)
    assert row["ci_low"] == row["ci_high"] == row["value"] and "degenerate: 1 prompt" in row["note"]
    paired = r.paired.filter(scorer="random", metric="auroc", scope="pooled").row(0, named=True)
    assert math.isnan(paired["p_value"]) and "degenerate" in paired["note"]
    assert any("1 prompt(s) only" in w for w in r.summary["warnings"])


def test_partial_join_warns_and_counts():
    labels, scores = make_tables()
    r = rank_eval(labels, scores.head(scores.height - 40), n_boot=0)
    assert r.summary["n_matched"] == labels.height - 40
    assert any(f"{labels.height - 40} of {labels.height}" in w for w in r.summary["warnings"])


def test_granularity_must_be_one():
    labels, scores = make_tables()
    heads = labels.with_columns(granularity=pl.lit("head"), layer=pl.lit(0), kv_head=pl.lit(0))
    both_l = pl.concat([labels, heads])
    both_s = pl.concat([scores, scores.with_columns(granularity=pl.lit("head"), layer=pl.lit(0), kv_head=pl.lit(0))])
    with pytest.raises(UserError, match="--granularity"):
        rank_eval(both_l, both_s, n_boot=0)
    r = rank_eval(both_l, both_s, n_boot=0, granularity="head")
    assert r.summary["granularity"] == "head" and r.summary["n_matched"] == labels.height


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda l, s: (l, s.with_columns(prompt_id="x" + pl.col("prompt_id"))),
            r"labels \(720 rows\) and scores \(720 rows\) match on 0 rows.*0 prompt_ids in common",
        ),
        (lambda l, s: (l, s.with_columns(random=pl.lit(float("nan")))), "'random' is NaN for all 720"),
        (
            lambda l, s: (
                l, s.with_columns(random=pl.when(pl.col("position") == 3).then(None).otherwise(pl.col("random"))),
            ),
            "'random' is NaN for 18 of 720",
        ),
        (lambda l, s: (l, s.with_columns(name=pl.lit("x"))), "'name' is String, not a numeric score"),
        (lambda l, s: (l.drop("kl_mean"), s), "lacks column 'kl_mean'"),
        (lambda l, s: (l, s.drop("kv_head")), r"scores lacks key column\(s\) kv_head"),
        (lambda l, s: (pl.concat([l, l.head(2)]), s), "labels has 2 duplicate rows"),
        (lambda l, s: (l.with_columns(noise_floor=pl.lit(1e6)), s), "all 720 labels are at or below"),
    ],
)
def test_bad_input_is_a_clear_user_error(change, match):
    labels, scores = change(*make_tables(n_prompts=6, n_ckpt=3, n_cand=40))
    with pytest.raises(UserError, match=match):
        rank_eval(labels, scores, n_boot=0)


@pytest.mark.parametrize(
    ("settings_", "match"),
    [
        ({"harm": "abs:100"}, "leaves no harmful label among 720"), ({"harm": "abs:0"}, "leaves no safe label"),
        ({"harm": "quantile:1.5"}, "--harm 'quantile:1.5' is not"), ({"harm": "top:3"}, "--harm 'top:3' is not"),
        ({"rho": 1.0}, "--rho 1.0"), ({"reference": "nope"}, "--reference nope is not a scorer.*avokv_e"),
        ({"scorers": ("avokv_e", "nope")}, "--scorers nope not in the scores file"),
        ({"granularity": "layer"}, "--granularity layer not in the labels"),
    ],
)
def test_bad_settings_are_clear_user_errors(settings_, match):
    labels, scores = make_tables()
    with pytest.raises(UserError, match=match):
        rank_eval(labels, scores, n_boot=0, **settings_)


def test_check_inputs_refuses_other_trace_or_swapped_files():
    check_inputs({"kind": "labels", "trace": {"fingerprint": "a"}}, {"kind": "scores", "trace": {"fingerprint": "a"}})
    check_inputs({}, {})  # no provenance: nothing to check
    with pytest.raises(UserError, match="different traces"):
        check_inputs(
            {"kind": "labels", "trace": {"fingerprint": "a"}}, {"kind": "scores", "trace": {"fingerprint": "b"}}
        )
    with pytest.raises(UserError, match="--labels is a scores table"):
        check_inputs({"kind": "scores"}, {"kind": "scores"})


def test_tables_have_one_row_per_scorer():
    labels, scores = make_tables()
    r = rank_eval(labels, scores, n_boot=20)
    md = to_markdown(r)
    assert md.splitlines()[0] == "| Score | AUROC | AP | Top-k recall | False-safe rate | Spearman |"
    assert [line.split(" | ")[0] for line in md.splitlines()[2:6]] == ["| perfect", "| random", "| avokv_e", "| "
                                                                                                             "constant"]
    assert "n/a" in md and "prevalence" in md and "720 candidates" in md
    tex = to_latex(r, scope="macro")
    assert r"\toprule" in tex and r"\bottomrule" in tex and r"avokv\_e" in tex and r"kl\_mean \textgreater{}" in tex
    assert tex.count(r"\\") == 1 + 4  # header + one row per scorer


def test_the_exact_test_compares_each_prompt_alone(monkeypatch):
    """The sign test's per-prompt values are rank-eval on that prompt alone (at the run's harm threshold)."""
    from kvdiag.rankeval import evaluate as ev

    labels, scores = make_tables()
    seen, real = {}, ev._estimates

    def spy(data, names, cfg, mult):
        out = real(data, names, cfg, mult)
        if mult.shape[0] == mult.shape[1] and (mult == np.eye(len(mult))).all():
            seen["per_prompt"] = out
        return out

    monkeypatch.setattr(ev, "_estimates", spy)
    r = rank_eval(labels, scores, n_boot=20)
    per_prompt = seen["per_prompt"]
    for i, pid in enumerate(sorted(labels["prompt_id"].unique())[:2]):
        one = rank_eval(labels.filter(pl.col("prompt_id") == pid), scores.filter(pl.col("prompt_id") == pid),
                        n_boot=0, harm=f"abs:{r.summary['harm_threshold']}")
        for scope in ("pooled", "macro"):
            want = one.metrics.filter(scorer="random", metric="auroc", scope=scope)["value"].item()
            assert per_prompt["random"][("auroc", scope)].reps[i] == pytest.approx(want, abs=1e-12)
