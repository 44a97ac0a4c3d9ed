"""The future-attention oracle of teacher-forced replay (``oracle_future``): per (layer, KV head) it keeps the live
entries that the full-cache run's next W queries attend most, W reaching past the next compression plus the label
horizon; the regret table tests every rule against it exactly, and says where a rule beats it and why."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
from scipy.stats import binomtest

from kvdiag.model.attention import future_attention
from kvdiag.replay import Policy, ReplaySettings, replay, teacher_force
from kvdiag.replay.config import future_window
from kvdiag.replay.oracle import FutureRule, LiveLabels

H, INTERVAL, BUDGET = 4, 8, 12


def direct_future(trace, pid: str, layer: int, t: int, window: int) -> torch.Tensor:
    """[Hkv, t] the attention of the queries t .. t + window - 1 on [0, t), from the Trace's q and k by a dense causal
    softmax with repeat_kv (not ``attention_rows``), summed over the queries and each KV head's query heads."""
    qkv = trace.layer(pid, layer)
    q, k = qkv.q.double(), qkv.k.double()
    g = q.shape[0] // k.shape[0]
    pos = torch.arange(t, t + window)
    logits = q[:, pos] @ k.repeat_interleave(g, dim=0).transpose(1, 2) * trace.layer_attention(layer).scale
    logits = logits.masked_fill(torch.arange(k.shape[1])[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(logits, -1)[..., :t].sum(1).view(k.shape[0], g, t).sum(1)


def test_kept_sets_are_the_future_attention_top_budget(tiny_llama, tiny_trace):
    pid = tiny_trace.prompt_ids[0]
    ids = tiny_trace.token_ids(pid).tolist()
    P, T = tiny_trace.prompt_len(pid), len(ids)
    window = INTERVAL + H
    calls = []

    def recorded(t, w):
        calls.append((t, w))
        return future_attention(tiny_trace, pid, t, w)

    labels = LiveLabels(tiny_llama, torch.tensor(ids), H, future=recorded)
    run = teacher_force(tiny_llama, ids, P, Policy(FutureRule(window), BUDGET, INTERVAL, "per-head"), pid,
                        keep_history=True, labels=labels)
    assert len(run.kept) >= 3 and [t for t, _ in run.kept] == run.compressions
    # every window reaches past the next compression (t + interval) and its label horizon, unless the Trace ends
    assert [w for _, w in calls] == [min(window, T - t) for t in run.compressions]
    assert all(t + w >= min(t + INTERVAL + H, T) for t, w in calls)
    previous = None
    for t, kept in run.kept:
        L, Hkv, _ = kept.shape
        for layer in range(L):
            attention = direct_future(tiny_trace, pid, layer, t, min(window, T - t))  # [Hkv, t]
            for head in range(Hkv):
                # the live entries: all of [0, t) at the first compaction, then the survivors and what came since
                live = (torch.arange(t) if previous is None else
                        torch.cat([previous[1][layer, head], torch.arange(previous[0], t)]))
                values = attention[head, live]
                want = live[torch.topk(values, BUDGET).indices].sort().values
                got = kept[layer, head].sort().values
                assert torch.equal(got, want), (t, layer, head)
        previous = (t, kept)
    assert not all(torch.equal(kept, kept[:1, :1].expand_as(kept)) for _, kept in run.kept)  # per-head sets


def test_window_rest_reads_every_query_to_the_end():
    rule = FutureRule("rest")
    assert rule.steps(10, 50) == 40 and FutureRule(24).steps(40, 50) == 10 and FutureRule(24).steps(10, 50) == 24
    settings = ReplaySettings(scorers=["oracle_future"], budgets=[16], interval=16, horizon=8)
    assert future_window(settings) == 24  # default: the next compression plus the label horizon
    settings.params = {"oracle_future": {"window": "rest"}}
    assert future_window(settings) == "rest"


@pytest.fixture(scope="module")
def sweep(tiny_llama, tiny_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("future") / "r"
    settings = ReplaySettings(scorers=["oracle_future", "rkv", "tova", "streamingllm"], budgets=[12, 16],
                              interval=INTERVAL, selection="per-head", horizon=H)
    replay(tiny_llama, out, settings, trace=tiny_trace, show_progress=False)
    return out


def test_regret_is_against_oracle_future_with_exact_paired_tests(sweep):
    df = pl.read_parquet(sweep / "generations.parquet")
    reg = pl.read_csv(sweep / "regret.csv")
    assert set(reg["reference"]) == {"oracle_future"} and reg.height == 3 * 2
    for r in reg.iter_rows(named=True):
        mine = df.filter((pl.col("scorer") == r["scorer"]) & (pl.col("budget") == r["budget"])).sort("prompt_id")
        oracle = df.filter((pl.col("scorer") == "oracle_future") & (pl.col("budget") == r["budget"])).sort("prompt_id")
        d = (mine["kl_mean"] - oracle["kl_mean"]).to_numpy()
        assert r["prompts"] == len(d) == 2 and abs(r["regret"] - d.mean()) < 1e-12
        above, below = int((d > 0).sum()), int((d < 0).sum())
        assert (r["prompts_above_reference"], r["prompts_below_reference"]) == (above, below)
        assert r["test"] == "sign" and r["p_value"] == pytest.approx(binomtest(above, above + below).pvalue)
        # exact sign-flip permutation over 2 prompts: the 4 sign patterns, p = share with |mean| >= the observed
        flips = np.array([[s1, s2] for s1 in (1, -1) for s2 in (1, -1)]) * d
        p = float((np.abs(flips.mean(1)) >= abs(d.mean()) - 1e-15).mean())
        assert r["test_permutation"] == "permutation" and r["p_permutation"] == pytest.approx(p)
    text = (sweep / "decisions.md").read_text()
    assert "`oracle_future`" in text and "per (layer, KV head), the rules' own action space" in text
    assert "no two-sided exact test can reach p < 0.05" in text


def test_beaten_rows_say_where_and_why(sweep):
    df = pl.read_parquet(sweep / "generations.parquet")
    won = pl.read_csv(sweep / "beaten.csv")
    runs = {(r["prompt_id"], r["scorer"], r["budget"]): r for r in df.iter_rows(named=True)}
    want = {(p, s, b) for (p, s, b), r in runs.items()
            if s != "oracle_future" and r["kl_mean"] < runs[(p, "oracle_future", b)]["kl_mean"]}
    assert {(r["prompt_id"], r["scorer"], r["budget"]) for r in won.iter_rows(named=True)} == want
    for r in won.iter_rows(named=True):
        mine, oracle = runs[(r["prompt_id"], r["scorer"], r["budget"])], runs[(r["prompt_id"], "oracle_future",
                                                                                r["budget"])]
        c = r["compression"] - 1
        assert mine["compression_steps"][c] == r["t"]
        assert (r["joint"], r["reference_joint"]) == (mine["joint_kl"][c], oracle["joint_kl"][c])
        assert r["reason"] == ("set" if r["joint"] < r["reference_joint"] else "state")
        assert r["gain"] < 0 and 0 < r["gain_share"]


def test_a_trace_without_tensors_rebuilds_them_with_the_replay_model(tiny_llama, tiny_trace, tmp_path):
    """``--store none`` (the report's Trace): the replay lends its model to the Trace, whose rebuilt q and k give the
    stored ones' future attention (fp32 both, but a prefill against the trace's decode steps: 1e-5 absolute) and the
    same replayed KL (1e-4 relative)."""
    from kvdiag.tasks.prompts import load_prompts
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    settings = GenerationSettings(max_new_tokens=40, chat=False, instruction=None, storage_dtype="float32",
                                  store="none")
    trace_prompts(tiny_llama, load_prompts("builtin:arith", limit=1), tmp_path / "bare", settings,
                  show_progress=False)
    bare = Trace(tmp_path / "bare")
    pid = bare.prompt_ids[0]
    assert torch.equal(bare.token_ids(pid), tiny_trace.token_ids(pid))
    bare.use_model(tiny_llama)
    t = bare.prompt_len(pid) + 8
    got, want = future_attention(bare, pid, t, 12), future_attention(tiny_trace, pid, t, 12)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-5)
    out = {}
    for name, trace in (("bare", bare), ("stored", tiny_trace)):
        replay(tiny_llama, tmp_path / name, ReplaySettings(scorers=["oracle_future"], budgets=[BUDGET],
                                                           interval=INTERVAL, horizon=H),
               trace=trace, prompt_ids=[pid], show_progress=False)
        out[name] = pl.read_parquet(tmp_path / name / "generations.parquet").row(0, named=True)
    assert out["bare"]["compression_steps"] == out["stored"]["compression_steps"]
    assert out["bare"]["kl_mean"] == pytest.approx(out["stored"]["kl_mean"], rel=1e-4)


def test_beaten_finds_the_segment_and_the_reason_by_hand():
    """Hand-made runs (P = 2, T = 10, compressions at 4 and 7): the rule beats the oracle on prompt a, where its set's
    label is lower at the compression it gains most after (``set``), and on b, where it is not (``state``); on c it
    loses (no row). kl_steps[j] predicts position P + j."""
    from kvdiag.replay.predict import beaten, first_sets

    def run(pid, scorer, kl, joint):
        return {"prompt_id": pid, "scorer": scorer, "budget": 4, "prompt_len": 2, "token_ids": list(range(10)),
                "compression_steps": [4, 7], "compressions": 2, "kl_steps": [float(x) for x in kl],
                "kl_mean": float(np.mean(kl)),
                "joint_kl": joint}

    oracle = [0.0, 0.0, 0.1, 0.1, 0.1, 0.2, 0.2, 0.2]  # segments: [4, 7) = steps 2..4, [7, 10) = steps 5..7
    tf = pl.DataFrame([
        run("a", "oracle_future", oracle, [0.3, 0.4]), run("a", "tova", [0, 0, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05],
                                                           [0.3, 0.2]),
        run("b", "oracle_future", oracle, [0.3, 0.4]), run("b", "tova", [0, 0, 0.0, 0.0, 0.0, 0.2, 0.2, 0.2],
                                                           [0.5, 0.5]),
        run("c", "oracle_future", oracle, [0.3, 0.4]), run("c", "tova", [0, 0, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2],
                                                           [0.1, 0.6]),
    ])
    won = beaten(tf, "oracle_future").sort("prompt_id")
    assert won["prompt_id"].to_list() == ["a", "b"]
    a, b = won.row(0, named=True), won.row(1, named=True)
    assert (a["t"], a["compression"], a["compressions"], a["reason"]) == (7, 2, 2, "set")
    assert a["gain"] == pytest.approx(-0.45) and a["gain_share"] == pytest.approx(1.0)
    assert (a["joint"], a["reference_joint"]) == (0.2, 0.4)
    assert (b["t"], b["compression"], b["reason"]) == (4, 1, "state") and b["gain"] == pytest.approx(-0.3)
    assert first_sets(tf, "oracle_future") == (1, 3)  # only c's first set has the lower label (0.1 < 0.3)
