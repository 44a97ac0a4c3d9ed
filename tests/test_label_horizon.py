"""Long horizons: chunked labels equal physical deletion over the whole horizon; ``rest`` runs to the end of each
prompt; shorter horizons derive from the stored per-step KL."""

from __future__ import annotations

import functools

import polars as pl
import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.label import LabelConfig, OracleEngine, Row, candidate_rows, divergences, label_trace
from kvdiag.label.horizons import at_horizons, horizons_summary
from kvdiag.label.reference import reference_logprobs
from kvdiag.model.load import load_model

T_CKPT, H, CHUNK = 24, 72, 16  # 5 chunks, the last one of 8 steps
LENGTH = T_CKPT + H + 1


@functools.cache
def model(name):
    return load_model(f"tiny:{name}")


def _ids(n=LENGTH, seed=0):
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_chunked_long_horizon_equals_physical_deletion(name):
    """H = 72, chunked (fp32 both sides): per-step KL within 1e-4 relative + 1e-6 nats of deleting the entry
    from a copied cache and decoding the 72 tokens one at a time (the tolerance of the H = 4 conformance test;
    measured here: about 1e-7), for token, layer and head rows. gemma3 alternates sliding (window 8) and full layers:
    a sliding layer's rows of old entries are exactly 0 and the full layers' are not."""
    lm = model(name)
    eng = OracleEngine(lm, _ids(), horizon=H, batch_size=4, chunk=CHUNK)
    prefix, logp_full = eng.golden(T_CKPT)
    rows_per_forward, steps = eng.plan(eng.checkpoint(T_CKPT, layer_inputs=False))
    assert steps < H and rows_per_forward >= 1  # chunked: the memory of 4 rows x 16 steps holds one row x 60 steps
    targets = eng.ids[T_CKPT + 1 : T_CKPT + H + 1]
    for granularity in ("token", "layer", "head"):
        rows = candidate_rows([0, 9, T_CKPT - 1], granularity, eng.num_layers, eng.num_kv_heads)
        got, noise = eng.label(T_CKPT, rows)
        assert got["kl"].shape == (len(rows), H) and 0 <= noise <= 1e-6
        for j, row in enumerate(rows):
            ref = reference_logprobs(lm.model, eng.ids, T_CKPT, H, prefix, row)
            want = divergences(logp_full, ref[None], targets)
            torch.testing.assert_close(got["kl"][j], want["kl"][0], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, row=row: f"{name} {row}: {m}")
            torch.testing.assert_close(got["nll_delta"][j], want["nll_delta"][0], rtol=1e-4, atol=1e-5)
            assert got["flips"][j] == want["flips"][0]
        # harm late in the horizon is measured: the last chunk's steps are not all zero
        assert got["kl"][:, 64:].sum() > 1e-6
    if name == "gemma3":  # layer 0 slides (window 8): entry 0 is invisible to all 72 queries there, not in layer 1
        got, _ = eng.label(T_CKPT, [Row(0, 0), Row(0, 1)])
        assert (got["kl"][0] == 0).all() and got["kl"][1].sum() > 0


def test_chunk_size_does_not_change_labels():
    """The same rows at H = 72 in one forward, in chunks of 16 and of 5 (different shapes, so not bitwise): KL
    within 1e-4 relative + 1e-6 nats (the physical-deletion tolerance; measured 5e-5 relative, 5e-7 nats: fp32
    rounding of a different matmul order), flips equal; and a set row (decisions' path) chunked the same."""
    lm = model("qwen3")
    rows = candidate_rows([0, 5, 17, T_CKPT - 1], "token", lm.attention.num_layers, lm.attention.num_kv_heads)
    runs = [OracleEngine(lm, _ids(), horizon=H, batch_size=3, chunk=c).label(T_CKPT, rows)[0] for c in (H, 16, 5)]
    for other in runs[1:]:
        torch.testing.assert_close(other["kl"], runs[0]["kl"], rtol=1e-4, atol=1e-6)
        assert torch.equal(other["flips"], runs[0]["flips"])
    sets = [torch.tensor([0, 3, 9]), torch.tensor([-1])]
    a = OracleEngine(lm, _ids(), horizon=H, chunk=H).label_sets(T_CKPT, sets)[0]
    b = OracleEngine(lm, _ids(), horizon=H, chunk=16).label_sets(T_CKPT, sets)[0]
    torch.testing.assert_close(b["kl"], a["kl"], rtol=1e-4, atol=1e-6)


def test_rest_runs_to_the_end_and_starts_like_a_fixed_horizon():
    """``rest`` at checkpoint t gets T - t steps; its first 32 steps are those of a fixed H = 32 run: the rows run the
    same chunks, but the full-cache run and the null row run in one chunk each of their own horizon (``solo_chunk``),
    so other shapes: the physical-deletion tolerance, 1e-4 relative + 1e-6 nats (measured 1.8e-4 relative at 1e-6
    nats on a 6e-3 label)."""
    lm = model("llama")
    rows = [Row(0), Row(7), Row(T_CKPT - 1)]
    rest = OracleEngine(lm, _ids(), horizon="rest", chunk=CHUNK)
    assert rest.steps(T_CKPT) == LENGTH - T_CKPT and rest.steps(LENGTH - 1) == 1
    got, _ = rest.label(T_CKPT, rows)
    fixed, _ = OracleEngine(lm, _ids(), horizon=32, chunk=CHUNK).label(T_CKPT, rows)
    assert got["kl"].shape == (3, LENGTH - T_CKPT)
    torch.testing.assert_close(got["kl"][:, :32], fixed["kl"], rtol=1e-4, atol=1e-6)
    last, _ = rest.label(LENGTH - 1, rows)  # the last checkpoint: one step left
    assert last["kl"].shape == (3, 1)
    with pytest.raises(UserError, match="outside"):
        rest.label(LENGTH, rows)


def test_label_trace_rest_records_each_rows_horizon_and_derives_shorter_ones(tiny_llama, tiny_trace, tmp_path):
    cfg = LabelConfig(checkpoints="every:10", w_obs=10, horizon="rest", candidates="4")
    df = pl.read_parquet(label_trace(tiny_trace, tiny_llama, tmp_path / "rest.parquet", cfg, show_progress=False))
    T = {pid: tiny_trace.length(pid) for pid in tiny_trace.prompt_ids}
    want = pl.Series([T[p] - t for p, t in df.select("prompt_id", "checkpoint").iter_rows()])
    assert (df["horizon"] == want).all() and (df["kl_steps"].list.len() == df["horizon"]).all()
    assert df["horizon"].n_unique() > 1  # each checkpoint its own horizon
    # a shorter horizon derived from kl_steps: the mean of the first 8 steps, and the label of a run at H = 8
    derived = at_horizons(df, (8, "rest"))
    at8 = derived.filter(pl.col("at") == "8").sort("prompt_id", "checkpoint", "position")
    fixed = pl.read_parquet(label_trace(tiny_trace, tiny_llama, tmp_path / "h8.parquet",
                                        LabelConfig(checkpoints="every:10", w_obs=10, horizon=8, candidates="4"),
                                        show_progress=False))  # rest's checkpoints include these
    both = at8.join(fixed.select("prompt_id", "checkpoint", "position", kl8="kl_mean"),
                    on=["prompt_id", "checkpoint", "position"])
    assert both.height == fixed.height > 0
    # a run at H = 8 is one chunk of 8 steps; rest's first chunk is 16: different shapes, 1e-4 relative + 1e-6 nats
    torch.testing.assert_close(torch.tensor(both["kl_mean"].to_list()), torch.tensor(both["kl8"].to_list()),
                               rtol=1e-4, atol=1e-6)
    at_rest = derived.filter(pl.col("at") == "rest").sort("prompt_id", "checkpoint", "position")
    assert (at_rest["steps"] == df.sort("prompt_id", "checkpoint", "position")["horizon"]).all()
    summary = horizons_summary(df)
    assert summary["at"].to_list() == ["8", "16", "32", "64", "128", "256", "rest"]
    n = dict(zip(summary["at"], summary["n"], strict=True))
    assert n["rest"] == df.height and n["8"] == int((df["horizon"] >= 8).sum()) and n["256"] == 0


def test_fixed_horizon_past_the_trace_is_refused_and_rest_clips(tiny_llama, tiny_trace, tmp_path):
    longest = max(tiny_trace.length(p) for p in tiny_trace.prompt_ids)
    with pytest.raises(UserError, match="beyond the end.*rest"):
        label_trace(tiny_trace, tiny_llama, tmp_path / "l.parquet", LabelConfig(horizon=longest), show_progress=False)
    with pytest.raises(UserError, match="--horizon 0"):
        LabelConfig(horizon=0)
    with pytest.raises(UserError, match="--horizon abc"):
        LabelConfig(horizon="abc")


def test_derived_horizons_refuse_rows_without_steps():
    df = pl.DataFrame({"prompt_id": ["a"], "checkpoint": [5], "position": [1], "granularity": ["token"],
                       "layer": [-1], "kv_head": [-1], "horizon": [4], "kl_steps": [None]},
                      schema_overrides={"kl_steps": pl.List(pl.Float64)})
    with pytest.raises(UserError, match="no per-step KL"):
        at_horizons(df)
    with pytest.raises(UserError, match="one KL per horizon step"):
        at_horizons(df.with_columns(kl_steps=pl.Series([[0.1, 0.2]])))


def test_bench_label_long_horizon_reports_cost_and_peak_against_h16(tmp_path):
    """``bench label --horizon 64``: the engine at H = 16 and at H = 64 (4 chunks) on the same rows; the ratios in the
    JSON are those of its rows, the first 16 steps of the long labels are the H = 16 labels (the same first chunk:
    1e-6 nats)."""
    import json

    from typer.testing import CliRunner

    from kvdiag.cli.main import app

    out = tmp_path / "h.json"
    res = CliRunner().invoke(app, ["bench", "label", "--model", "tiny:llama", "--prefix", "32", "--n", "3",
                                   "--horizon", "64", "--repeats", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "cost per labeled entry, H=64 / H=16" in res.output and "steps per forward" in res.output
    got = json.loads(out.read_text())
    assert got["horizons"] == [16, 64] and got["chunk"] == 16 and got["linear_ratio"] == 4
    assert got["plans"][0] == [3, 16] and 1 <= got["plans"][1][0] <= 3 and 1 <= got["plans"][1][1] <= 64
    short, long = got["rows"]
    assert got["cost_ratio_per_entry"] == pytest.approx(long["seconds"] / short["seconds"])
    assert long["tokens_per_s"] == pytest.approx(3 * 64 / long["seconds"])
    if short["peak_mb"] is not None and short["peak_mb"] > 0:
        assert got["peak_ratio"] == pytest.approx(long["peak_mb"] / short["peak_mb"])
    assert 0 <= got["max_abs_diff_first_steps"] <= 1e-6


def test_decisions_rest_label_each_set_to_the_end_of_its_prompt(tiny_llama, tiny_trace, tmp_path):
    """``decisions --horizon rest``: each set row records T - t steps, and its per-step KL equals deleting the set
    from a copied cache over all of them (chunks of 16; 1e-4 relative + 1e-6 nats, the physical-deletion tolerance)."""
    from kvdiag.core.io import read_table
    from kvdiag.decisions import Budget, DecisionsConfig, decide
    from kvdiag.label.reference import reference_set_logprobs
    from kvdiag.scorers import checkpoint_keys, score_trace

    cps = {pid: [16, 32] for pid in tiny_trace.prompt_ids}
    scores, meta = score_trace(tiny_trace, keys=checkpoint_keys(tiny_trace, cps, ["head"]), scorers=["h2o", "random"])
    cfg = DecisionsConfig(budgets=(Budget("keep", 0.5),), selection="per-token", horizon="rest", references=("random",),
                          pairs=0, n_boot=0, batch_size=4)
    decide(tiny_trace, tiny_llama, scores, meta, tmp_path / "d", cfg, None, None, show_progress=False)
    df = read_table(tmp_path / "d" / "decisions.parquet")[0].filter(pl.col("status") == "ok")
    T = {pid: tiny_trace.length(pid) for pid in tiny_trace.prompt_ids}
    assert (df["horizon"] == pl.Series([T[p] - t for p, t in df.select("prompt_id", "checkpoint").iter_rows()])).all()
    assert df["horizon"].max() > 16  # chunked
    row = df.filter(pl.col("decision") == "h2o").sort("horizon", descending=True).row(0, named=True)
    pid, t = row["prompt_id"], row["checkpoint"]
    eng = OracleEngine(tiny_llama, tiny_trace.token_ids(pid), "rest")
    prefix, logp_full = eng.golden(t)
    assert len(logp_full) == row["horizon"] == len(row["kl_steps"])
    ref = reference_set_logprobs(tiny_llama.model, eng.ids, t, row["horizon"], prefix,
                                 torch.tensor(row["evicted_positions"]))
    want = divergences(logp_full, ref[None], eng.ids[t + 1 : t + row["horizon"] + 1])["kl"][0]
    torch.testing.assert_close(torch.tensor(row["kl_steps"], dtype=want.dtype), want, rtol=1e-4, atol=1e-6)
    assert want.sum() > 1e-4  # the set's eviction does something


def test_label_cli_horizon_rest(tiny_trace, tmp_path):
    from kvdiag.cli.main import main

    out = tmp_path / "l.parquet"
    with pytest.raises(SystemExit) as exc:
        main(["label", "--trace", str(tiny_trace.path), "--out", str(out), "--checkpoints", "every:16", "--w-obs", "8",
              "--candidates", "2", "--horizon", "rest", "--chunk", "8", "--quiet"])
    assert exc.value.code in (0, None)
    from kvdiag.core.io import read_meta

    df, meta = pl.read_parquet(out), read_meta(out)
    assert meta["config"]["horizon"] == "rest" and meta["config"]["chunk"] == 8
    T = {pid: tiny_trace.length(pid) for pid in tiny_trace.prompt_ids}
    assert (df["horizon"] == pl.Series([T[p] - t for p, t in df.select("prompt_id", "checkpoint").iter_rows()])).all()


def test_derived_horizons_of_decision_rows_use_their_own_keys():
    """The joint damage of a decisions run at a long horizon gives every shorter one the same way (one place)."""
    df = pl.DataFrame({"prompt_id": ["a", "a"], "checkpoint": [5, 5], "decision": ["snapkv", "h2o"],
                       "budget": ["keep 0.5", "keep 0.5"], "horizon": [4, 2],
                       "kl_steps": [[0.1, 0.3, 0.5, 0.7], [1.0, 3.0]]})
    keys = ("prompt_id", "checkpoint", "decision", "budget")
    got = at_horizons(df, (2, 4, "rest"), keys=keys)
    assert got.columns == [*keys, "at", "steps", "kl_mean"]
    kl = {(d, a): v for d, a, v in got.select("decision", "at", "kl_mean").iter_rows()}
    assert kl[("snapkv", "2")] == pytest.approx(0.2, abs=1e-15) and kl[("snapkv", "4")] == pytest.approx(0.4)
    assert kl[("h2o", "2")] == pytest.approx(2.0) and kl[("h2o", "4")] is None and kl[("h2o", "rest")] == 2.0
    with pytest.raises(UserError, match="lack columns"):
        at_horizons(df)  # a label row's keys: a decisions table lacks position, granularity, ...


def test_shared_runs_take_the_longest_chunk_the_memory_allows():
    """The full-cache run and the null row are one sequence each: at H = 72 they run in chunks of 4 x 16 = 64 steps
    (two forwards each) where the plan's memory holds them (batch 64 rows x 16 steps), and in chunks of 16 where it
    does not (batch 1: five each); the labels of both agree within the physical-deletion tolerance (1e-4 relative +
    1e-6 nats)."""
    lm = model("llama")
    calls = []
    hook = lm.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = {}
        for batch, forwards in ((64, 2 * 2), (1, 2 * 5)):
            eng = OracleEngine(lm, _ids(), horizon=H, batch_size=batch, chunk=CHUNK)
            calls.clear()
            eng.checkpoint(T_CKPT, layer_inputs=False)
            assert (eng.solo_chunk(T_CKPT), len(calls)) == ((4 * CHUNK if batch == 64 else CHUNK), forwards)
            out[batch] = eng.label(T_CKPT, [Row(0), Row(9)])[0]["kl"]
    finally:
        hook.remove()
    torch.testing.assert_close(out[1], out[64], rtol=1e-4, atol=1e-6)
