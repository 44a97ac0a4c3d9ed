"""``kvdiag grade`` on a tiny benchmark built the way the shipped ones are: a Trace stored as tokens only, labels of
every entry, the references' joint damage; ``--all`` completes it with the built-in rules; a plugin then gets its
leaderboard row; a built-in regraded lands inside its stored row's CI; bad input is refused before any work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pytest

import kvdiag.cli.main
from kvdiag.core.io import read_table, write_table
from kvdiag.decisions import Budget, DecisionsConfig, decide
from kvdiag.grade import benchmark
from kvdiag.label import LabelConfig, label_trace
from kvdiag.scorers import SCORERS, checkpoint_keys, score_trace
from tests.conftest import exits_2, make_trace

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def bench(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    trace = make_trace(tiny_llama, root / "trace", n_prompts=2, max_new_tokens=40)
    labels = label_trace(trace, tiny_llama, root / "labels.parquet",
                         LabelConfig(checkpoints="every:16", horizon=4, candidates="all", w_obs=0), show_progress=False)
    lab = read_table(labels)[0]
    cps = {pid: sorted(g["checkpoint"].unique().to_list()) for (pid,), g in lab.group_by("prompt_id")}
    scores, meta = score_trace(trace, keys=checkpoint_keys(trace, cps, ["head"]), scorers=["random"])
    cfg = DecisionsConfig(budgets=(Budget("keep", 0.5), Budget("keep", 0.25)), horizon=4, pairs=0, n_boot=50,
                          greedy_chunk=0.25, infeasible="skip")
    decide(trace, tiny_llama, scores, meta, root / "decisions", cfg, *read_table(labels), show_progress=False)
    path = benchmark.make("tiny", 1, root / "trace", labels, root / "decisions", root=root / "shipped",
                          licence="random weights")
    return {"root": root, "dir": path.parent, "shipped": root / "shipped"}


def run(*argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        kvdiag.cli.main.main([str(a) for a in argv])
    return exit_.value.code, ""


@pytest.fixture(scope="module")
def graded_all(bench):
    out = bench["root"] / "all"
    before = dict(SCORERS)
    code, _ = run("grade", "--all", "--bench", bench["dir"], "--out", out, "--quiet")
    SCORERS.clear()
    SCORERS.update(before)
    assert code == 0
    return out


def test_the_benchmark_holds_tokens_only_and_seals_every_file(bench, graded_all):
    b = benchmark.load(str(bench["dir"]))
    assert json.loads((bench["dir"] / "trace" / "manifest.json").read_text())["store"]["mode"] == "none"
    assert not (bench["dir"] / "trace" / "tensors").exists()
    assert set(b.manifest["files"]) == {*benchmark.FILES, benchmark.BUILTINS}  # --all completed it
    assert b.manifest["settings"]["budgets"] == ["keep:0.5", "keep:0.25"]


def test_all_writes_the_leaderboard(graded_all):
    text = (graded_all / "leaderboard.md").read_text()
    for rule in ("attention", "h2o", "snapkv", "knorm", "random", "avokv_e"):
        assert f"| {rule} |" in text
    lb = pl.read_csv(graded_all / "leaderboard.csv")
    assert {"auroc", "auroc_ci_low", "joint@keep:0.5", "regret@keep:0.25", "ranks", "note"} <= set(lb.columns)
    assert lb.filter(pl.col("rule") == "attention")["ranks"].to_list() == [True]


def test_the_leaderboard_rewrites_from_the_scores_grade_wrote(bench, graded_all, tmp_path):
    """rewrite_leaderboard without a model: from the rules and params of the csv alone, the ranking half from the token
    scores grade --all wrote (OUT/scores.parquet) and the decisions half from the benchmark, the same files (one path:
    the same rank-eval on the same inputs, so equal as text); foreign scores are refused."""
    from kvdiag.core.errors import UserError
    from kvdiag.grade.run import rewrite_leaderboard

    lb = tmp_path / "leaderboard.md"
    pl.read_csv(graded_all / "leaderboard.csv", infer_schema_length=None).select("rule", "params").write_csv(
        lb.with_suffix(".csv"))
    rewrite_leaderboard(str(bench["dir"]), lb, graded_all / "scores.parquet")
    assert lb.read_text() == (graded_all / "leaderboard.md").read_text()
    # grade's rows also name their benchmark, and the first --all had no builtins.parquet to test against (no vs_best
    # columns): every column it wrote is the rewrite's
    graded = pl.read_csv(graded_all / "leaderboard.csv", infer_schema_length=None).drop("bench")
    assert pl.read_csv(lb.with_suffix(".csv"), infer_schema_length=None).select(graded.columns).equals(graded)
    token, meta = read_table(graded_all / "scores.parquet")
    write_table(token, tmp_path / "foreign.parquet", {**meta, "trace": {"fingerprint": "0123456789abcdef"}})
    with pytest.raises(UserError, match="scored another Trace"):
        rewrite_leaderboard(str(bench["dir"]), lb, tmp_path / "foreign.parquet")
    write_table(token.drop("knorm"), tmp_path / "fewer.parquet", meta)
    with pytest.raises(UserError, match="lacks the leaderboard's rule"):
        rewrite_leaderboard(str(bench["dir"]), lb, tmp_path / "fewer.parquet")


def test_undefined_rows_are_apart_and_all_ties_rank_nothing():
    """A rule undefined at the tightest budget is no place there (not the worst); a rule whose scores all tie on
    the labeled entries of every checkpoint is marked as not ranking."""
    from kvdiag.grade.run import leaderboard_order, leaderboard_table, ranking_rules

    def row(rule, a, b, decided_b="2/2"):
        return {"rule": rule, "joint@k1": a, "decided@k1": "2/2", "joint@k2": b, "decided@k2": decided_b}

    rows = [row("bad", 1.0, 9.0), row("good", 0.1, 0.5), row("undefined", 0.01, float("nan"), "0/2"),
            row("partly", 0.02, 0.2, "1/2")]
    ranked, rest = leaderboard_order(rows, ["k1", "k2"])
    assert [r["rule"] for r in ranked] == ["good", "bad"] and [r["rule"] for r in rest] == ["undefined", "partly"]
    keys = {"prompt_id": ["p"] * 4, "checkpoint": [8] * 4, "position": [0, 1, 2, 3], "granularity": ["token"] * 4,
            "layer": [-1] * 4, "kv_head": [-1] * 4}
    token = pl.DataFrame({**keys, "flat": [1.0, 1.0, 1.0, 0.0], "ranked": [0.1, 0.2, 0.3, 0.4]})
    labels = pl.DataFrame(keys).head(3)  # position 3 is not labeled: flat's only distinct score does not count
    assert ranking_rules(token, labels, ["flat", "ranked"]) == {"flat": False, "ranked": True}
    _, cells = leaderboard_table([{**row("flat", 0.1, 0.2), "ranks": False}], ["k1", "k2"])
    assert cells[0][0] == "flat (all ties: ranks nothing)"


def test_a_plugin_gets_its_row_with_place_and_paired_test(bench, graded_all, tmp_path, capsys):
    plugin = tmp_path / "my_rule.py"
    block = re.search(r"```python\n(# my_scorer.py.*?)```", README.read_text(), re.DOTALL).group(1)
    plugin.write_text(block)
    before = dict(SCORERS)
    try:
        code, _ = run("grade", plugin, "--bench", bench["dir"], "--out", tmp_path / "g", "--quiet")
    finally:
        SCORERS.clear()
        SCORERS.update(before)
    out = capsys.readouterr().out
    assert code == 0 and "value_key_ratio" in out and "place" in out and "vs best" in out
    rows = json.loads((tmp_path / "g" / "rows.json").read_text())["rows"]
    assert rows[0]["rule"] == "value_key_ratio" and 0 <= rows[0]["auroc"] <= 1


def test_regrading_a_builtin_reproduces_its_leaderboard_row(bench, graded_all, tmp_path):
    """Same benchmark, same rule: the row lands inside the stored row's CIs (here: equal, the same computation)."""
    code, _ = run("grade", "knorm", "--bench", bench["dir"], "--out", tmp_path / "k", "--quiet")
    assert code == 0
    mine = json.loads((tmp_path / "k" / "rows.json").read_text())["rows"][0]
    stored = next(r for r in json.loads((graded_all / "rows.json").read_text())["rows"] if r["rule"] == "knorm")
    for key in ("auroc", "joint@keep:0.5", "joint@keep:0.25"):
        low, high = stored[f"{key}_ci"]
        assert low - 1e-12 <= mine[key] <= high + 1e-12, key
        assert mine[key] == pytest.approx(stored[key], rel=1e-6, abs=1e-9)



def test_bad_input_is_refused_before_work(bench, tmp_path, capsys):
    base = ["grade", "--bench", bench["dir"], "--out", tmp_path / "o"]
    assert "unknown benchmark" in exits_2(capsys, "grade", "knorm", "--bench", "nope@1", "--out", tmp_path / "o")
    assert "registers no rule" in exits_2(capsys, *base, __file__)
    two = tmp_path / "two.py"
    two.write_text(
        "from dataclasses import dataclass\nfrom kvdiag.scorers import Scorer, register_scorer\n"
        "@register_scorer('two_a')\n@dataclass\nclass A(Scorer):\n"
        "    def score(self, ctx):\n        return ctx.k.norm(dim=-1)\n"
        "@register_scorer('two_b')\n@dataclass\nclass B(A):\n    pass\n")
    before = dict(SCORERS)
    try:
        assert "several rules" in exits_2(capsys, *base, two)
    finally:
        SCORERS.clear()
        SCORERS.update(before)
    assert "has no parameter 'nope'" in exits_2(capsys, *base, "knorm", "--param", "knorm.nope=1")
    assert not (tmp_path / "o").exists()
    # a changed file, a foreign model
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(bench["dir"], copy)
    lab = read_table(copy / "labels.parquet")
    write_table(lab[0].head(10), copy / "labels.parquet", lab[1])
    assert "does not match its sha256" in exits_2(capsys, "grade", "knorm", "--bench", copy, "--out", tmp_path / "o")
    shutil.rmtree(copy)
    shutil.copytree(bench["dir"], copy)
    manifest = json.loads((copy / "MANIFEST.json").read_text())
    manifest["model"]["weights_hash"] = "0000000000000000"
    (copy / "MANIFEST.json").write_text(json.dumps(manifest))
    assert "was made with weights 0000000000000000" in exits_2(capsys, "grade", "knorm", "--bench", copy, "--out",
                                                               tmp_path / "o")


LEADERBOARD = README.parent / "reports" / "leaderboard.csv"


@pytest.mark.slow
def test_regrading_a_builtin_on_the_shipped_benchmark_reproduces_the_committed_row(tmp_path):
    """The shipped math500-smollm2@1 and the committed leaderboard: a built-in rule graded again on this machine
    lands inside the committed row's CIs and within 1e-3 relative of its values (another CPU may differ in the last
    bits of the model's forward, hence not bitwise)."""
    committed = pl.read_csv(LEADERBOARD).filter(pl.col("rule") == "knorm").row(0, named=True)
    code, _ = run("grade", "knorm", "--bench", "math500-smollm2@1", "--out", tmp_path / "k", "--quiet")
    assert code == 0
    mine = json.loads((tmp_path / "k" / "rows.json").read_text())["rows"][0]
    keys = ["auroc", *(k for k in mine if k.startswith("joint@") and not k.endswith("_ci"))]
    assert len(keys) == 4, keys  # AUROC and the joint damage at the benchmark's three budgets
    for key in keys:
        low, high = committed[f"{key}_ci_low"], committed[f"{key}_ci_high"]
        assert low <= mine[key] <= high, (key, mine[key], low, high)
        assert mine[key] == pytest.approx(committed[key], rel=1e-3), key


def test_grade_at_a_shorter_horizon_cuts_the_sealed_labels(bench, tmp_path, capsys):
    """--horizon 2 on a benchmark labeled at 4: the single labels are the sealed rows' first 2 steps (the same floats,
    averaged: equal within 1e-12 relative), the sets are labeled over 2 steps, and no regret, place or paired test
    against the sealed horizon-4 rows is claimed."""
    import numpy as np

    code, _ = run("grade", "knorm", "--bench", bench["dir"], "--out", tmp_path / "h2", "--horizon", "2", "--quiet")
    out = capsys.readouterr().out
    assert code == 0 and "graded at horizon 2" in out and "regret vs oracle_greedy" not in out
    row = json.loads((tmp_path / "h2" / "rows.json").read_text())["rows"][0]
    assert row["horizon"] == "2" and not any(k.startswith(("regret", "place", "vs_best")) for k in row)
    sealed = read_table(bench["dir"] / "labels.parquet")[0].sort("prompt_id", "checkpoint", "position")
    cut = read_table(tmp_path / "h2" / "labels.parquet")[0].sort("prompt_id", "checkpoint", "position")
    assert cut.height == sealed.height and (cut["horizon"] == 2).all()
    want = np.array([np.mean(s[:2]) for s in sealed["kl_steps"].to_list()])
    np.testing.assert_allclose(cut["kl_mean"].to_numpy(), want, rtol=1e-12, atol=0)
    dec = read_table(tmp_path / "h2" / "decisions" / "decisions.parquet")[0]
    assert set(dec["horizon"].unique().to_list()) == {2}


def test_grade_at_rest_labels_past_the_sealed_horizon(bench, tmp_path, capsys):
    """--horizon rest where the traces run past the sealed horizon of 4: every entry is labeled exactly to the end of
    its prompt (horizon T - t per row), and its first 4 steps agree with the sealed labels up to float rounding: the
    prefix cache is built through other forward shapes (one run to the end, not to t + 4), so they differ by rounding
    of the size of the tiny model's fp32 noise floor (~5e-8 nats per step): within 5e-6 nats (~100 floors) or 1e-3
    relative per step, and Spearman >= 0.999 between the 4-step labels."""
    import numpy as np
    from scipy.stats import spearmanr

    from kvdiag.trace.manifest import TraceFiles

    code, _ = run("grade", "knorm", "--bench", bench["dir"], "--out", tmp_path / "rest", "--horizon", "rest",
                  "--quiet")
    assert code == 0
    tf = TraceFiles(bench["dir"] / "trace")
    rest = read_table(tmp_path / "rest" / "labels.parquet")[0].sort("prompt_id", "checkpoint", "position")
    sealed = read_table(bench["dir"] / "labels.parquet")[0].sort("prompt_id", "checkpoint", "position")
    assert rest.select("prompt_id", "checkpoint", "position").equals(sealed.select("prompt_id", "checkpoint",
                                                                                   "position"))
    ends = [tf.length(p) - t for p, t in rest.select("prompt_id", "checkpoint").iter_rows()]
    assert rest["horizon"].to_list() == ends and max(ends) > 4
    first = np.array([s[:4] for s in rest["kl_steps"].to_list()])
    np.testing.assert_allclose(first, np.array(sealed["kl_steps"].to_list()), rtol=1e-3, atol=5e-6)
    assert spearmanr(first.mean(1), sealed["kl_mean"].to_numpy()).statistic >= 0.999
    assert json.loads((tmp_path / "rest" / "rows.json").read_text())["rows"][0]["horizon"] == "rest"


def test_grade_refuses_a_horizon_past_the_benchmark_traces(bench, tmp_path, capsys):
    from kvdiag.trace.manifest import TraceFiles

    tf = TraceFiles(bench["dir"] / "trace")
    labels = read_table(bench["dir"] / "labels.parquet")[0]
    room = min(tf.length(p) - t for p, t in labels.select("prompt_id", "checkpoint").unique().iter_rows())
    err = exits_2(capsys, "grade", "knorm", "--bench", bench["dir"], "--out", tmp_path / "o", "--horizon",
                  room + 1)
    assert f"--horizon <= {room}" in err and not (tmp_path / "o").exists()
