"""``kvdiag label --method hybrid``: the fast label for every entry, the exact label for the top M and an audit; the
rows say which; the audit's miss-rate estimate goes into the metadata and agrees with the truth on a tiny model."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvdiag.harm import HarmSpec
from kvdiag.io import read_table
from kvdiag.label import LabelConfig, label_trace
from kvdiag.label.hybrid import miss_rate, weighted_quantile
from tests.conftest import exits_2, make_trace

SETTINGS = dict(checkpoints="every:16", horizon=4, candidates="all", w_obs=0)


@pytest.fixture(scope="module")
def labels(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    trace = make_trace(tiny_llama, root / "trace", n_prompts=2, max_new_tokens=40)
    exact = read_table(label_trace(trace, tiny_llama, root / "exact.parquet", LabelConfig(**SETTINGS),
                                   show_progress=False))[0]
    fast = read_table(label_trace(trace, tiny_llama, root / "fast.parquet", LabelConfig(**SETTINGS, method="fast"),
                                  show_progress=False))[0]
    hybrid, meta = read_table(label_trace(
        trace, tiny_llama, root / "hybrid.parquet",
        LabelConfig(**SETTINGS, method="hybrid", params={"exact_frac": 0.25, "audit": 6}), show_progress=False))
    return {"root": root, "trace": trace, "exact": exact, "fast": fast, "hybrid": hybrid, "meta": meta}


KEY = ["prompt_id", "checkpoint", "position"]


def test_rows_say_which_method_and_hold_its_value(labels):
    h, exact, fast = labels["hybrid"], labels["exact"], labels["fast"]
    assert h.height == exact.height and set(h["method"]) == {"exact-top", "exact-audit", "fast"}
    j = h.join(exact.select(*KEY, e="kl_mean", f_steps="kl_steps"), on=KEY).join(fast.select(*KEY, f="kl_mean"), on=KEY)
    ex = j.filter(pl.col("method") != "fast")
    # the exact engine on a subset of the rows: other batches, other last bits; the conformance tolerance
    np.testing.assert_allclose(ex["kl_mean"].to_numpy(), ex["e"].to_numpy(), rtol=1e-4, atol=1e-6)
    assert ex["kl_steps"].list.len().min() == 4 and j.filter(pl.col("method") == "fast")["kl_steps"].is_null().all()
    fa = j.filter(pl.col("method") == "fast")
    # the same Fisher estimate (same seed, same samples), from a second run: its backward passes round differently in
    # the last bits and the estimate squares them (seen: 1e-4 relative)
    np.testing.assert_allclose(fa["kl_mean"].to_numpy(), fa["f"].to_numpy(), rtol=1e-3, atol=1e-12)
    for (_, t), g in h.group_by("prompt_id", "checkpoint"):
        top = g.filter(pl.col("method") == "exact-top")
        assert top.height == int(np.ceil(0.25 * t)) and g.filter(pl.col("method") == "exact-audit").height == 6
        # the exact top are the largest fast labels of the checkpoint
        fast_here = fast.filter((pl.col("prompt_id") == g["prompt_id"][0]) & (pl.col("checkpoint") == t))
        best = set(fast_here.sort("kl_mean", descending=True).head(top.height)["position"].to_list())
        assert set(top["position"].to_list()) == best
        floor = exact.filter((pl.col("prompt_id") == g["prompt_id"][0]) & (pl.col("checkpoint") == t))["noise_floor"]
        assert g["noise_floor"].n_unique() == 1 and g["noise_floor"][0] == pytest.approx(floor[0], abs=1e-9)


def test_the_miss_rate_is_in_the_metadata_and_near_the_truth(labels):
    est = labels["meta"]["miss_rate"]
    assert 0 <= est["miss_rate"] <= 1 and est["ci_low"] <= est["miss_rate"] <= est["ci_high"]
    # the truth from exact labels of every entry: exact-harmful entries outside the exact-top set
    exact, h = labels["exact"], labels["hybrid"]
    thr = HarmSpec().threshold(exact["kl_mean"].to_numpy())
    j = exact.select(*KEY, "kl_mean").join(h.select(*KEY, "method"), on=KEY)
    harmful = j.filter(pl.col("kl_mean") > thr)
    truth = harmful.filter(pl.col("method") != "exact-top").height / harmful.height
    assert abs(est["miss_rate"] - truth) <= 0.35 or est["ci_low"] <= truth <= est["ci_high"], (est, truth)


def test_estimator_is_exact_when_the_audit_is_everything():
    """With the audit covering every entry outside the top, the estimate is the true share."""
    rng = np.random.default_rng(0)
    rows = []
    for p in range(4):
        kl = rng.lognormal(-6, 2, 50)
        order = np.argsort(-kl + rng.normal(0, 3, 50))  # a noisy ranking
        for rank, i in enumerate(order):
            rows.append({"prompt_id": f"p{p}", "checkpoint": 64, "position": int(i), "kl_mean": float(kl[i]),
                         "method": "exact-top" if rank < 10 else "exact-audit"})
    df = pl.DataFrame(rows)
    est = miss_rate(df, n_boot=0)
    thr = float(np.quantile(df["kl_mean"].to_numpy(), 0.9))
    assert est["threshold"] == pytest.approx(weighted_quantile(df["kl_mean"].to_numpy(), np.ones(df.height), 0.9))
    harmful = df.filter(pl.col("kl_mean") > est["threshold"])
    assert est["miss_rate"] == pytest.approx(harmful.filter(pl.col("method") == "exact-audit").height / harmful.height)
    assert abs(est["threshold"] - thr) <= np.ptp(df["kl_mean"].to_numpy()) / df.height * 10



def test_bad_input(labels, capsys, tmp_path):
    base = ["label", "--trace", labels["trace"].path, "--out", tmp_path / "l.parquet", "--checkpoints", "every:16",
            "--w-obs", "0", "--horizon", "4", "--candidates", "all"]
    assert "--exact-top" in exits_2(capsys, *base, "--exact-top", "3")  # without --method hybrid
    assert "one of --exact-top" in exits_2(capsys, *base, "--method", "hybrid")
    hybrid = [*base, "--method", "hybrid"]
    assert "one of --exact-top" in exits_2(capsys, *hybrid, "--exact-top", "2", "--exact-frac", "0.1")
    assert "--exact-top -1" in exits_2(capsys, *base, "--method", "hybrid", "--exact-top", "-1")
    assert "--audit 0 leaves no sample" in exits_2(capsys, *hybrid, "--exact-top", "2", "--audit", "0")
    assert "exceeds the" in exits_2(capsys, *base, "--method", "hybrid", "--exact-top", "100000")
    assert "--audit 100000 exceeds" in exits_2(capsys, *base, "--method", "hybrid", "--exact-top", "2", "--audit",
                                                "100000")
    assert not (tmp_path / "l.parquet").exists()


def test_bench_label_hybrid_writes_its_cost_ratio(tmp_path):
    """`kvdiag bench label --method hybrid`: exact on N candidates vs hybrid on every entry of the same prefix; the
    JSON's ratio is hybrid's cost per labeled entry over exact's (no timing asserted: only that it is recorded and
    consistent with the rows)."""
    import json

    from typer.testing import CliRunner

    from kvdiag.cli.main import app

    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "label", "--model", "tiny:llama", "--method", "hybrid", "--exact-frac",
                                   "0.25", "--audit", "4", "--prefix", "32", "--n", "4", "--horizon", "2",
                                   "--repeats", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    (ex, hy), (kx, kh) = got["rows"], got["entries"]
    assert (kx, kh) == (4, 32) and got["params"]["exact_frac"] == 0.25 and got["params"]["audit"] == 4
    assert got["ratio"] == pytest.approx((hy["seconds"] / kh) / (ex["seconds"] / kx), rel=1e-9)
    assert "cost per labeled entry, exact / hybrid" in res.output
