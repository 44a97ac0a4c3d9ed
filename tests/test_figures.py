"""``kvdiag figures``: every number written beside a figure against an independent computation (dense float64
attention, Python loops, hand-written quantiles and tests, scikit-learn); too few candidates; bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest
import torch
from scipy.stats import mannwhitneyu
from scipy.stats.contingency import odds_ratio
from sklearn.metrics import average_precision_score, roc_auc_score
from typer.testing import CliRunner

import kvdiag.cli.main
from kvdiag.core.errors import UserError
from kvdiag.core.io import read_table, write_table
from kvdiag.figures import (
    FigureParams,
    check_figure_inputs,
    classify_reads,
    first_reads,
    make_figures,
    trace_first_reads,
)
from kvdiag.label import LABEL_SCHEMA
from kvdiag.rankeval import KEYS

PARAMS = FigureParams(w_obs=8, w_delay=64, interval=16, n_boot=50, min_group=3)
PLANTED_SCORERS = ("avokv_e", "avokv_e_no_payload", "rkv")


# --------------------------------------------------------------------------- independent references


def dense_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[H, T, T] float64 causal softmax with repeat_kv (query head h reads KV head h // g)."""
    H, T, _ = q.shape
    g = H // k.shape[0]
    logits = q.double() @ k.double().repeat_interleave(g, dim=0).transpose(1, 2) * scale
    return torch.softmax(logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), dim=-1)


def reference(trace, rows: list[tuple[str, int, int]], w_obs: int, w_delay: int) -> dict:
    """(pid, t, i) -> (p, b) by the definition, and pid -> read strength [T, T] (mean over layers and heads)."""
    feats, strength = {}, {}
    for pid in trace.prompt_ids:
        mine = [r for r in rows if r[0] == pid]
        T, L = trace.length(pid), trace.num_layers
        strength[pid] = torch.zeros(T, T, dtype=torch.float64)
        acc = {r: [0.0, 0.0] for r in mine}
        for layer in range(L):
            qkv = trace.layer(pid, layer)
            A = dense_probs(qkv.q, qkv.k, trace.scale)
            strength[pid] += A.mean(dim=0) / L
            for (_, t, i) in mine:
                mass = A[:, max(0, t - w_obs) : t, :t].sum(dim=1)  # [H, t]
                eligible = torch.arange(t) < t - w_delay
                acc[(pid, t, i)][0] += (mass[:, i] / mass[:, eligible].sum(dim=1)).mean().item() / L
                acc[(pid, t, i)][1] += qkv.v[:, i].double().norm(dim=-1).mean().item() / L
        feats.update({r: tuple(v) for r, v in acc.items()})
    return {"features": feats, "strength": strength}


def quantile(values, q: float) -> float:
    """Linear-interpolation quantile, by hand."""
    x = sorted(values)
    h = (len(x) - 1) * q
    lo = math.floor(h)
    return x[lo] + (h - lo) * (x[min(lo + 1, len(x) - 1)] - x[lo])


def cliffs_delta(x, y) -> tuple[float, float]:
    """(U of x, P(X > Y) - P(X < Y)) by counting every pair."""
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)
    losses = sum(1.0 for a in x for b in y if a < b)
    return wins, (sum(1 for a in x for b in y if a > b) - losses) / (len(x) * len(y))


def fisher_greater(a: int, b: int, c: int, d: int) -> float:
    """One-sided Fisher exact p: P(X >= a) under the hypergeometric law of the 2×2 table's margins."""
    row, col, n = a + b, a + c, a + b + c + d
    return sum(math.comb(col, x) * math.comb(n - col, row - x) for x in range(a, min(row, col) + 1)) / math.comb(n, row)


def stats_of(path) -> dict[str, tuple[float, str]]:
    df = pl.read_csv(path, schema_overrides={"value": pl.Float64, "note": pl.String})
    return {r["statistic"]: (r["value"], r["note"] or "") for r in df.iter_rows(named=True)}


# --------------------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def run(tiny_trace, tmp_path_factory):
    """Synthetic labels on the tiny Trace with a planted blind spot (low p, large b -> high KL), scores, and figures."""
    tr = tiny_trace
    rng = np.random.default_rng(0)
    keys = []
    for pid in tr.prompt_ids:
        T = tr.length(pid)
        for t in (T - 100, T - 50, T):
            keys += [(pid, t, int(i)) for i in np.sort(rng.choice(t, 40, replace=False))]
    ref = reference(tr, keys, PARAMS.w_obs, PARAMS.w_delay)
    rows = []
    for (pid, t), grp in pl.DataFrame(keys, schema=["pid", "t", "i"], orient="row").group_by(
        "pid", "t", maintain_order=True
    ):
        ps = [ref["features"][(pid, t, i)][0] for i in grp["i"]]
        bs = [ref["features"][(pid, t, i)][1] for i in grp["i"]]
        p_cut, b_cut = quantile(ps, 0.5), quantile(bs, 0.75)
        ids = tr.token_ids(pid)
        for i, p, b in zip(grp["i"], ps, bs, strict=True):
            kl = float(np.exp(rng.normal(-2.5, 0.5) if (p < p_cut and b > b_cut) else rng.normal(-6, 1.5)))
            rows.append(
                dict(
                    prompt_id=pid, checkpoint=t, position=i, granularity="token", layer=-1, kv_head=-1, horizon=16,
                    kl_mean=kl, kl_max=kl, kl_steps=[kl], js_mean=kl / 4, nll_delta=0.0, top1_flips=0, noise_floor=5e-4,
                    age=t - i, token_id=int(ids[i]),
                )
            )
    labels = pl.DataFrame(rows, schema=LABEL_SCHEMA)
    logkl = np.log(labels["kl_mean"].to_numpy())
    noise = rng.normal(size=(len(PLANTED_SCORERS), labels.height))
    scores = labels.select(KEYS).with_columns(
        avokv_e=pl.Series(logkl + noise[0]), avokv_e_no_payload=pl.Series(noise[1]), rkv=pl.Series(-logkl + noise[2]))
    out = tmp_path_factory.mktemp("figures")
    meta = {"trace": tr.provenance}
    result = make_figures(
        tr, labels, scores, out, PARAMS, labels_meta={"kind": "labels", **meta}, scores_meta={"kind": "scores", **meta}
    )
    return {"trace": tr, "labels": labels, "scores": scores, "out": out, "result": result, "ref": ref}


def analysed(labels: pl.DataFrame) -> pl.DataFrame:
    return labels.filter(pl.col("kl_mean") > pl.col("noise_floor"))


def test_files_exist_and_figures_json_records_the_settings(run):
    out = run["out"]
    for name in ("blind_spot", "delayed_reads", "components"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f"{name}.pdf").read_bytes()[:5] == b"%PDF-"
    record = json.loads((out / "figures.json").read_text())
    assert record["params"]["w_obs"] == 8 and record["params"]["interval"] == 16
    assert record["inputs"]["trace"]["fingerprint"] == run["trace"].fingerprint
    assert set(record["outputs"]) >= {"blind_spot.png", "delayed_reads_entries.csv", "components.csv", "figures.json"}


def test_read_pressure_and_payload_match_the_dense_reference(run):
    points = pl.read_csv(run["out"] / "blind_spot_points.csv")
    assert points.height == analysed(run["labels"]).height  # unresolved labels are left out, as in rank-eval
    for r in points.iter_rows(named=True):
        p, b = run["ref"]["features"][(r["prompt_id"], r["checkpoint"], r["position"])]
        assert r["read_pressure"] == pytest.approx(p, rel=1e-4)
        assert r["value_payload"] == pytest.approx(b, rel=1e-4)


def test_blind_spot_statistics_match_an_independent_computation(run):
    ref, lab = run["ref"]["features"], analysed(run["labels"])
    s = stats_of(run["out"] / "blind_spot_stats.csv")
    threshold = quantile(lab["kl_mean"].to_list(), 0.9)
    assert s["harm_threshold"][0] == pytest.approx(threshold)
    assert s["n_unresolved_excluded"][0] == run["labels"].height - lab.height > 0
    cells = {"ll_h": [], "ll_n": [], "ls_h": [], "ls_n": []}
    kl_large, kl_small = [], []
    for (pid, t), grp in lab.group_by("prompt_id", "checkpoint"):
        ps = [ref[(pid, t, i)][0] for i in grp["position"]]
        bs = [ref[(pid, t, i)][1] for i in grp["position"]]
        p_cut, b_cut = quantile(ps, 0.5), quantile(bs, 0.75)
        for p, b, kl in zip(ps, bs, grp["kl_mean"], strict=True):
            if p < p_cut:
                (kl_large if b > b_cut else kl_small).append(kl)
                cells[("ll_" if b > b_cut else "ls_") + ("h" if kl > threshold else "n")].append(kl)
    a, b, c, d = (len(cells[k]) for k in ("ll_h", "ll_n", "ls_h", "ls_n"))
    assert (s["low_large_high"][0], s["low_large_not_high"][0], s["low_small_high"][0], s["low_small_not_high"][0]) == (
        a, b, c, d,
    )
    assert s["n_blind_spot"][0] == a + b and s["n_low_attention"][0] == a + b + c + d
    assert s["fisher_p"][0] == pytest.approx(fisher_greater(a, b, c, d), rel=1e-9)
    assert s["fisher_odds_ratio"][0] == pytest.approx(a * d / (b * c) if b * c else math.inf)
    cond = odds_ratio(np.array([[a, b], [c, d]]))
    assert s["odds_ratio"][0] == pytest.approx(cond.statistic)
    assert s["odds_ratio_ci_low"][0] == pytest.approx(cond.confidence_interval(0.95).low)
    u, delta = cliffs_delta(kl_large, kl_small)
    assert s["mwu_u"][0] == pytest.approx(u)
    assert s["rank_biserial"][0] == pytest.approx(delta)
    assert s["mwu_p"][0] == pytest.approx(mannwhitneyu(kl_large, kl_small, alternative="greater").pvalue)
    assert s["harm_rate_large_payload"][0] == pytest.approx(a / (a + b))
    # the planted blind spot is found
    assert s["fisher_p"][0] < 0.01 and s["rank_biserial"][0] > 0.5


def test_delayed_reads_match_the_dense_reference(run):
    tr, strength, mult, w = run["trace"], run["ref"]["strength"], PARAMS.strong_read_mult, PARAMS.w_obs
    lab = analysed(run["labels"])
    got = {
        (r["prompt_id"], r["position"]): r
        for r in pl.read_csv(run["out"] / "delayed_reads_entries.csv").iter_rows(named=True)
    }
    entries = run["labels"].select("prompt_id", "position").unique()
    assert len(got) == entries.height
    classes, delays, evicted, kl_by_class = {}, [], 0, {"delayed": [], "never": []}
    for pid, i in entries.iter_rows():
        T, P = tr.length(pid), tr.prompt_len(pid)
        u = [(tau + 1) * strength[pid][tau, i].item() for tau in range(T)]
        # float32 vs float64 could decide a read right at the threshold either way: none is that close here
        assert all(abs(x - mult) > 1e-5 * mult for x in u[i + 1 :])
        window = range(i + 1, i + 1 + w)
        later = [tau for tau in range(i + 1 + w, T) if u[tau] >= mult]
        if i + 1 + w > T:
            cls = "unobserved"
        elif max(u[tau] for tau in window) >= mult:
            cls = "early"
        else:
            cls = "delayed" if later else "never"
        r = got[(pid, i)]
        assert r["read_class"] == cls, (pid, i)
        classes[cls] = classes.get(cls, 0) + 1
        if cls != "unobserved":
            assert r["first_window_peak"] == pytest.approx(max(u[tau] for tau in window), rel=1e-4)
        if cls == "delayed":
            c_star = next(P + k * PARAMS.interval for k in range(1, 10**6) if P + k * PARAMS.interval >= i + 1 + w)
            assert (r["first_strong_read"], r["delay"], r["next_checkpoint"]) == (later[0], later[0] - i, c_star)
            assert r["evicted_before_read"] == (c_star <= later[0])
            delays.append(later[0] - i)
            evicted += c_star <= later[0]
        kls = lab.filter((pl.col("prompt_id") == pid) & (pl.col("position") == i))["kl_mean"]
        if cls in kl_by_class and len(kls):
            kl_by_class[cls].append(kls.mean())
            assert r["kl"] == pytest.approx(kls.mean())
    # the synthetic run exercises every outcome
    assert min(classes.get(c, 0) for c in ("early", "delayed", "never", "unobserved")) >= 1 and 0 < evicted < len(
        delays
    )
    s = stats_of(run["out"] / "delayed_reads_stats.csv")
    for c in ("early", "delayed", "never", "unobserved"):
        assert s[f"n_{c}"][0] == classes[c]
    assert s["delay_median"][0] == pytest.approx(quantile(delays, 0.5))
    assert s["delay_q75"][0] == pytest.approx(quantile(delays, 0.75))
    assert s["share_evicted_before_read"][0] == pytest.approx(evicted / len(delays))
    u, delta = cliffs_delta(kl_by_class["delayed"], kl_by_class["never"])
    assert (s["mwu_u"][0], s["rank_biserial"][0]) == (pytest.approx(u), pytest.approx(delta))
    hist = pl.read_csv(run["out"] / "delayed_reads_hist.csv")
    assert hist["count"].sum() == len(delays)
    for lo, hi, n in hist.iter_rows():
        assert hi == 2 * lo and lo & (lo - 1) == 0  # power-of-two bins
        assert n == sum(lo <= x < hi for x in delays)


def test_delayed_reads_regenerate_from_the_written_first_reads(run, tmp_path):
    """first_reads.parquet holds the Trace's part of the delayed reads: given it, make_figures without a Trace writes
    the same delayed-read tables as the run that computed the reads (the same rows, values equal: one path)."""
    reads = read_table(run["out"] / "first_reads.parquet")
    assert reads[1]["kind"] == "first_reads" and reads[1]["trace"] == run["trace"].provenance
    assert reads[1]["params"] == {"w_obs": 8, "strong_read_mult": PARAMS.strong_read_mult, "read_reduce": "mean"}
    make_figures(None, run["labels"], run["scores"], tmp_path / "again", PARAMS, reads=reads, only=("delayed_reads",))
    for name in ("entries", "hist", "stats"):
        got, want = (pl.read_csv(d / f"delayed_reads_{name}.csv") for d in (tmp_path / "again", run["out"]))
        assert got.equals(want), name
    record = json.loads((tmp_path / "again" / "figures.json").read_text())
    assert record["inputs"]["first_reads"] == "given (first_reads.parquet)"
    with pytest.raises(UserError, match="first reads were made with"):  # other read settings than the figures'
        make_figures(None, run["labels"], run["scores"], tmp_path / "w4", FigureParams(w_obs=4), reads=reads,
                     only=("delayed_reads",))
    with pytest.raises(ValueError, match="without a Trace"):  # the blind spot needs the Trace or the features
        make_figures(None, run["labels"], run["scores"], tmp_path / "all", PARAMS, reads=reads)
    fewer = (reads[0].filter(pl.col("position") > reads[0]["position"].min()), reads[1])
    with pytest.raises(UserError, match="lack"):  # reads that miss a labeled entry
        make_figures(None, run["labels"], run["scores"], tmp_path / "few", PARAMS, reads=fewer, only=("delayed_reads",))


def test_component_figure_matches_sklearn_and_hand_counts(run):
    table = pl.read_csv(run["out"] / "components.csv", schema_overrides={"note": pl.String})
    joined = analysed(run["labels"]).join(run["scores"], on=list(KEYS))
    kl = joined["kl_mean"].to_numpy()
    y = kl > quantile(kl.tolist(), 0.9)
    for name in PLANTED_SCORERS:
        s = joined[name].to_numpy()
        got = {r["metric"]: r for r in table.filter(pl.col("scorer") == name).iter_rows(named=True)}
        assert got["auroc"]["value"] == pytest.approx(roc_auc_score(y, s))
        assert got["ap"]["value"] == pytest.approx(average_precision_score(y, s))
        k = int(y.sum())
        assert got["topk_recall"]["value"] == pytest.approx(y[np.argsort(-s)[:k]].sum() / k)
        harmful = evicted = 0
        for _, grp in joined.with_columns(_y=pl.Series(y), _s=pl.Series(s)).group_by("prompt_id", "checkpoint"):
            n = math.floor(PARAMS.rho * grp.height)
            harmful += grp.sort("_s")["_y"][:n].sum()
            evicted += n
        assert got["fsr"]["value"] == pytest.approx(harmful / evicted)
        for r in got.values():
            assert r["ci_low"] <= r["value"] <= r["ci_high"]
    missing = table.filter(pl.col("scorer") == "avokv_e_raw")
    assert missing["value"].is_nan().all() and "not in the scores" in missing["note"][0]
    base = table.filter(pl.col("scorer") == "random_baseline")
    assert dict(zip(base["metric"], base["value"], strict=True))["fsr"] == pytest.approx(y.mean())


def test_first_reads_by_hand():
    # T = 8 queries, entries 1 and 5, window 2, strong = 2x uniform: u = (tau + 1) * strength
    strength = torch.zeros(8, 2)
    strength[2, 0], strength[3, 0], strength[6, 0] = 0.1, 0.2, 0.5  # u = 0.3, 0.8 (window 2..3), 3.5 at tau 6
    strength[6, 1], strength[7, 1] = 0.1, 0.3  # window 6..7 (complete: 5 + 1 + 2 <= 8): u = 0.7, 2.4 -> early
    got = first_reads(strength, torch.tensor([1, 5]), w_obs=2, strong_read_mult=2.0)
    assert got["window_complete"].tolist() == [True, True]
    assert got["first_window_peak"].tolist() == pytest.approx([0.8, 2.4])
    assert got["first_strong_read"].tolist() == [6, -1]
    assert got["future_queries"].tolist() == [4, 0]
    reads = pl.DataFrame({"prompt_id": ["p"] * 4, "position": [1, 5, 120, 150], "prompt_len": 100, "length": 200,
                          "window_complete": [True, True, True, True], "first_window_peak": [0.8, 2.4, 1.0, 1.0],
                          "first_strong_read": [6, -1, 131, 168], "future_queries": 0})
    c = classify_reads(reads, w_obs=8, strong_read_mult=2.0, interval=16)
    assert c["read_class"].to_list() == ["delayed", "early", "delayed", "delayed"]
    # c* = first 100 + 16k >= i + 9: 116 (prompt entry), 132 (i = 120), 164 (i = 150)
    assert c["next_checkpoint"].to_list() == [116, 116, 132, 164]
    assert c["evicted_before_read"].to_list() == [False, None, False, True]  # 116 > 6; 132 > 131; 164 <= 168


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_chunked_read_strengths_equal_one_block(tiny_trace, reduce):
    pid = tiny_trace.prompt_ids[0]
    entries = pl.DataFrame({"prompt_id": [pid] * 7, "position": [0, 3, 50, 120, 180, 200, 235]})
    whole = trace_first_reads(tiny_trace, entries, 8, 4.0, reduce, 2**24, 2**26)
    tiny = trace_first_reads(
        tiny_trace, entries, 8, 4.0, reduce, 1000, 3 * tiny_trace.length(pid)
    )  # 3 columns per block
    assert whole.drop("first_window_peak").equals(tiny.drop("first_window_peak"))
    np.testing.assert_allclose(whole["first_window_peak"].to_numpy(), tiny["first_window_peak"].to_numpy(), rtol=1e-6)
    if reduce == "max":
        T = tiny_trace.length(pid)
        s = torch.stack(
            [
                dense_probs(tiny_trace.layer(pid, layer).q, tiny_trace.layer(pid, layer).k, tiny_trace.scale).amax(0)
                for layer in range(tiny_trace.num_layers)
            ]
        ).amax(0)
        i = 120
        assert whole["first_window_peak"][3] == pytest.approx(
            max((tau + 1) * s[tau, i].item() for tau in range(i + 1, i + 9)), rel=1e-5
        )
        assert whole["future_queries"].to_list()[-1] == max(0, T - 244)


def test_too_few_candidates_render_with_notes(tiny_trace, tmp_path):
    pid = tiny_trace.prompt_ids[0]
    ids = tiny_trace.token_ids(pid)
    labels = pl.DataFrame(
        [
            dict(
                prompt_id=pid, checkpoint=200, position=i, granularity="token", layer=-1, kv_head=-1,
                kl_mean=0.01 * (i + 1), noise_floor=0.0, token_id=int(ids[i]),
            )
            for i in (10, 20, 30, 40)
        ]
    )
    result = make_figures(tiny_trace, labels, None, tmp_path / "few", PARAMS)
    s = stats_of(tmp_path / "few" / "blind_spot_stats.csv")
    assert math.isnan(s["fisher_p"][0]) and "too few" in s["fisher_p"][1]
    assert math.isnan(s["rank_biserial"][0]) and "too few" in s["rank_biserial"][1]
    d = stats_of(tmp_path / "few" / "delayed_reads_stats.csv")
    assert math.isnan(d["mwu_p"][0]) and "too few" in d["mwu_p"][1]
    comp = pl.read_csv(tmp_path / "few" / "components.csv", schema_overrides={"note": pl.String})
    assert comp.filter(pl.col("scorer") == "avokv_e")["note"].str.contains("no scores").all()
    assert any("too few" in n for n in result["notes"]) and any("no scores" in n for n in result["notes"])
    # every label below its noise floor: nothing to analyse, the figures still render
    quiet = labels.with_columns(noise_floor=pl.lit(1.0))
    result = make_figures(tiny_trace, quiet, None, tmp_path / "none", PARAMS)
    assert result["blind_spot"]["n_candidates"] == 0 and result["delayed_reads"]["n_kl_delayed"] == 0
    for name in ("blind_spot", "delayed_reads", "components"):
        assert (tmp_path / "none" / f"{name}.png").stat().st_size > 0


def test_inputs_from_different_runs_are_refused(run, tmp_path):
    tr, labels, scores = run["trace"], run["labels"], run["scores"]
    ours, theirs = {"trace": tr.provenance}, {"trace": {"fingerprint": "0123456789abcdef"}}
    with pytest.raises(UserError, match="another Trace"):
        check_figure_inputs(tr, labels, scores, labels_meta=theirs)
    with pytest.raises(UserError, match="different traces"):
        check_figure_inputs(tr, labels, scores, labels_meta=ours, scores_meta=theirs)
    with pytest.raises(UserError, match="token_id .* another Trace"):
        check_figure_inputs(tr, labels.with_columns(token_id=pl.col("token_id") + 1), scores)
    with pytest.raises(UserError, match="not in the Trace"):
        check_figure_inputs(tr, labels.with_columns(prompt_id=pl.lit("elsewhere")), None)
    with pytest.raises(UserError, match="share no candidate"):
        check_figure_inputs(tr, labels, scores.with_columns(position=pl.col("position") + 10_000))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="not a writable directory"):
        make_figures(tr, labels, scores, blocker / "figures", PARAMS)


def test_cli_writes_the_figures_and_exits_2_on_bad_input(run, tmp_path, capsys):
    tr = run["trace"]
    lp = write_table(run["labels"].head(60), tmp_path / "labels.parquet", {"kind": "labels", "trace": tr.provenance})
    sp = write_table(run["scores"].head(60), tmp_path / "scores.parquet", {"kind": "scores", "trace": tr.provenance})
    out = tmp_path / "figs"
    base = ["figures", "--trace", str(tr.path), "--labels", str(lp), "--scores", str(sp)]
    result = CliRunner().invoke(
        kvdiag.cli.main.app, [*base, "--out", str(out), "--w-obs", "8", "--bootstrap", "20", "--include-unresolved"]
    )
    assert result.exit_code == 0 and "wrote" in result.output
    record = json.loads((out / "figures.json").read_text())
    assert record["argv"][:2] == ["kvdiag", "figures"] and "--include-unresolved" in record["argv"]
    assert record["params"]["w_obs"] == 8 and record["params"]["include_unresolved"] is True
    assert (out / "blind_spot.pdf").is_file()

    def exits_2(*argv) -> str:
        with pytest.raises(SystemExit) as err:
            kvdiag.cli.main.main([*argv])
        assert err.value.code == 2
        return " ".join(capsys.readouterr().err.split())

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "not a writable directory" in exits_2(*base, "--out", str(blocker / "x"))
    # labels that claim this Trace but hold other tokens; the same without a Trace in their metadata (#40: refused)
    shifted = run["labels"].head(60).with_columns(token_id=pl.col("token_id") + 1)
    write_table(shifted, tmp_path / "other.parquet", {"kind": "labels", "trace": tr.provenance})
    assert "token_id" in exits_2(
        "figures", "--trace", str(tr.path), "--labels", str(tmp_path / "other.parquet"), "--scores", str(sp), "--out",
        str(out)
    )
    write_table(shifted, tmp_path / "traceless.parquet", {"kind": "labels"})
    assert "does not record the Trace" in exits_2(
        "figures", "--trace", str(tr.path), "--labels", str(tmp_path / "traceless.parquet"), "--scores", str(sp),
        "--out", str(out)
    )
    foreign = write_table(
        run["labels"].head(60), tmp_path / "foreign.parquet",
        {"kind": "labels", "trace": {"fingerprint": "0123456789abcdef"}},
    )
    assert "was made from another Trace" in exits_2(
        "figures", "--trace", str(tr.path), "--labels", str(foreign), "--scores", str(sp), "--out", str(out)
    )
    # refused on the command line (kvdiag.cli.common.BOUNDS), before the figures' own check of low_attention_quantile
    assert "--low-attention-quantile 1.5: must be at most 1" in exits_2(*base, "--out", str(out),
                                                                        "--low-attention-quantile", "1.5")


def test_figures_read_the_features_that_score_wrote(run, tmp_path, monkeypatch):
    """Scoring writes each token row's read pressure and payload beside the scores; the figures read them instead
    of recomputing them from the Trace. Both sides run one function (``token_features.layer_pressure_payload``) on
    the same layer tensors and shapes, so the points are compared exactly."""
    from kvdiag.figures import registry
    from kvdiag.figures.run import figures_files
    from kvdiag.scorers.run import score_files, score_trace
    from kvdiag.scorers.token_features import TokenFeatures, features_path, read_token_features, usable_features

    tr, labels = run["trace"], run["labels"]
    meta = {"kind": "labels", "trace": tr.provenance}
    lp = write_table(labels, tmp_path / "labels.parquet", meta)
    sp = tmp_path / "scores.parquet"
    score_files(
        tr.path, sp, labels=lp, scorers="avokv_e,h2o", progress=False
    )  # the command's defaults: w_obs 32, w_delay 128
    written, written_meta = read_table(features_path(sp))
    assert written.height == labels.height and written["value_payload"].null_count() == 0
    assert written_meta["kind"] == "token_features" and written_meta["params"] == {
        "w_obs": 32, "w_delay": 128, "payload": "l2",
    }

    # the figures' settings: write the features with them through the library, as score_files does
    feats = TokenFeatures(PARAMS.token_features)
    scores, scores_meta = score_trace(tr, keys=labels, scorers="avokv_e,h2o", token_features=feats)
    write_table(scores, sp, scores_meta)
    write_table(feats.table(), features_path(sp), feats.meta(scores_meta["trace"]))
    df, source = usable_features(read_token_features(sp), PARAMS.token_features, tr)
    assert source == "read from scores.features.parquet (written by kvdiag score)" and df.height == labels.height

    def no_trace_features(*args, **kwargs):
        raise AssertionError("the figures recomputed read pressure and payload from the Trace")

    with monkeypatch.context() as m:
        m.setattr(registry, "trace_pressure_payload", no_trace_features)
        figures_files(tr.path, lp, sp, tmp_path / "read", PARAMS, progress=False)
    record = json.loads((tmp_path / "read" / "figures.json").read_text())
    assert record["inputs"]["read_pressure_payload"] == source
    # the same points as the figures computed from the Trace alone (the module's run): exactly
    assert pl.read_csv(tmp_path / "read" / "blind_spot_points.csv").equals(
        pl.read_csv(run["out"] / "blind_spot_points.csv")
    )

    # other settings than the file's: recomputed from the Trace, and figures.json says so
    figures_files(
        tr.path, lp, sp, tmp_path / "other", FigureParams(w_obs=4, w_delay=64, interval=16, n_boot=20, min_group=3),
        progress=False,
    )
    assert (
        "was made with"
        in json.loads((tmp_path / "other" / "figures.json").read_text())["inputs"]["read_pressure_payload"]
    )
    # a features file of another Trace beside the scores is refused, not used
    write_table(feats.table(), features_path(sp), feats.meta({"fingerprint": "0123456789abcdef"}))
    with pytest.raises(UserError, match="another Trace"):
        figures_files(tr.path, lp, sp, tmp_path / "foreign", PARAMS, progress=False)
    assert not (tmp_path / "foreign").exists()  # refused before anything is written
    # the library call checks what it is given the same way
    with pytest.raises(UserError, match="another Trace"):
        make_figures(tr, labels, scores, tmp_path / "given", PARAMS, features=read_token_features(sp))
