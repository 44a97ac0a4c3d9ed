"""``kvdiag decisions`` on a tiny random Trace: every set row equals physically deleting its set, the rules' sets are
replay's selection, the references are what they say, bad input is refused before work, a rerun continues."""

from __future__ import annotations

import polars as pl
import pytest
import torch
from scipy.stats import binomtest

import kvdiag.cli.main
import kvdiag.core.selection
import kvdiag.generate.live
from kvdiag.core.io import read_table, write_table
from kvdiag.decisions import Budget, DecisionsConfig, decide, summarize_files
from kvdiag.decisions.sets import rule_set
from kvdiag.label import LabelConfig, OracleEngine, divergences, label_trace
from kvdiag.label.reference import reference_set_logprobs
from kvdiag.scorers import checkpoint_keys, get_scorer, score_trace
from tests.conftest import exits_2, make_trace

HORIZON = 4
RULES = ["attention", "h2o", "rkv", "streamingllm", "random"]


@pytest.fixture(scope="module")
def run(tiny_llama, tmp_path_factory):
    """A 2-prompt Trace, exact labels of every entry at its checkpoints, head scores of every entry there."""
    root = tmp_path_factory.mktemp("decisions")
    trace = make_trace(tiny_llama, root / "trace", n_prompts=2, max_new_tokens=40)
    labels_path = label_trace(trace, tiny_llama, root / "labels.parquet",
                              LabelConfig(checkpoints="every:16", horizon=HORIZON, candidates="all", w_obs=0),
                              show_progress=False)
    labels, labels_meta = read_table(labels_path)
    cps = {pid: sorted(g["checkpoint"].unique().to_list()) for (pid,), g in labels.group_by("prompt_id")}
    keys = checkpoint_keys(trace, cps, ["head"])
    scores, scores_meta = score_trace(trace, keys=keys, scorers=RULES, params={"rkv": {"window": 4}})
    scores_path = write_table(scores, root / "scores.parquet", scores_meta)
    return {"root": root, "trace": trace, "labels": labels, "labels_meta": labels_meta, "labels_path": labels_path,
            "scores": scores, "scores_meta": scores_meta, "scores_path": scores_path, "lm": tiny_llama}


def config(**kw) -> DecisionsConfig:
    base = dict(budgets=(Budget("keep", 0.5), Budget("keep", 0.25)), horizon=HORIZON, n_boot=50, pair_candidates=4,
                batch_size=5, greedy_chunk=0.25)
    return DecisionsConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def decided(run):
    out = run["root"] / "out"
    decide(run["trace"], run["lm"], run["scores"], run["scores_meta"], out, config(selection="per-token"),
           run["labels"], run["labels_meta"], show_progress=False)
    summarize_files(out, labels=run["labels_path"], scores=run["scores_path"])
    return out, read_table(out / "decisions.parquet")[0]


def test_replay_and_decisions_share_one_selection_function():
    assert kvdiag.generate.live.select_keep is kvdiag.core.selection.select_keep


def test_every_decision_is_labeled_and_equals_physical_deletion(run, decided):
    out, df = decided
    names = set(df["decision"])
    assert names == set(RULES) | {"oracle_single", "oracle_greedy", "fast", "random_reference"}
    assert df.filter(pl.col("status") == "ok")["kl_mean"].is_not_null().all()
    trace, lm = run["trace"], run["lm"]
    pid = trace.prompt_ids[0]
    sample = df.filter((pl.col("prompt_id") == pid) & (pl.col("status") == "ok")).sort("checkpoint", "decision").head(6)
    eng = OracleEngine(lm, trace.token_ids(pid), HORIZON)
    for row in sample.iter_rows(named=True):
        t = row["checkpoint"]
        prefix, logp_full = eng.golden(t)
        evict = torch.tensor(row["evicted_positions"])
        assert len(evict) == row["evicted"] == t - row["kept"]
        ref = reference_set_logprobs(lm.model, eng.ids, t, HORIZON, prefix, evict)
        want = divergences(logp_full, ref[None], eng.ids[t + 1 : t + HORIZON + 1])
        assert row["kl_mean"] == pytest.approx(float(want["kl"][0].double().mean()), rel=1e-4, abs=1e-6), row
        assert row["sum_single"] == pytest.approx(
            run["labels"].filter((pl.col("prompt_id") == pid) & (pl.col("checkpoint") == t)
                                 & pl.col("position").is_in(row["evicted_positions"]))["kl_mean"].sum(), rel=1e-12)


def test_rule_sets_are_replays_selection_of_the_rules_scores(run, decided):
    """A rule's set is the complement of replay's keep set (select_keep over its live scores) on the same cache: the
    head rows are percentile ranks of the scores, which keep their order and ties."""
    _, df = decided
    trace = run["trace"]
    pid = trace.prompt_ids[1]
    t = df.filter(pl.col("prompt_id") == pid)["checkpoint"].max()
    row = df.filter((pl.col("prompt_id") == pid) & (pl.col("checkpoint") == t) & (pl.col("decision") == "attention")
                    & (pl.col("budget") == "keep:0.25")).row(0, named=True)
    rule = get_scorer("attention")
    from kvdiag.scorers import ScoreContext

    live = []
    for layer in range(trace.num_layers):
        qkv = trace.layer(pid, layer)
        ctx = ScoreContext(qkv.q[:, :t], qkv.k[:, :t], qkv.v[:, :t], trace.layer_attention(layer),
                           trace.prompt_len(pid), layer, pid)
        live.append(rule.scores(ctx))
    keep = kvdiag.core.selection.select_keep(live, row["kept"], "per-token")[0, 0]
    assert sorted(set(range(t)) - set(keep.tolist())) == row["evicted_positions"]


def test_references_are_what_they_say(run, decided):
    _, df = decided
    labels = run["labels"]
    for row in df.filter(pl.col("decision") == "oracle_single").iter_rows(named=True):
        kl = labels.filter((pl.col("prompt_id") == row["prompt_id"]) & (pl.col("checkpoint") == row["checkpoint"]))
        kl = kl.sort("position")["kl_mean"].to_numpy()
        kept = sorted(set(range(row["checkpoint"])) - set(row["evicted_positions"]))
        assert min(kl[kept]) >= max(kl[row["evicted_positions"]])  # it keeps the largest single labels
    greedy = df.filter(pl.col("decision") == "oracle_greedy")
    assert (greedy["cost_rows"] > 0).all()
    # one greedy path serves every budget: the tighter budget's set contains the looser one's
    for (_, _), g in greedy.group_by("prompt_id", "checkpoint"):
        sets = {r["budget"]: set(r["evicted_positions"]) for r in g.iter_rows(named=True)}
        assert sets["keep:0.5"] <= sets["keep:0.25"]
    rand = df.filter(pl.col("decision") == "random_reference")
    assert (rand["kind"] == "reference").all() and (df.filter(pl.col("decision") == "random")["kind"] == "rule").all()
    assert rand["evicted_positions"].list.len().to_list() == rand["evicted"].to_list()


def test_summary_has_cis_regret_additivity_and_the_figure(decided):
    out, _ = decided
    summary = pl.read_csv(out / "summary.csv")
    assert set(summary["budget"]) == {"keep:0.5", "keep:0.25"}
    assert (summary.filter(pl.col("n") > 0)["ci_low"] <= summary.filter(pl.col("n") > 0)["mean_kl"] + 1e-12).all()
    paired = pl.read_csv(out / "paired.csv")
    assert {"reference", "regret"} <= set(paired["what"])
    text = (out / "summary.md").read_text()
    assert "Best rule" in text and "oracle_greedy" in text and (out / "decisions.png").is_file()
    assert (out / "pairs.parquet").is_file()


def test_spearman_regenerates_from_the_shipped_token_inputs(run, decided, tmp_path):
    """The run writes what the AUROC-vs-decision Spearman reads (token scores: the mean of the head rows over layers
    and KV heads; the token labels they match) into inputs/; a copy of decisions.parquet with inputs/ alone, no labels
    or scores, gives the same spearman.csv (the same float64 rows through the same code: compared exactly)."""
    import shutil

    from kvdiag.decisions.summary import INPUTS

    out, _ = decided
    want = pl.read_csv(out / "spearman.csv")
    assert want.height == 2 and want["spearman"].is_finite().all() and (want["rules"] == len(RULES)).all()
    tokens = pl.read_parquet(out / INPUTS["token_scores"])
    head = run["scores"].filter(pl.col("granularity") == "head")
    assert tokens.height == head.select("prompt_id", "checkpoint", "position").n_unique()
    one = tokens.row(0, named=True)
    cell = head.filter((pl.col("prompt_id") == one["prompt_id"]) & (pl.col("checkpoint") == one["checkpoint"])
                       & (pl.col("position") == one["position"]))
    assert one["h2o"] == pytest.approx(cell["h2o"].mean(), rel=1e-6)  # float32 scores: their mean, as rank-eval's
    labels = pl.read_parquet(out / INPUTS["token_labels"])
    assert labels.columns == ["prompt_id", "checkpoint", "position", "granularity", "layer", "kv_head", "kl_mean",
                              "noise_floor"] and labels.height == tokens.height
    copy = tmp_path / "report"
    (copy / "inputs").mkdir(parents=True)
    for f in ("decisions.parquet", "pairs.parquet", *INPUTS.values()):
        shutil.copy(out / f, copy / f)
    summarize_files(copy)
    assert pl.read_csv(copy / "spearman.csv").equals(want)
    (copy / INPUTS["token_labels"]).unlink()  # without them: no Spearman, not a wrong one
    summarize_files(copy)
    assert not (copy / "spearman.csv").read_text().strip()


def test_per_head_sets_differ_per_head_and_are_exact(run):
    trace, lm = run["trace"], run["lm"]
    pid = trace.prompt_ids[0]
    scores = run["scores"].filter((pl.col("prompt_id") == pid) & (pl.col("granularity") == "head"))
    t = scores["checkpoint"].min()
    s = scores.filter(pl.col("checkpoint") == t).sort("layer", "kv_head", "position")
    values = torch.tensor(s["attention"].to_numpy()).view(trace.num_layers, trace.num_kv_heads, t)
    evict = rule_set(values, t // 2, "per-head")
    assert evict.shape == (trace.num_layers, trace.num_kv_heads, t - t // 2)
    assert not all(torch.equal(evict[0, 0], evict[l, h]) for l in range(trace.num_layers)
                   for h in range(trace.num_kv_heads))
    eng = OracleEngine(lm, trace.token_ids(pid), HORIZON)
    got, _ = eng.label_sets(t, [evict])
    prefix, logp_full = eng.golden(t)
    ref = reference_set_logprobs(lm.model, eng.ids, t, HORIZON, prefix, evict)
    want = divergences(logp_full, ref[None], eng.ids[t + 1 : t + HORIZON + 1])
    torch.testing.assert_close(got["kl"][0], want["kl"][0], rtol=1e-4, atol=1e-6)


def test_a_rerun_continues_from_its_parts(run, decided, monkeypatch):
    out, df = decided
    import kvdiag.decisions.run as run_mod

    monkeypatch.setattr(run_mod, "_decide_checkpoint", lambda *a, **k: pytest.fail("recomputed a finished checkpoint"))
    decide(run["trace"], run["lm"], run["scores"], run["scores_meta"], out, config(selection="per-token"),
           run["labels"], run["labels_meta"], show_progress=False)
    assert read_table(out / "decisions.parquet")[0].equals(df)



def test_a_rerun_given_other_scores_or_labels_is_refused_not_mixed(run, decided):
    """A scores (or labels) table remade with other contents is refused on a rerun into the same --out: its parts
    were made from the old contents. The run's config.json names what it was made from."""
    from kvdiag.core.errors import UserError
    from kvdiag.core.io import read_json, table_sha256

    out, _ = decided
    made = read_json(out / "config.json")["inputs"]
    assert made["scores_sha256"] == table_sha256(run["scores"])
    assert made["labels_sha256"] == table_sha256(run["labels"].filter(pl.col("granularity") == "token"))
    moved = run["scores"].with_columns(pl.when(pl.int_range(pl.len()) == 0).then(pl.col("h2o") + 1e-3)
                                       .otherwise(pl.col("h2o")).alias("h2o"))
    assert table_sha256(moved) != made["scores_sha256"]
    with pytest.raises(UserError, match="other settings"):
        decide(run["trace"], run["lm"], moved, run["scores_meta"], out, config(selection="per-token"),
               run["labels"], run["labels_meta"], show_progress=False)
    relabeled = run["labels"].with_columns(pl.col("kl_mean") * 2)
    with pytest.raises(UserError, match="other settings"):
        decide(run["trace"], run["lm"], run["scores"], run["scores_meta"], out, config(selection="per-token"),
               relabeled, run["labels_meta"], show_progress=False)


def test_the_command_refuses_other_inputs_into_its_parts_before_the_model_loads(run, tmp_path, monkeypatch, capsys):
    """kvdiag decisions into an --out whose parts were made from another scores file (or other settings) is refused
    with one line before the model loads."""
    from kvdiag.core.io import write_table

    base = ["decisions", "--trace", str(run["trace"].path), "--labels", str(run["labels_path"]), "--keep", "0.5",
            "--horizon", str(HORIZON), "--references", "oracle_single,random", "--pairs", "0", "--out",
            str(tmp_path / "o")]
    with pytest.raises(SystemExit) as done:
        kvdiag.cli.main.main([*base, "--scores", str(run["scores_path"])])
    assert done.value.code == 0 and (tmp_path / "o" / "parts" / "config.json").is_file()
    moved = run["scores"].with_columns(pl.col("h2o") * 2)
    write_table(moved, tmp_path / "moved.parquet", run["scores_meta"])

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr("kvdiag.model.load.load_model", no_load)
    capsys.readouterr()
    for extra in (["--scores", str(tmp_path / "moved.parquet")], ["--scores", str(run["scores_path"]), "--seed", "1"]):
        assert "holds parts made with other settings" in exits_2(capsys, *base, *extra)


def test_bad_input_is_refused_before_work(run, capsys, tmp_path):
    base = ["decisions", "--trace", run["trace"].path, "--scores", run["scores_path"], "--out", tmp_path / "o",
            "--horizon", HORIZON]
    assert "--keep 1.5" in exits_2(capsys, *base, "--keep", "1.5")
    assert "--draws applies to --selection stochastic" in exits_2(capsys, *base, "--keep", "0.5", "--samples", "3")
    assert "--budget 0" in exits_2(capsys, *base, "--budget", "0")
    assert "not both" in exits_2(capsys, *base, "--keep", "0.5", "--budget", "4")
    assert "oracle_single needs exact labels" in exits_2(capsys, *base, "--keep", "0.5", "--references",
                                                          "oracle_single")
    # rkv protects its window of 4; keeping 1 entry per head cannot
    assert "rkv always keeps 4 entries" in exits_2(capsys, *base, "--budget", "1")
    other = run["scores"].head(10)
    foreign = write_table(other, tmp_path / "foreign.parquet",
                          {**run["scores_meta"], "trace": {"fingerprint": "0123456789abcdef"}})
    assert "another Trace" in exits_2(capsys, *base[:3], "--scores", foreign, *base[5:], "--keep", "0.5")
    heads = run["scores"].filter((pl.col("layer") == 0) & (pl.col("kv_head") == 0))  # one row per (checkpoint, entry)
    token_only = write_table(heads.with_columns(granularity=pl.lit("token"), layer=-1, kv_head=-1),
                             tmp_path / "t.parquet", run["scores_meta"])
    assert not (tmp_path / "o").exists()
    assert "no head rows" in exits_2(capsys, *base[:3], "--scores", token_only, *base[5:], "--keep", "0.5")
    labels = ["--labels", run["labels_path"]]
    err = exits_2(capsys, *base[:-1], "8", *labels, "--keep", "0.5")
    assert "--horizon 8 differs from the labels' horizon 4" in err
    err = exits_2(capsys, *base[:-1], "6", "--read-window", "3", *labels, "--keep", "0.5")
    assert "--read-window 3 differs from the labels' horizon 4" in err


def test_oracle_single_and_greedy_read_the_labels_window_and_are_judged_past_it(run, tmp_path):
    """--read-window 4 (the labels' horizon) of a judged window of 6: oracle_single ranks by the 4-step labels,
    oracle_greedy searches the 4 steps, both are judged on 6; the 2 steps they did not read equal physical deletion
    (rtol 1e-4, atol 1e-6 nats, fp32, two attention paths); the additivity ratio compares the sum of singles with
    the joint damage over the labels' 4 steps."""
    from kvdiag.decisions.summary import windows

    judged = HORIZON + 2
    out = tmp_path / "read"
    decide(run["trace"], run["lm"], run["scores"], run["scores_meta"], out,
           config(selection="per-token", horizon=judged, read_window=HORIZON, pairs=0),
           run["labels"], run["labels_meta"], show_progress=False)
    df = read_table(out / "decisions.parquet")[0].filter(pl.col("status") == "ok")
    trace, lm = run["trace"], run["lm"]
    refs = df.filter(pl.col("decision").is_in(["oracle_single", "oracle_greedy"]))
    assert refs.height and set(refs["read_steps"]) == {HORIZON} and set(refs["kl_steps"].list.len()) == {judged}
    for pid in trace.prompt_ids:
        eng = OracleEngine(run["lm"], trace.token_ids(pid), judged)
        for row in refs.filter(pl.col("prompt_id") == pid).iter_rows(named=True):
            t = row["checkpoint"]
            prefix, logp_full = eng.golden(t)
            ref = reference_set_logprobs(lm.model, eng.ids, t, judged, prefix, torch.tensor(row["evicted_positions"]))
            want = divergences(logp_full, ref[None], eng.ids[t + 1 : t + judged + 1])["kl"][0].double()
            torch.testing.assert_close(torch.tensor(row["kl_steps"][HORIZON:], dtype=torch.float64), want[HORIZON:],
                                       rtol=1e-4, atol=1e-6)
            single = run["labels"].filter((pl.col("prompt_id") == pid) & (pl.col("checkpoint") == t))
            if row["decision"] == "oracle_single":  # the set is the largest 4-step single labels' complement
                kept = single.sort("kl_mean", descending=True).head(row["kept"])["position"].sort().to_list()
                assert sorted(set(range(t)) - set(row["evicted_positions"])) == kept
    split = windows(df, HORIZON)
    assert split["kl_single_window"].to_list() == pytest.approx(split["kl_steps"].list.head(HORIZON).list.mean()
                                                                .to_list(), rel=1e-12)


def test_infeasible_skip_records_undefined_decisions_and_big_budgets_evict_nothing(run, tmp_path):
    out = tmp_path / "skip"
    with pytest.warns(UserWarning, match="keeps every entry"):
        decide(run["trace"], run["lm"], run["scores"], run["scores_meta"], out,
               config(budgets=(Budget("budget", 1), Budget("budget", 10_000)), references=("random",), pairs=0,
                      infeasible="skip"), show_progress=False)
    df = read_table(out / "decisions.parquet")[0]
    over = df.filter(pl.col("status") == "over_budget")
    assert set(over["decision"]) == {"rkv", "streamingllm"} and over["kl_mean"].is_null().all()
    none = df.filter(pl.col("budget") == "budget:10000")
    assert (none["status"] == "nothing_evicted").all() and (none["evicted"] == 0).all()
    assert (none["kl_mean"] <= 1e-6).all()


def test_stochastic_selection_draws_seeded_sets_beside_the_deterministic_ones(run, tmp_path):
    """stochastic:TAU: each (rule, budget, checkpoint) gets its deterministic per-head set and S seeded draws (never
    a protected entry); the summary compares them. A rule with no continuous score is refused before work."""
    rules = ("attention", "rkv")
    cfg = config(selection="stochastic:0.2", samples=3, references=("random",), pairs=0, rules=rules)
    out = tmp_path / "sto"
    decide(run["trace"], run["lm"], run["scores"], run["scores_meta"], out, cfg, show_progress=False)
    summarize_files(out)
    df = read_table(out / "decisions.parquet")[0].filter(pl.col("kind") == "rule")
    one = df.filter((pl.col("decision") == "rkv") & (pl.col("budget") == "keep:0.25"))
    per_ck = one.group_by("prompt_id", "checkpoint").agg(pl.col("sample").sort().alias("s"), pl.len())
    assert (per_ck["len"] == 4).all() and per_ck["s"].to_list()[0] == [None, 0, 1, 2]
    draws = one.filter(pl.col("sample").is_not_null())
    assert draws["selection"].unique().to_list() == ["stochastic:0.2"] and draws["draw_seed"].n_unique() == draws.height
    assert one.filter(pl.col("sample").is_null())["selection"].unique().to_list() == ["per-head"]
    for row in draws.iter_rows(named=True):  # rkv's window of 4 is never drawn
        t = row["checkpoint"]
        assert all(n == 0 for n in row["evicted_heads"][t - 4:]), row
    sets = {tuple(r["evicted_heads"]) for r in draws.filter(pl.col("checkpoint") == draws["checkpoint"].max()
                                                             ).iter_rows(named=True)}
    assert len(sets) > 1  # the draws differ
    # a rerun draws the same sets (the seeds are in the rows)
    decide(run["trace"], run["lm"], run["scores"], run["scores_meta"], tmp_path / "sto2", cfg, show_progress=False)
    again = read_table(tmp_path / "sto2" / "decisions.parquet")[0].filter(pl.col("kind") == "rule")
    assert again["evicted_heads"].to_list() == df["evicted_heads"].to_list()
    sto = pl.read_csv(out / "stochastic.csv")
    assert set(sto["decision"]) == set(rules) and "Stochastic against deterministic" in (out / "summary.md").read_text()
    # the test is the exact sign test over the prompts' (draws' mean - deterministic) differences, counted by hand
    mean = draws.group_by("prompt_id", "checkpoint").agg(pl.col("kl_mean").mean().alias("m"))
    det = one.filter(pl.col("sample").is_null()).select("prompt_id", "checkpoint", d="kl_mean")
    diff = mean.join(det, on=["prompt_id", "checkpoint"]).group_by("prompt_id").agg((pl.col("m") - pl.col("d")).mean())
    lower, higher = int((diff["m"] < 0).sum()), int((diff["m"] > 0).sum())
    row = sto.filter((pl.col("decision") == "rkv") & (pl.col("budget") == "keep:0.25")).row(0, named=True)
    assert row["test"] == "sign" and (row["stochastic_lower"], row["stochastic_higher"]) == (lower, higher)
    assert row["p_value"] == pytest.approx(binomtest(higher, lower + higher).pvalue if lower + higher else 1.0)
    with pytest.raises(Exception, match="streamingllm has no continuous score"):
        decide(run["trace"], run["lm"], run["scores"], run["scores_meta"], tmp_path / "x",
               config(selection="stochastic", rules=("streamingllm",), references=("random",), pairs=0),
               show_progress=False)
    assert not (tmp_path / "x").exists()


def test_bench_label_sets_agrees_with_physical_deletion(tmp_path):
    """`kvdiag bench label --sets`: single, token-set and per-head-set batches timed together; every batched set
    label it checks equals the physical-deletion reference within 1e-5 nats (float32, the same tolerance as
    the conformance tests' absolute part at these label sizes)."""
    import json

    from typer.testing import CliRunner

    from kvdiag.cli.main import app

    out = tmp_path / "sets.json"
    res = CliRunner().invoke(app, ["bench", "label", "--model", "tiny:llama", "--sets", "--keep", "0.25", "--prefix",
                                   "32", "--n", "3", "--horizon", "3", "--repeats", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert got["evicted"] == 32 - 8 and [r["evicted"] for r in got["rows"]] == [1, 24, 24]
    assert all(r["max_abs_diff"] <= 1e-5 for r in got["rows"]), got["rows"]
    assert got["physical_over_batched"] > 0 and "batched speed-up" in res.output


def test_summary_keeps_a_rule_and_a_reference_of_one_name_apart_and_states_the_headline(decided):
    """The zoo's `random` rule and the `random` reference: two rows of the summary, each over the checkpoints once;
    the headline's greedy-vs-single difference is the plain mean of the paired differences."""
    import json

    out, df = decided
    summary = pl.read_csv(out / "summary.csv")
    n_cp = df.select("prompt_id", "checkpoint").n_unique()
    for name, kind in (("random", "rule"), ("random_reference", "reference")):
        rows = summary.filter((pl.col("decision") == name) & (pl.col("budget") == "keep:0.5"))
        assert rows.height == 1 and rows["kind"][0] == kind and rows["n_total"][0] == n_cp, (name, rows)
    rule = df.filter((pl.col("decision") == "random") & (pl.col("kind") == "rule") & (pl.col("budget") == "keep:0.5"))
    assert summary.filter((pl.col("decision") == "random") & (pl.col("budget") == "keep:0.5"))["mean_kl"][0] == \
        pytest.approx(rule["kl_mean"].mean(), rel=1e-12)
    head = json.loads((out / "summary.json").read_text())["headline"]["budgets"]["keep:0.25"]
    assert head["best_oracle"] in ("oracle_single", "oracle_greedy", "fast")
    g = df.filter(pl.col("budget") == "keep:0.25")
    pair = (g.filter(pl.col("decision") == "oracle_greedy").select("prompt_id", "checkpoint", a="kl_mean")
            .join(g.filter(pl.col("decision") == "oracle_single").select("prompt_id", "checkpoint", b="kl_mean"),
                  on=["prompt_id", "checkpoint"]))
    assert head["greedy_vs_single"]["diff"] == pytest.approx((pair["a"] - pair["b"]).mean(), rel=1e-9, abs=1e-15)
    assert head["greedy_vs_single"]["n"] == pair.height
    assert "## Headline" in (out / "summary.md").read_text()


def test_cli_stochastic_selection_takes_its_draw_count(run, tmp_path):
    out = tmp_path / "sto"
    with pytest.raises(SystemExit) as exit_:
        kvdiag.cli.main.main(["decisions", "--trace", str(run["trace"].path), "--scores", str(run["scores_path"]),
                              "--out", str(out), "--horizon", str(HORIZON), "--keep", "0.5", "--selection",
                              "stochastic:0.2", "--samples", "2", "--scorers", "attention", "--references", "random",
                              "--pairs", "0", "--bootstrap", "20", "--quiet"])
    assert exit_.value.code == 0
    df = read_table(out / "decisions.parquet")[0]
    draws = df.filter(pl.col("sample").is_not_null())
    assert sorted(draws["sample"].unique().to_list()) == [0, 1]
    assert draws.height == 2 * df.filter((pl.col("decision") == "attention") & pl.col("sample").is_null()).height


def test_viewer_shows_the_random_rule_and_the_random_reference_apart(run, decided):
    from kvdiag.report.viewer import viewer_data

    _, df = decided
    trace = run["trace"]
    lens = {pid: trace.prompt_len(pid) for pid in trace.prompt_ids}
    data = viewer_data(trace.tokens, lens, run["labels"], decisions=df, cells=trace.num_layers * trace.num_kv_heads)
    names = data["meta"]["decisions"]
    assert "random at keep:0.5" in names and "random_reference at keep:0.5" in names
    assert len(names) == len(set(names))


def test_sampled_labels_and_another_model_are_refused_before_the_model_loads(run, capsys, tmp_path, monkeypatch):
    """#40: labels of a sample of the entries cannot define oracle_single, and another built-in --model is known to
    differ from the Trace's: both refused before any model load."""
    import kvdiag.model.load

    monkeypatch.setattr(kvdiag.model.load, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    sampled = write_table(run["labels"].filter(pl.col("position") % 2 == 0), tmp_path / "sampled.parquet",
                          run["labels_meta"])
    err = exits_2(capsys, "decisions", "--trace", run["trace"].path, "--scores", run["scores_path"], "--labels",
                  sampled, "--keep", "0.5", "--out", tmp_path / "o")
    assert "oracle_single needs exact labels" in err and "lacks some at checkpoint" in err
    err = exits_2(capsys, "decisions", "--trace", run["trace"].path, "--scores", run["scores_path"], "--model",
                  "tiny:qwen3", "--keep", "0.5", "--out", tmp_path / "o")
    assert "--model tiny:qwen3 is not the Trace's model (tiny:llama)" in err
    assert not (tmp_path / "o").exists()


def test_the_figure_gives_each_rule_its_own_line_style(monkeypatch, tmp_path):
    """decisions.png: 25 rules (more than tab20's colours and the default cycle's 10; the zoo's ``random`` among them)
    each get their own (colour, marker), solid; the references are dotted, black (the oracles) or grey (random), each
    its own marker. The lines are read off the figure as drawn (``save_figure`` replaced by a recorder)."""
    from kvdiag.decisions import summary as S

    rules = [f"rule{i}" for i in range(24)] + ["random"]  # the zoo's random rule is a rule, drawn as one
    oracles = ["oracle_single", "oracle_greedy", "fast", "future_attention", "oracle_search"]
    names = [*rules, *oracles, "random_reference"]
    table = pl.DataFrame({"decision": [n for n in names for _ in range(2)], "budget": ["keep:0.5", "keep:0.25"] * 31,
                          "kind": ["rule"] * 50 + ["reference"] * 12, "mean_kl": [0.1, 0.2] * 31})
    drawn = {}

    def record(fig, out, name):
        drawn.update({line.get_label(): line for line in fig.axes[0].get_lines()})
        return []

    monkeypatch.setattr("kvdiag.core.plotting.save_figure", record)
    S.figure(table, tmp_path)
    pairs = {(tuple(drawn[r].get_color()), drawn[r].get_marker()) for r in rules}
    assert len(pairs) == 25 and all(drawn[r].get_linestyle() == "-" for r in rules)
    assert all(drawn[o].get_color() == "black" and drawn[o].get_linestyle() == ":" for o in oracles)
    assert len({drawn[o].get_marker() for o in oracles}) == 5 and drawn["random_reference"].get_color() == "grey"
