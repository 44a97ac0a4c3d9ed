"""Exact labels in teacher-forced replay: a compression's joint label is the KL the replay then measures (masking
the evicted set in the label engine equals the physically compacted cache), the oracle policy keeps the entries
whose eviction costs most, and the sweep records both with their cost."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
from scipy.stats import spearmanr

from kvdiag.label.engine import OracleEngine
from kvdiag.replay import Policy, ReplaySettings, decode, full_logprobs, kl_steps, make_scorer, replay, teacher_force
from kvdiag.replay.oracle import LiveLabels, OracleRule, evicted_set

PROMPT = list(range(40, 70))  # 30 byte tokens
H = 8  # label horizon; the interval (16) is longer, so no compaction falls inside a label's horizon


def _sequence(lm):
    return decode(lm, PROMPT, None, max_new_tokens=60).token_ids


def test_first_joint_label_equals_the_replayed_kl(tiny_model):
    ids = _sequence(tiny_model)
    P = len(PROMPT)
    for selection in ("per-head", "per-token"):
        pol = Policy(make_scorer("rkv"), 20, 16, selection)
        run = teacher_force(tiny_model, ids, P, pol, labels=LiveLabels(tiny_model, torch.tensor(ids), H))
        kl = kl_steps(full_logprobs(tiny_model.model, ids, P), run.logprobs)
        assert len(run.joint) == len(run.compressions) >= 3 and max(run.joint) > 1e-3
        # the first compaction (at the end of the 30-token prompt) evicts from a cache written without eviction, so
        # its label is the KL the replay then measures: row j of kl predicts position P + j, and the horizon's
        # tokens t .. t+H-1 predict t+1 .. t+H. Later labels evict the same set from the full-cache prefix, while the
        # replay's later entries were written under a compacted cache (the drift the label leaves out).
        t, joint = run.compressions[0], run.joint[0]
        assert t == P
        replayed = float(kl[t + 1 - P : t + H + 1 - P].mean())
        assert abs(joint - replayed) <= 1e-5 + 1e-3 * replayed, (t, joint, replayed)


def test_oracle_keeps_the_costliest_entries(tiny_llama):
    ids = _sequence(tiny_llama)
    P, budget = len(PROMPT), 20
    pol = Policy(OracleRule(H), budget, 16, "per-token")
    run = teacher_force(tiny_llama, ids, P, pol, keep_history=True, labels=LiveLabels(tiny_llama, torch.tensor(ids), H))
    (t, kept), (t2, kept2) = run.kept[0], run.kept[1]
    assert all(torch.equal(kept, kept[0, 0].expand_as(kept)) for _, kept in run.kept)  # token sets
    # the first compaction from an uncompressed cache of t entries: single-entry labels from a fresh engine
    singles, _ = OracleEngine(tiny_llama, torch.tensor(ids), H).label_sets(t, [torch.tensor([i]) for i in range(t)])
    want = torch.topk(singles["kl"].mean(-1), budget).indices.sort().values
    assert torch.equal(kept[0, 0], want)
    # the second: each live entry's label on top of what the first evicted
    gone = evicted_set(kept[:1, :1], t)[0, 0]
    live = torch.cat([kept[0, 0], torch.arange(t, t2)])
    sets = [torch.cat([gone, live[i : i + 1]]) for i in range(live.numel())]
    labels, _ = OracleEngine(tiny_llama, torch.tensor(ids), H).label_sets(t2, sets)
    assert torch.equal(kept2[0, 0], live[torch.topk(labels["kl"].mean(-1), budget).indices.sort().values])


def test_sweep_records_joint_labels_and_their_cost(tiny_llama, tiny_trace, tmp_path):
    settings = ReplaySettings(scorers=["oracle", "rkv"], budgets=[16], interval=16, selection="per-token", horizon=H)
    replay(tiny_llama, tmp_path / "r", settings, trace=tiny_trace)
    df = pl.read_parquet(tmp_path / "r" / "generations.parquet")
    assert set(df["scorer"]) == {"oracle", "rkv"}
    for row in df.iter_rows(named=True):
        assert row["compressions"] >= 2 and len(row["joint_kl"]) == row["compressions"]
        assert row["label_seconds"] > 0 and row["label_rows"] >= row["compressions"]
    oracle = df.filter(pl.col("scorer") == "oracle")
    rkv = df.filter(pl.col("scorer") == "rkv")
    # the oracle labels every live entry at every compaction (n = budget + interval rows, or the prompt chunk's)
    assert (oracle["label_rows"] > 10 * rkv["label_rows"]).all()
    # the regret is the paired difference of the runs' mean KL, and the table states the oracle's cost
    reg = pl.read_csv(tmp_path / "r" / "regret.csv").row(0, named=True)
    want = float((rkv.sort("prompt_id")["kl_mean"] - oracle.sort("prompt_id")["kl_mean"]).mean())
    assert reg["scorer"] == "rkv" and reg["prompts"] == 2 and abs(reg["regret"] - want) < 1e-9
    text = (tmp_path / "r" / "decisions.md").read_text()
    assert "Oracle cost" in text and "joint damage" in text


def test_single_label_auroc_joins_rank_eval_and_the_loop(tiny_llama, tiny_trace, tmp_path):
    """``--auroc LABELS SCORES``: each rule's pooled AUROC and replicates are rank-eval's own; with the replay's
    prompts and seed they sit on the same resamples, and the rule-level row is the Spearman of AUROC against minus
    the in-loop KL. A rule without a score column is refused; scored parameters that differ are named."""
    from kvdiag.core.errors import UserError
    from kvdiag.core.io import read_table, write_table
    from kvdiag.label import LabelConfig
    from kvdiag.label.run import label_trace
    from kvdiag.rankeval.evaluate import rank_eval
    from kvdiag.replay.predict import single_label_auroc
    from kvdiag.scorers.run import score_trace

    rules = ["rkv", "tova", "streamingllm"]
    labels_path = label_trace(tiny_trace, tiny_llama, tmp_path / "labels.parquet",
                              LabelConfig(checkpoints="every:16", horizon=H, candidates="all", w_obs=0),
                              show_progress=False)
    labels, _ = read_table(labels_path)
    scores, meta = score_trace(tiny_trace, keys=labels, scorers=rules + ["random"])
    scores_path = write_table(scores, tmp_path / "scores.parquet", meta)

    settings = ReplaySettings(scorers=rules, budgets=[16], interval=16, selection="per-token", horizon=H)
    params = {r: make_scorer(r, None, settings.w_obs).params for r in rules}
    single = single_label_auroc(labels_path, scores_path, rules, params, n_boot=200)
    want = rank_eval(labels, scores, scorers=tuple(rules), n_boot=200, seed=0, reference=None)
    for r in rules:
        value, reps = single.auroc[r]
        row = want.metrics.filter((pl.col("scorer") == r) & (pl.col("metric") == "auroc")
                                  & (pl.col("scope") == "pooled"))
        assert value == row["value"][0]
        assert np.array_equal(reps, want.replicates[(r, "auroc", "pooled")], equal_nan=True)
    assert single.prompts == sorted(tiny_trace.prompt_ids) and not single.notes
    changed = {**params, "rkv": {**params["rkv"], "window": 3}}
    other = single_label_auroc(labels_path, scores_path, rules, changed, n_boot=0)
    assert len(other.notes) == 1 and other.notes[0].startswith("rkv:")
    with pytest.raises(UserError, match="no score column for cake"):
        single_label_auroc(labels_path, scores_path, rules + ["cake"], params)

    single = single_label_auroc(labels_path, scores_path, rules, params)  # n_boot 2000, as the replay's bootstrap
    replay(tiny_llama, tmp_path / "r", settings, trace=tiny_trace, auroc=single)
    corr = pl.read_csv(tmp_path / "r" / "correlations.csv").filter(pl.col("predictor") == "single-label AUROC")
    df = pl.read_parquet(tmp_path / "r" / "generations.parquet")
    kl = df.group_by("scorer").agg(pl.col("kl_mean").mean()).sort("scorer")
    x = np.array([single.auroc[r][0] for r in kl["scorer"]])
    assert corr.height == 1 and corr["n"][0] == 3
    assert corr["spearman"][0] == pytest.approx(spearmanr(x, -kl["kl_mean"].to_numpy())[0], abs=1e-12)
    assert "the replay's own, on the same bootstrap resamples" in (tmp_path / "r" / "decisions.md").read_text()
