"""Stored sets and the references that search the rules' own action space (``future_attention``, ``oracle_search``)
on tiny random models, Gemma 3's sliding layers included: every stored set equals physically deleting it."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from kvdiag.core.io import read_table
from kvdiag.decisions import Budget, DecisionsConfig, decide
from kvdiag.decisions.search import mask_gradient
from kvdiag.decisions.sets import mask_set, set_mask, unpack_set
from kvdiag.label import OracleEngine, divergences
from kvdiag.label.reference import reference_set_logprobs
from kvdiag.model.load import load_model
from kvdiag.scorers import checkpoint_keys, score_trace
from tests.conftest import make_trace

HORIZON = 4
RULES = ["attention", "h2o", "streamingllm", "random"]
MODELS = ["tiny:llama", "tiny:qwen3", "tiny:gemma3"]  # gemma3: sliding layers (window 8) between full ones


def config(**kw) -> DecisionsConfig:
    # budget:5 is below a tiny gemma3 sliding layer's 7 visible entries: its window budget binds
    base = dict(budgets=(Budget("keep", 0.5), Budget("keep", 0.25), Budget("budget", 5)), horizon=HORIZON,
                n_boot=20, pairs=0, batch_size=8, selection="per-head", search_rows=64, search_seconds=0,
                references=("fast", "random", "future_attention", "oracle_search"))
    return DecisionsConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=MODELS)
def decided(request, tmp_path_factory):
    """A 1-prompt Trace, head scores at two checkpoints, and the per-head decisions there."""
    lm = load_model(request.param)
    root = tmp_path_factory.mktemp(request.param.replace(":", "_"))
    trace = make_trace(lm, root / "trace", n_prompts=1, max_new_tokens=36)
    pid = trace.prompt_ids[0]
    T = trace.length(pid)
    keys = checkpoint_keys(trace, {pid: [T - HORIZON - 17, T - HORIZON - 1]}, ["head"])
    scores, meta = score_trace(trace, keys=keys, scorers=RULES)
    out = decide(trace, lm, scores, meta, root / "out", config(), show_progress=False)
    return {"lm": lm, "trace": trace, "scores": scores, "meta": meta, "root": root,
            "df": read_table(out / "decisions.parquet")[0]}


def test_sets_round_trip_through_their_mask():
    gen = torch.Generator().manual_seed(0)
    t, L, Hkv = 37, 3, 2
    heads = torch.stack([torch.randperm(t, generator=gen)[:11].sort().values for _ in range(L * Hkv)]).view(L, Hkv, 11)
    assert torch.equal(mask_set(set_mask(heads, L, Hkv, t)), heads)
    ragged = heads.clone()
    ragged[1, 0, 5:] = -1  # a cell that evicts fewer (a sliding layer's): padded with -1
    back = mask_set(set_mask(ragged, L, Hkv, t))
    assert torch.equal(back, ragged[..., : back.shape[-1]]) and back.shape[-1] == 11
    token = torch.tensor([0, 4, 36])
    assert torch.equal(mask_set(set_mask(token, L, Hkv, t)), token.expand(L, Hkv, 3))


def test_every_stored_set_equals_physical_deletion(decided):
    """Each row's stored [L, Hkv, t] mask, deleted per (layer, KV head) by the slow reference (a copied cache, the
    H tokens one at a time, the stock eager attention), gives the row's kl_steps: rtol 1e-4, atol 1e-6 nats (fp32,
    two different attention paths)."""
    trace, lm, df = decided["trace"], decided["lm"], decided["df"]
    pid = trace.prompt_ids[0]
    L, Hkv = trace.num_layers, trace.num_kv_heads
    rows = df.filter(pl.col("status") == "ok")
    assert rows["evicted_mask"].is_not_null().all()
    eng = OracleEngine(lm, trace.token_ids(pid), HORIZON)
    checked = 0
    for row in rows.sort("checkpoint", "decision", "budget").iter_rows(named=True):
        t = row["checkpoint"]
        mask = unpack_set(row["evicted_mask"], L, Hkv, t)
        per_cell = mask.sum(-1)
        assert (per_cell <= t - row["kept"]).all() and per_cell.max() == t - row["kept"], row["decision"]
        prefix, logp_full = eng.golden(t)
        ref = reference_set_logprobs(lm.model, eng.ids, t, HORIZON, prefix, mask_set(mask))
        want = divergences(logp_full, ref[None], eng.ids[t + 1 : t + HORIZON + 1])["kl"][0].double()
        torch.testing.assert_close(torch.tensor(row["kl_steps"], dtype=torch.float64), want, rtol=1e-4, atol=1e-6)
        checked += 1
    assert checked == rows.height >= 2 * 2 * (len(RULES) + 2)


def dense_future(trace, pid: str, t: int, window: int) -> torch.Tensor:
    """[L, Hkv, t]: the attention of the queries t .. t+W-1 on [0, t), written out (repeat_kv, masks by hand)."""
    out = []
    for l in range(trace.num_layers):
        spec, qkv = trace.layer_attention(l), trace.layer(pid, l)
        H, Hkv = qkv.q.shape[0], qkv.k.shape[0]
        k = qkv.k.double().repeat_interleave(H // Hkv, 0)  # query head h reads KV head h // g
        q = qkv.q[:, t : t + window].double()
        logits = q @ k[:, : t + window].transpose(1, 2) * spec.scale  # [H, W, t + W]
        qpos, kpos = torch.arange(t, t + window)[:, None], torch.arange(t + window)[None]
        hide = (kpos > qpos) | ((kpos <= qpos - spec.window) if spec.window is not None else False)
        p = torch.softmax(logits.masked_fill(hide, float("-inf")), -1)[..., :t]
        out.append(p.view(Hkv, H // Hkv, window, t).sum((1, 2)))
    return torch.stack(out)


def test_future_attention_keeps_what_the_future_reads_most(decided):
    """Per (layer, KV head), every kept entry it still sees (a sliding layer: inside its window) draws at least as
    much future attention (written out independently here, fp64 against the stage's fp32 sums: 1e-5 abs) as every
    evicted one."""
    trace, df = decided["trace"], decided["df"]
    pid = trace.prompt_ids[0]
    L, Hkv = trace.num_layers, trace.num_kv_heads
    rows = df.filter((pl.col("decision") == "future_attention") & (pl.col("status") == "ok"))
    assert rows.height == 6 and (rows["kind"] == "reference").all()
    for row in rows.iter_rows(named=True):
        t = row["checkpoint"]
        att = dense_future(trace, pid, t, HORIZON)
        mask = unpack_set(row["evicted_mask"], L, Hkv, t)
        for l in range(L):
            w = trace.layer_attention(l).window
            seen = torch.arange(t) > t - w if w is not None else torch.ones(t, dtype=torch.bool)
            for h in range(Hkv):
                kept, gone = att[l, h][~mask[l, h] & seen], att[l, h][mask[l, h]]
                assert kept.numel() == min(row["kept"], int(seen.sum()))
                if gone.numel():
                    assert kept.min() >= gone.max() - 1e-5, (row["decision"], row["budget"], l, h)


def invariant(df: pl.DataFrame) -> int:
    """oracle_search's joint damage <= every other decision's at each (checkpoint, budget): both sides are exact set
    rows of the same engine, and the search only accepts rows lower than the best candidate's recorded label, so
    1e-12 nats of slack is all the float formatting may take. Returns the comparisons made."""
    n = 0
    for (t, b), g in df.filter(pl.col("status") == "ok").group_by("checkpoint", "budget"):
        best = g.filter(pl.col("decision") == "oracle_search")
        assert best.height == 1, (t, b)
        row = best.row(0, named=True)
        others = g.filter(pl.col("decision") != "oracle_search")
        assert (row["kl_mean"] <= others["kl_mean"] + 1e-12).all(), (t, b, row["kl_mean"], others["kl_mean"].min())
        assert row["search_start"] in others["decision"].to_list()
        start = others.filter(pl.col("decision") == row["search_start"])["kl_mean"][0]
        assert start == others["kl_mean"].min()
        assert row["search_improvement"] == pytest.approx(start - row["kl_mean"], abs=1e-12)
        assert 0 < row["cost_rows"] <= 64 and row["cost_seconds"] > 0
        n += others.height
    return n


def test_oracle_search_is_at_most_every_rule_and_reference(decided):
    df = decided["df"]
    assert invariant(df) >= 2 * 2 * (len(RULES) + 3)
    # it searched: at some (checkpoint, budget) of these models it found a lower set than every candidate
    assert (df.filter(pl.col("decision") == "oracle_search")["search_improvement"] > 0).any()


def test_search_from_starts_from_an_earlier_runs_lowest_set(decided):
    """A run with --search-from the fixture's decisions and no descent step (search_rows 1): at each (checkpoint,
    budget) its oracle_search is the lowest of its own candidates and the earlier run's lowest set (labeled again
    here: the same set and steps through the same engine in another batch, fp32: rtol 1e-4, as against physical
    deletion above); where the earlier search had
    gone below every candidate, that set is the result, bit for bit."""
    from kvdiag.core.errors import UserError

    trace, lm, root, first = decided["trace"], decided["lm"], decided["root"], decided["df"]
    earlier = root / "out" / "decisions.parquet"
    out = decide(trace, lm, decided["scores"], decided["meta"], root / "warm",
                 config(search_rows=1, search_from=(str(earlier),)), show_progress=False)
    df = read_table(out / "decisions.parquet")[0]
    taken = 0
    for (t, b), g in df.filter(pl.col("status") == "ok").group_by("checkpoint", "budget"):
        mine = g.filter(pl.col("decision") == "oracle_search").row(0, named=True)
        was = first.filter((pl.col("checkpoint") == t) & (pl.col("budget") == b))
        searched = was.filter(pl.col("decision") == "oracle_search").row(0, named=True)
        assert mine["kl_mean"] <= g.filter(pl.col("decision") != "oracle_search")["kl_mean"].min() + 1e-12
        assert mine["kl_mean"] <= searched["kl_mean"] * (1 + 1e-4) + 1e-12, (t, b)
        assert mine["cost_rows"] == 0  # no step: the result is a labeled candidate
        if searched["search_improvement"] > 0:  # the earlier search beat every candidate the two runs share
            assert mine["search_start"] == "search_from1:oracle_search", (t, b)
            assert mine["evicted_mask"] == searched["evicted_mask"]
            assert mine["kl_mean"] == pytest.approx(searched["kl_mean"], rel=1e-4, abs=1e-12)
            taken += 1
    assert taken >= 1
    # a set the run could not have made (another budget's, under this budget's name) is refused before any work
    other = first.with_columns(pl.when(pl.col("budget") == "keep:0.25").then(pl.lit("keep:0.5"))
                               .when(pl.col("budget") == "keep:0.5").then(pl.lit("keep:0.25"))
                               .otherwise(pl.col("budget")).alias("budget"))
    from kvdiag.core.io import read_meta, write_table

    write_table(other, root / "swapped.parquet", read_meta(earlier))
    with pytest.raises(UserError, match="swapped.parquet: .* keeps .* where this run's sets keep"):
        decide(trace, lm, decided["scores"], decided["meta"], root / "refused",
               config(search_rows=1, search_from=(str(root / "swapped.parquet"),)), show_progress=False)
    assert not (root / "refused").exists()


def test_oracle_search_under_per_token_selection_stays_a_token_set(decided):
    lm, trace = decided["lm"], decided["trace"]
    if decided["lm"].spec != "tiny:llama":
        pytest.skip("one model is enough for the token action space")
    out = decide(trace, lm, decided["scores"], decided["meta"], decided["root"] / "token",
                 config(selection="per-token"), show_progress=False)
    df = read_table(out / "decisions.parquet")[0]
    invariant(df)
    rows = df.filter(pl.col("decision") == "oracle_search")
    assert rows["evicted_positions"].list.len().to_list() == rows["evicted"].to_list()


def test_the_soft_mask_forward_is_exact_at_a_binary_mask(decided):
    """The gradient's forward at m = 0/1 is the exact set row: its KL equals the engine's label of the set (two
    attention paths in fp32: rtol 1e-4, atol 1e-6), and entries hidden from every query get no gradient."""
    trace, lm, df = decided["trace"], decided["lm"], decided["df"]
    L, Hkv = trace.num_layers, trace.num_kv_heads
    row = df.filter((pl.col("decision") == "attention") & (pl.col("status") == "ok")).row(0, named=True)
    t = row["checkpoint"]
    eng = OracleEngine(lm, trace.token_ids(trace.prompt_ids[0]), HORIZON)
    g, kl, _ = mask_gradient(eng, t, unpack_set(row["evicted_mask"], L, Hkv, t))
    assert kl == pytest.approx(row["kl_mean"], rel=1e-4, abs=1e-6)
    for l in range(L):
        window = trace.layer_attention(l).window
        if window is not None:
            assert (g[l, :, : t - window + 1] == 0).all()
            assert (g[l, :, t - window + 1 :] != 0).any()


def test_reach_is_each_entrys_largest_attention_weight_over_the_kept_entries(decided):
    """``mask_gradient``'s reach: an entry's largest weight over the horizon queries of its KV head's query heads,
    ``e^s / Z`` with ``Z`` over the kept entries, for an evicted entry too. The stored set is evicted in the last layer
    only, so every layer's queries are the full run's; reference: the model's own eager attention over the whole
    sequence, renormalised without the evicted entries in the last layer (``p / (1 - p(evicted))``; the sliding
    window and GQA groups as the model has them). fp32 on two paths, and 1 / (1 - p(evicted)) (up to ~1e3 here)
    scales their rounding: rtol 1e-3, atol 1e-6."""
    trace, lm, df = decided["trace"], decided["lm"], decided["df"]
    L, Hkv = trace.num_layers, trace.num_kv_heads
    row = df.filter((pl.col("decision") == "attention") & (pl.col("status") == "ok")).row(0, named=True)
    t = row["checkpoint"]
    ids = trace.token_ids(trace.prompt_ids[0])
    evicted = torch.zeros(L, Hkv, t, dtype=torch.bool)
    evicted[-1] = unpack_set(row["evicted_mask"], L, Hkv, t)[-1]
    _, _, reach = mask_gradient(OracleEngine(lm, ids, HORIZON), t, evicted)
    model = lm.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            probs = model(ids[None, : t + HORIZON], output_attentions=True).attentions  # per layer [1, Hq, T, T]
    finally:
        model.set_attn_implementation(previous)
    for l in range(L):
        p = probs[l][0, :, t : t + HORIZON, :t].double()  # [Hq, H, t]
        g = p.shape[0] // Hkv
        lost = (p * evicted[l].repeat_interleave(g, 0)[:, None, :]).sum(-1, keepdim=True)
        want = (p / (1 - lost)).view(Hkv, g, HORIZON, t).amax((1, 2))
        torch.testing.assert_close(reach[l], want, rtol=1e-3, atol=1e-6)
    assert evicted[-1].any() and (reach[-1][evicted[-1]] > 0).any()
    assert (reach[-1] > 1).any()  # a renormalised weight the rest no longer bounds (an evicted entry's)


class ScriptedEngine:
    """Labels every set with ``kl`` (the engine's exact row, scripted); counts the rows."""

    def __init__(self, kl: float):
        self.kl, self.rows = kl, 0

    def label_sets(self, t, sets):
        self.rows += len(sets)
        kl = torch.full((len(sets), 1), self.kl, dtype=torch.float64)
        return {"kl": kl, "js": kl, "nll_delta": kl, "flips": torch.zeros(len(sets))}, 0.0


def no_reconstruction(engine, t, start, movable):
    """The reconstruction start (tested on its own) left out: the scripted tests drive the descent from their start."""
    return start.clone()


def scripted_gradient(monkeypatch, g, kls, reach=None, seen=None):
    """``mask_gradient`` returning ``g`` and ``reach`` every step and the next of ``kls`` as the set's KL; the masks it
    was called with go to ``seen``."""
    from kvdiag.decisions import search as S

    kls = iter(kls)

    def gradient(engine, t, evicted):
        if seen is not None:
            seen.append(evicted.clone())
        return g, next(kls), torch.zeros_like(g) if reach is None else reach

    monkeypatch.setattr(S, "mask_gradient", gradient)
    monkeypatch.setattr(S, "reconstruction_set", no_reconstruction)


def test_a_step_evicts_each_cells_lowest_scores_and_leaves_large_reach_kept_entries_alone(monkeypatch):
    """``search``'s descent: scores +1 kept / -1 evicted move by -0.1 x a momentum (0.9) of g / max |g|; each set
    evicts per cell as many entries as the start, the lowest-scoring; a kept entry of reach > ``REACH`` gets no push
    from its own gradient; entries no query sees keep their status. Cell 0: entries 0-3 evicted, 4-7 kept; dropping 4
    looks best but its reach is 0.9; restoring 3 looks best but 3 is not visible. Restoring 0 (g -1) and dropping 5
    (g 0.8) cross when 0.1 S (1 + 0.8) > 2, S the summed momenta 1, 2.9, 5.61, 9.05, 13.2: after step 5, so the
    sixth set is the first to differ, by exactly that swap. Cell 1 (g 0) never moves. The result: the best set the
    steps labeled, relabeled exactly, if lower than the start."""
    from kvdiag.decisions import search as S

    start = torch.tensor([True] * 4 + [False] * 4).expand(2, 1, 8).clone()  # [L=2, Hkv=1, t=8]
    g = torch.zeros(2, 1, 8, dtype=torch.float64)
    g[0, 0] = torch.tensor([-1.0, -0.5, -0.2, -3.0, 2.0, 0.8, 0.1, 0.0])
    reach = torch.zeros_like(g)
    reach[0, 0, 4] = 0.9
    visible = torch.ones(2, 8, dtype=torch.bool)
    visible[0, 3] = False
    seen: list[torch.Tensor] = []
    # the start's label 1.0; the steps' KLs: the sixth set (the swap) is the lowest
    cands = [S.Candidate("rule", start, {"kl": torch.tensor([1.0])})]
    for exact, accepted in ((0.5, True), (1.5, False)):
        seen.clear()
        scripted_gradient(monkeypatch, g, [1.0, 1.0, 1.0, 1.0, 1.0, 0.4, 0.6], reach, seen)
        engine = ScriptedEngine(exact)
        found = S.search(engine, 8, cands, per_token=False, rows=8, seconds=0, visible=visible)
        assert len(seen) == 7 and all(torch.equal(m, start) for m in seen[:5])
        swapped = start.clone()
        swapped[0, 0, 0], swapped[0, 0, 5] = False, True
        assert torch.equal(seen[5], swapped) and (seen[6].sum(-1) == 4).all() and bool(seen[6][0, 0, 3])
        assert all(torch.equal(m[1], start[1]) and not bool(m[0, 0, 4]) for m in seen)
        assert [h[0] for h in found.history] == list(range(8)) and [h[2] for h in found.history][-2:] == [0.4, 0.4]
        assert engine.rows == 1 and found.rows == 8  # 7 steps and the exact row of the best (the sixth set)
        assert torch.equal(found.mask, swapped if accepted else start)
        assert float(found.label["kl"].mean()) == (exact if accepted else 1.0) and found.start == "rule"


def test_a_token_set_moves_as_one_cell(monkeypatch):
    """Per-token: the descent's one cell takes the gradient summed over the (layer, KV head) cells, and its set is the
    same in every cell. Tokens 0-1 evicted; restoring 0 (g -1 in one cell) and dropping 3 (g 1 in another) cross when
    0.2 S > 2: after step 5, so the sixth set is the first to differ."""
    from kvdiag.decisions import search as S

    start = torch.tensor([True] * 2 + [False] * 2).expand(3, 2, 4).clone()
    g = torch.zeros(3, 2, 4, dtype=torch.float64)
    g[0, 0, 0], g[2, 1, 3] = -1.0, 1.0
    seen: list[torch.Tensor] = []
    scripted_gradient(monkeypatch, g, [1.0] * 5 + [0.5] + [0.6] * 6, seen=seen)
    found = S.search(ScriptedEngine(0.5), 4, [S.Candidate("rule", start, {"kl": torch.tensor([2.0])})], True,
                     rows=13, seconds=0, visible=torch.ones(3, 4, dtype=torch.bool))
    want = torch.tensor([False, True, False, True]).expand(3, 2, 4)
    assert len(seen) == 12 and all(torch.equal(m, start) for m in seen[:5]) and torch.equal(seen[5], want)
    assert all(torch.equal(m, m[0, 0].expand(3, 2, 4)) for m in seen)  # a token set: every cell the same
    assert torch.equal(found.mask, want) and found.rows == 13


def test_a_sliding_layers_budget_counts_only_what_it_still_sees(decided):
    """Gemma 3's sliding layers (window 8): every per-head set evicts only entries the layer's queries still see and
    keeps min(B, visible) of them (oracle_search: at most B); full layers keep B of [0, t)."""
    trace, df = decided["trace"], decided["df"]
    L, Hkv = trace.num_layers, trace.num_kv_heads
    windows = [trace.layer_attention(l).window for l in range(L)]
    if all(w is None for w in windows):
        pytest.skip("no sliding layer")
    binds = 0
    for row in df.filter(pl.col("status") == "ok").iter_rows(named=True):
        t, B = row["checkpoint"], row["kept"]
        mask = unpack_set(row["evicted_mask"], L, Hkv, t)
        for l, w in enumerate(windows):
            seen = torch.arange(t) > t - w if w is not None else torch.ones(t, dtype=torch.bool)
            assert not (mask[l][:, ~seen]).any(), (row["decision"], l)
            kept = (~mask[l] & seen).sum(-1)
            if row["decision"] == "oracle_search":
                assert (kept <= B).all(), (row["decision"], l)
            else:
                assert (kept == min(B, int(seen.sum()))).all(), (row["decision"], row["budget"], l, kept)
                binds += w is not None and B < int(seen.sum()) and bool(mask[l].any())
    assert binds > 0  # some sliding layer evicted inside its window


def test_summary_states_the_headroom_against_oracle_search(decided):
    """Per budget: best rule / oracle_search per prompt (geometric mean with its CI, median, wins: none, by
    construction), the exact sign test, every rule's own ratio, the search's effort; references labeled by space."""
    from kvdiag.decisions.summary import summarize_files

    if decided["lm"].spec != "tiny:llama":
        pytest.skip("one model is enough for the summary")
    out = decided["root"] / "out"
    res = summarize_files(out)
    head = pl.read_csv(out / "headroom.csv")
    assert set(head["rule"]) == set(RULES) and head["best"].sum() == 3  # one best rule per budget
    assert (head["ratio_below_one"] == 0).all() and (head["ratio_geomean"] >= 1 - 1e-12).all()
    assert (head["test"] == "sign").all() and (head["n"] == 2).all() and (head["ratio_dropped"] == 0).all()
    assert head["budget"].unique(maintain_order=True).to_list() == ["keep:0.5", "keep:0.25", "budget:5"]
    assert (head["diff_ci_low"] <= head["diff"]).all() and (head["diff"] > 0).all()  # the search does less damage
    for budget, h in res["headline"]["budgets"].items():
        c = h["search_headroom"]
        assert c["a"] == h["best_rule"] and c["b"] == "oracle_search" and c["ratios"]["below"] == 0, budget
        assert h["space"] == "per-head"
    cost = pl.read_csv(out / "search.csv")
    assert cost.height == 3 and (cost["rows_median"] <= 64).all()
    text = (out / "summary.md").read_text()
    assert "## Headroom against oracle_search" in text and "chosen (least mean damage) on these same" in text
    assert "| rule | geometric mean [CI] | median | rule wins | p |" in text
    assert "oracle_search (ref) [per-head]" in text and "future_attention (ref) [per-head]" in text


def test_bench_decisions_reports_rows_seconds_and_improvement(tmp_path):
    """``kvdiag bench decisions`` on tiny:llama: per budget and effort, at most the rows allowed, never worse than the
    best candidate (the same exact rows on both sides: 1e-12 nats), the candidates it started from, the reconstruction
    start's label."""
    from kvdiag.cli.main import main

    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exc:
        main(["bench", "decisions", "--model", "tiny:llama", "--prefix", "40", "--horizon", "4", "--keep", "0.5,0.25",
              "--search-rows", "24", "--scale", "2", "--out", str(out)])
    assert exc.value.code in (0, None)
    import json

    res = json.loads(out.read_text())
    assert [(r["keep"], r["effort"]) for r in res["rows"]] == [(0.5, 1), (0.5, 2), (0.25, 1), (0.25, 2)]
    for r in res["rows"]:
        assert 0 < r["rows"] <= r["rows_limit"] == 24 * r["effort"]
        assert r["kl"] <= min(r["candidates"].values()) + 1e-12 and r["start_kl"] == min(r["candidates"].values())
        assert {"fast", "future_attention", "snapkv"} <= set(r["candidates"])
        assert r["improvement"] == pytest.approx(r["start_kl"] - r["kl"], abs=1e-12) and r["improvement"] >= 0
        # its curve: one entry per step, steps and seconds rising, the label never rising, ending at the result: its
        # steps, and the exact row of the best set when a step found one other than the start (a result below the
        # start always has it; a relabel refused within rounding spends it too); the steps' labels are the soft-mask
        # forward's, the result's the engine's (two fp32 attention paths: rel 1e-4, abs 1e-6, as the exactness test)
        rows, seconds, kl = zip(*r["history"], strict=True)
        assert rows[0] == 0 and kl[0] == r["start_kl"]  # the same tensor, the same mean
        assert r["rows"] - rows[-1] in (0, 1) and r["rows"] <= r["rows_limit"]
        # the reconstruction start is the first row (per-head), its exact label the curve's there; a result that is
        # that set itself needs no exact row at the end
        assert rows[1] == 1 and kl[1] == min(r["start_kl"], r["reconstruction_kl"])
        assert r["rows"] - rows[-1] == 1 or r["kl"] in (r["start_kl"], r["reconstruction_kl"])
        assert kl[-1] == pytest.approx(r["kl"], rel=1e-4, abs=1e-6)
        assert list(rows) == sorted(set(rows)) and list(seconds) == sorted(seconds) and list(kl) == sorted(kl)[::-1]
        assert r["quarters"][-1]["rows"] == rows[-1] and r["quarters"][-1]["gain"] is None


def test_quarters_gives_the_label_at_each_4x_step_of_the_rows():
    """``quarters``: the best label after R, R/4, R/16, ... rows (the last batch at or below each), down to the first
    batch, with what the 4x more rows after each took off it: the convergence rule's figure at every step."""
    from kvdiag.decisions.bench import quarters

    history = [(0, 0.0, 1.0), (4, 1.0, 0.8), (8, 2.0, 0.5), (16, 4.0, 0.4), (32, 8.0, 0.3), (64, 16.0, 0.2)]
    got = quarters(history)
    assert [(q["rows"], q["kl"]) for q in got] == [(4, 0.8), (16, 0.4), (64, 0.2)]
    assert got[0]["gain"] == pytest.approx(0.5) and got[1]["gain"] == pytest.approx(0.5) and got[2]["gain"] is None
    assert got[1]["seconds"] == 4.0
    # R/4 between batches: the last batch at or below it (rows 8 for 40 / 4 = 10); below the first batch, no entry
    got = quarters([(0, 0.0, 1.0), (8, 1.0, 0.6), (24, 3.0, 0.5), (40, 5.0, 0.45)])
    assert [(q["rows"], q["kl"]) for q in got] == [(8, 0.6), (40, 0.45)]
    assert got[0]["gain"] == pytest.approx(0.25)
    assert quarters([(0, 0.0, 1.0)]) == [{"rows": 0, "seconds": 0.0, "kl": 1.0, "gain": None}]


def test_cli_runs_both_references_with_a_window_to_the_end(decided):
    """``kvdiag decisions --references future_attention,oracle_search --future-window rest``: both rows at every
    (checkpoint, budget), the settings recorded, future_attention reading every later query of the prompt."""
    from kvdiag.cli.main import main
    from kvdiag.core.io import read_json, write_table
    from kvdiag.decisions.sets import head_label_set

    if decided["lm"].spec != "tiny:llama":
        pytest.skip("one model is enough for the CLI")
    root, trace = decided["root"], decided["trace"]
    scores = write_table(decided["scores"], root / "scores.parquet", decided["meta"])
    out = root / "cli"
    with pytest.raises(SystemExit) as exc:
        main(["decisions", "--trace", str(trace.path), "--scores", str(scores), "--keep", "0.25", "--horizon",
              str(HORIZON), "--references", "future_attention,oracle_search", "--future-window", "rest",
              "--search-rows", "16", "--search-seconds", "30", "--pairs", "0", "--bootstrap", "20", "--quiet",
              "--out", str(out)])
    assert exc.value.code in (0, None)
    df = read_table(out / "decisions.parquet")[0]
    refs = df.filter(pl.col("kind") == "reference")
    assert sorted(set(refs["decision"])) == ["future_attention", "oracle_search"] and refs.height == 4
    cfg = read_json(out / "config.json")["config"]
    assert cfg["future_window"] == "rest" and cfg["search_rows"] == 16 and cfg["search_seconds"] == 30
    assert (refs.filter(pl.col("decision") == "oracle_search")["cost_rows"] <= 16).all()
    pid = trace.prompt_ids[0]
    L, Hkv = trace.num_layers, trace.num_kv_heads
    for row in refs.filter(pl.col("decision") == "future_attention").iter_rows(named=True):
        t = row["checkpoint"]
        rest = trace.length(pid) - t
        assert rest > HORIZON
        att = dense_future(trace, pid, t, rest)  # every later query, written out (fp64 against fp32: 1e-5)
        mask = unpack_set(row["evicted_mask"], L, Hkv, t)
        for l in range(L):
            for h in range(Hkv):
                assert att[l, h][~mask[l, h]].min() >= att[l, h][mask[l, h]].max() - 1e-5, (t, l, h)
        horizon_only = dense_future(trace, pid, t, HORIZON)
        assert not torch.equal(mask_set(mask), head_label_set(horizon_only, row["kept"]))  # the window mattered


def test_oracle_search_without_any_labeled_candidate_says_so(decided):
    """Every rule over the budget (--infeasible skip) and no other reference: oracle_search has nothing to start from
    and records ``no_candidate`` with no label, not a made-up set."""
    if decided["lm"].spec != "tiny:llama":
        pytest.skip("one model is enough")
    cfg = config(budgets=(Budget("budget", 1),), references=("oracle_search",), infeasible="skip",
                 rules=("streamingllm",))
    out = decide(decided["trace"], decided["lm"], decided["scores"], decided["meta"], decided["root"] / "none", cfg,
                 show_progress=False)
    df = read_table(out / "decisions.parquet")[0]
    assert set(df.filter(pl.col("decision") == "streamingllm")["status"]) == {"over_budget"}
    found = df.filter(pl.col("decision") == "oracle_search")
    assert found.height == 2 and set(found["status"]) == {"no_candidate"} and found["kl_mean"].is_null().all()


def test_cli_horizon_rest_with_both_references(decided):
    """``--horizon rest`` (#42) with future_attention and oracle_search (#41): each row's horizon is T - t, the
    search's gradient runs over those steps, and future_attention's default window (the horizon) reads every later
    query of the prompt, as ``--future-window rest`` does."""
    from kvdiag.cli.main import main
    from kvdiag.core.io import write_table

    if decided["lm"].spec != "tiny:llama":
        pytest.skip("one model is enough for the CLI")
    root, trace = decided["root"], decided["trace"]
    scores = write_table(decided["scores"], root / "scores-rest.parquet", decided["meta"])
    masks = {}
    for name, extra in (("rest", []), ("window", ["--future-window", "rest"])):
        with pytest.raises(SystemExit) as exc:
            main(["decisions", "--trace", str(trace.path), "--scores", str(scores), "--keep", "0.25", "--horizon",
                  "rest", *extra, "--references", "future_attention,oracle_search", "--search-rows", "8",
                  "--search-seconds", "30", "--pairs", "0", "--bootstrap", "20", "--quiet", "--out",
                  str(root / f"cli-{name}")])
        assert exc.value.code in (0, None)
        df = read_table(root / f"cli-{name}" / "decisions.parquet")[0]
        pid = trace.prompt_ids[0]
        assert (df["horizon"] == trace.length(pid) - df["checkpoint"]).all()
        refs = df.filter(pl.col("kind") == "reference")
        assert sorted(set(refs["decision"])) == ["future_attention", "oracle_search"]
        masks[name] = refs.filter(pl.col("decision") == "future_attention").sort("checkpoint")["evicted_mask"]
    assert masks["rest"].to_list() == masks["window"].to_list()


def test_a_read_window_is_judged_on_the_steps_it_did_not_read(decided):
    """--read-window 2 of a judged window of 4: the references choose on steps 0-1 (oracle_search searches there,
    fast and future_attention read there), every set is judged on all 4 steps, and the steps 2-3 it did not read
    equal physical deletion (rtol 1e-4, atol 1e-6 nats, as above) — on each model, Gemma 3's sliding layers
    included. The summary's held-out table is those steps' means, per prompt."""
    from kvdiag.decisions.summary import held_out_pairs, summarize_files, windows

    lm, trace = decided["lm"], decided["trace"]
    read = 2
    out = decide(trace, lm, decided["scores"], decided["meta"], decided["root"] / "read2", config(read_window=read),
                 show_progress=False)
    df = read_table(out / "decisions.parquet")[0].filter(pl.col("status") == "ok")
    refs = ("fast", "future_attention", "oracle_search")
    assert set(df.filter(pl.col("decision").is_in(refs))["read_steps"]) == {read}
    assert set(df.filter(~pl.col("decision").is_in(refs))["read_steps"]) == {0}  # rules and random read the past
    assert set(df["kl_steps"].list.len()) == {HORIZON}
    pid = trace.prompt_ids[0]
    L, Hkv = trace.num_layers, trace.num_kv_heads
    eng = OracleEngine(lm, trace.token_ids(pid), HORIZON)
    for row in df.filter(pl.col("decision").is_in(refs)).iter_rows(named=True):
        t = row["checkpoint"]
        prefix, logp_full = eng.golden(t)
        mask = unpack_set(row["evicted_mask"], L, Hkv, t)
        ref = reference_set_logprobs(lm.model, eng.ids, t, HORIZON, prefix, mask_set(mask))
        want = divergences(logp_full, ref[None], eng.ids[t + 1 : t + HORIZON + 1])["kl"][0].double()
        torch.testing.assert_close(torch.tensor(row["kl_steps"][read:], dtype=torch.float64), want[read:],
                                   rtol=1e-4, atol=1e-6)
    # on the steps it read, the search is at most every candidate (it searched there; its set was relabelled on the
    # whole window, so the first steps are compared within the relabelling's rounding: rtol 1e-5, atol 1e-9)
    split = windows(df)
    for (t, b), g in split.group_by("checkpoint", "budget"):
        found = g.filter(pl.col("decision") == "oracle_search")["kl_read"].item()
        assert found <= g["kl_steps"].list.head(read).list.mean().min() * (1 + 1e-5) + 1e-9, (t, b)
    res = summarize_files(out)
    held = res["held_out"]
    assert held.height and set(held["reference"]) == set(refs)
    row = held.filter((pl.col("reference") == "oracle_search") & (pl.col("budget") == "keep:0.5")
                      & (pl.col("rule") == "h2o")).row(0, named=True)
    p = held_out_pairs(windows(df), "h2o", "oracle_search", "keep:0.5")
    ratio = (p["x_held"] / p["y_held"]).log().mean()  # one prompt: the geometric mean of its checkpoints' ratios
    assert row["held_out_ratio_geomean"] == pytest.approx(float(np.exp(ratio)), rel=1e-9)
    assert row["n"] == p.height == 2 and row["read_steps_median"] == read
    assert "## In-window and held out" in (out / "summary.md").read_text()


def test_the_search_stops_once_4x_the_steps_gain_under_1_percent(monkeypatch):
    """``search``: after each step from ``WARMUP`` on, converged when the best label after a quarter of the steps,
    less the best now, is under 1 % of it; with ``stop`` it then takes no more steps, without it (the bench's scaled
    run) it goes on to its rows. Scripted KLs: 0.9 at the first step, 0.5 from step 16 (a quarter of 64), 0.499 from
    step 20: at step 64 the steps since 16 took 0.2 % off."""
    from kvdiag.decisions import search as S

    kls = [0.9] * 15 + [0.5] * 4 + [0.499] * 200
    g = torch.linspace(-1, 1, 8, dtype=torch.float64).view(1, 1, 8)
    start = torch.tensor([True] * 4 + [False] * 4).view(1, 1, 8)
    cands = [S.Candidate("rule", start, {"kl": torch.tensor([1.0])})]
    for stop, steps in ((True, S.WARMUP), (False, 99)):
        scripted_gradient(monkeypatch, g, kls)
        found = S.search(ScriptedEngine(0.499), 8, cands, False, rows=100, seconds=0,
                         visible=torch.ones(1, 8, dtype=torch.bool), stop=stop)
        assert found.converged and found.history[-1][0] == steps
        assert S.after(found.history, S.WARMUP / 4)[2] == 0.5 and (0.5 - 0.499) < S.CONVERGED * 0.5
    # 0.9 -> 0.5 between steps 15 and 16: at step 63 the label at 15 (0.9) is 80 % higher; before WARMUP never judged
    scripted_gradient(monkeypatch, g, [0.9] * 15 + [0.5] * 200)
    found = S.search(ScriptedEngine(0.5), 8, cands, False, rows=64, seconds=0,
                     visible=torch.ones(1, 8, dtype=torch.bool))
    assert not found.converged and found.history[-1][0] == 63
    # nothing below the start's own label through the steps' forward (its first step; the engine's start label 1.0
    # is another path, here 1e-3 above it), or only within rounding (1e-7 of 0.999): no gain either, but a search
    # that found nothing has not converged; it spends its rows
    for kls in ([0.999] * 200, [0.999] + [0.999 - 1e-7] * 199):
        scripted_gradient(monkeypatch, g, kls)
        found = S.search(ScriptedEngine(0.999), 8, cands, False, rows=100, seconds=0,
                         visible=torch.ones(1, 8, dtype=torch.bool))
        assert not found.converged and found.history[-1][0] == 99 and S._gain(found.history, 99) < S.CONVERGED


def test_no_step_is_taken_once_the_seconds_ran_out(monkeypatch):
    """``search``: no new step after its seconds. A fake clock whose every gradient takes one second; 2.5 seconds:
    steps at 0, 1 and 2 s, none at 3 s; the best set the steps found is then labeled exactly (one more row)."""
    from types import SimpleNamespace

    from kvdiag.decisions import search as S

    clock = [0.0]
    monkeypatch.setattr(S, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    L, t = 4, 8
    g = torch.linspace(-1, 1, L * t, dtype=torch.float64).view(L, 1, t)
    calls = []

    def gradient(engine, t, evicted):
        clock[0] += 1.0
        calls.append(evicted.clone())
        return g, 1.0, torch.zeros_like(g)

    monkeypatch.setattr(S, "mask_gradient", gradient)
    monkeypatch.setattr(S, "reconstruction_set", no_reconstruction)
    start = torch.zeros(L, 1, t, dtype=torch.bool)
    start[:, 0, :2] = True
    found = S.search(ScriptedEngine(2.0), t, [S.Candidate("best", start, {"kl": torch.tensor([1.0])})],
                     per_token=False, rows=1000, seconds=2.5, visible=torch.ones(L, t, dtype=torch.bool))
    assert len(calls) == 3 and found.rows == 3 and found.start == "best" and not found.converged
    assert torch.equal(found.mask, start)  # no step's set was lower than the start: nothing to relabel
