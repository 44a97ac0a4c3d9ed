"""kvdiag replay: bounded-cache decoding equals the model where it must, stays in budget, keeps absolute
positions, teacher-forces with zero KL when nothing is evicted, and refuses bad input (exit 2)."""

from __future__ import annotations

from contextvars import ContextVar

import polars as pl
import pytest
import torch
from transformers import AttentionInterface, GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from kvdiag.generate import PositionedLayer
from kvdiag.generate.live import live_scorer_names, top_slots
from kvdiag.model.attention import attn_implementation
from kvdiag.replay import (
    Policy,
    ReplaySettings,
    check_answer,
    decode,
    full_logprobs,
    kl_steps,
    make_scorer,
    prompt_chunks,
    replay,
    score_layer,
    select_keep,
    teacher_force,
)
from kvdiag.scorers import ScoreContext, get_scorer
from kvdiag.scorers.context import live_attention
from kvdiag.scorers.normalization import percentile_rank

PROMPT = list(range(40, 70))  # 30 byte tokens


def policy(name="rkv", budget=12, interval=6, selection="per-head", **params):
    return Policy(make_scorer(name, params), budget, interval, selection)


# --------------------------------------------------------------------------- equivalences with the plain model


@pytest.mark.parametrize("name", ["rkv", "avokv_e"])
def test_budget_covering_the_sequence_equals_greedy_generate(tiny_model, name):
    model = tiny_model.model
    ids = torch.tensor([PROMPT])
    cfg = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0].tolist()
    got = decode(tiny_model, PROMPT, policy(name, budget=len(want), interval=4), max_new_tokens=40)
    assert got.token_ids == want
    assert got.compressions == [] and got.stop == "max_new_tokens"
    assert decode(tiny_model, PROMPT, None, max_new_tokens=40).token_ids == want


@pytest.mark.parametrize("selection", ["per-head", "per-token"])
def test_cache_never_exceeds_budget_plus_interval(tiny_llama, monkeypatch, selection):
    seen = []
    update = PositionedLayer.update

    def counting(self, *args, **kwargs):  # what the attention of every forward really reads
        out = update(self, *args, **kwargs)
        seen.append(out[0].shape[-2])
        return out

    monkeypatch.setattr(PositionedLayer, "update", counting)
    prompt = list(range(40, 110))  # 70 tokens > budget + interval: chunked prefill
    pol = policy("attention", budget=16, interval=8, selection=selection)
    run = decode(tiny_llama, prompt, pol, max_new_tokens=50, keep_history=True)
    assert max(seen) == 16 + 8 and run.peak_kv == 16 + 8
    assert prompt_chunks(70, pol) == [(0, 24), (24, 32), (32, 40), (40, 48), (48, 56), (56, 64), (64, 70)]
    assert run.compressions == [24, 32, 40, 48, 56, 64, 70] + list(range(78, 70 + 50, 8))
    assert all(kept.shape == (2, 2, 16) for _, kept in run.kept)
    seen.clear()
    teacher_force(tiny_llama, run.token_ids, 70, pol)
    assert max(seen) == 16 + 8


# per-layer, per-query-head visibility masks for the reference forward of test_positions_stay_absolute
_MASKS: ContextVar[torch.Tensor | None] = ContextVar("test_replay_masks", default=None)


def _masked_sdpa(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, _MASKS.get()[module.layer_idx][None], **kwargs)


AttentionInterface.register("test_replay_masked", _masked_sdpa)
AttentionMaskInterface.register("test_replay_masked", lambda *args, **kwargs: None)


def reference_logprobs(lm, run, position_ids: torch.Tensor) -> torch.Tensor:
    """One full forward of the run's tokens in which every query sees exactly what the replay's cache held
    (the survivors of the last compaction, per layer and KV head, plus everything fed since); log-probs of the
    generated positions."""
    cfg = lm.model.config
    L, Hkv, g = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    T = len(run.token_ids) - 1
    visible = torch.ones(T, T, dtype=torch.bool).tril().expand(L, Hkv, T, T).clone()
    for c, kept in run.kept:  # queries at positions >= c no longer see the keys < c that were evicted
        survivors = torch.zeros(L, Hkv, c, dtype=torch.bool).scatter_(-1, kept, True)
        visible[:, :, c:, :c] &= survivors[:, :, None, :]
    token = _MASKS.set(visible.repeat_interleave(g, dim=1))
    try:
        with attn_implementation(lm.model, "test_replay_masked"), torch.no_grad():
            logits = lm.model(
                torch.tensor([run.token_ids[:T]]), position_ids=position_ids[None], use_cache=False
            ).logits[0]
    finally:
        _MASKS.reset(token)
    return torch.log_softmax(logits[run.prompt_len - 1 :].float(), dim=-1)


@pytest.mark.parametrize("selection", ["per-head", "per-token"])
def test_positions_stay_absolute(tiny_model, selection):
    run = decode(tiny_model, PROMPT, policy("knorm", budget=12, interval=6, selection=selection), max_new_tokens=30,
                 keep_logprobs=True, keep_history=True)
    assert len(run.compressions) >= 4
    if selection == "per-head":  # the heads really hold different positions
        assert any(not torch.equal(kept[:, 0], kept[:, 1]) for _, kept in run.kept)
    T = len(run.token_ids) - 1
    absolute = reference_logprobs(tiny_model, run, torch.arange(T))
    assert torch.allclose(run.logprobs, absolute, atol=2e-4)
    # what transformers' default (cache length) positions would have done: renumber after each eviction
    renumbered = reference_logprobs(tiny_model, run, torch.tensor(run.active[:T]) - 1)
    assert (run.logprobs - renumbered).abs().max() > 0.1


def test_teacher_forced_noop_kl_is_zero_and_evictions_show(tiny_llama):
    ids = decode(tiny_llama, PROMPT, None, max_new_tokens=60).token_ids
    full = full_logprobs(tiny_llama.model, ids, len(PROMPT))
    noop = teacher_force(tiny_llama, ids, len(PROMPT), policy("rkv", budget=len(ids), interval=8))
    assert noop.compressions == [] and full.shape == noop.logprobs.shape == (60, 259)
    assert kl_steps(full, noop.logprobs).abs().max() <= 1e-6
    squeezed = teacher_force(tiny_llama, ids, len(PROMPT), policy("rkv", budget=24, interval=8))
    assert squeezed.compressions == list(range(len(PROMPT), len(ids) - 1, 8))  # the prompt end, then every 8
    kl = kl_steps(full, squeezed.logprobs)
    # step 0 comes from the prompt's last query, before the first compaction; every later one reads a compacted cache
    assert kl[0].abs() <= 1e-6 and kl[1:].min() > 0 and kl.mean() > 1e-3


def test_teacher_forcing_a_generation_reproduces_its_distributions(tiny_qwen3):
    pol = policy("avokv_e", budget=20, interval=5, w_obs=4, w_delay=8)
    run = decode(tiny_qwen3, PROMPT, pol, max_new_tokens=30, keep_logprobs=True)
    forced = teacher_force(tiny_qwen3, run.token_ids, len(PROMPT), pol)
    assert forced.compressions == run.compressions
    assert torch.allclose(forced.logprobs, run.logprobs, atol=1e-4)


# --------------------------------------------------------------------------- live scoring and selection


@pytest.mark.parametrize("name", ["attention", "attention_x_age", "snapkv", "tova", "streamingllm", "rkv", "knorm",
                                  "value_norm", "random", "avokv_e", "avokv_e_no_delay"])
def test_live_context_over_the_full_cache_equals_the_trace_scorer(name):
    gen = torch.Generator().manual_seed(0)
    t, w = 60, 40
    q, k, v = (
        torch.randn(4, t, 8, generator=gen), torch.randn(2, t, 8, generator=gen), torch.randn(2, t, 8, generator=gen),
    )
    scorer = get_scorer(name)
    full = scorer.scores(ScoreContext(q, k, v, 0.3, 20, layer=1, prompt_id="p"))
    live = scorer.scores(
        ScoreContext(q[:, t - w :], k, v, 0.3, 20, layer=1, prompt_id="p", positions=torch.arange(t), checkpoint=t)
    )
    assert torch.allclose(full, live, atol=1e-6)


@pytest.mark.parametrize("name, params", [("rkv", {}), ("snapkv", {}), ("attention_x_age", {}),
                                          ("avokv_e", {"payload": "wo_l2", "w_delay": 40})])
def test_per_head_contexts_equal_the_layer_context(name, params):
    """One context per KV head (its query group, its o_proj columns) scores as the whole layer does when the
    heads hold the same positions."""
    gen = torch.Generator().manual_seed(2)
    n, w, d = 50, 32, 8
    k, v, q = (
        torch.randn(2, n, d, generator=gen), torch.randn(2, n, d, generator=gen), torch.randn(4, w, d, generator=gen),
    )
    positions = torch.sort(torch.randperm(90, generator=gen)[:n]).values.expand(2, n)
    args = (k, v, positions, q, 90, 0.3, 10, 0, "p", torch.arange(90))
    o_proj = torch.randn(16, 4 * d, generator=gen)
    scorer = make_scorer(name, params)
    per_head = score_layer(scorer, *args, "per-head", o_proj)
    assert torch.allclose(per_head, score_layer(scorer, *args, "per-token", o_proj), atol=1e-5)


def test_live_attention_is_causal_by_absolute_position():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, 3, 8, generator=gen), torch.randn(2, 10, 8, generator=gen)
    keep = torch.tensor([0, 2, 5, 7, 8, 9])
    got = live_attention(q, k[:, keep], keep, 10, 0.5)  # queries at 7, 8, 9
    logits = (q.reshape(2, 6, 8) @ k.transpose(1, 2)).reshape(4, 3, 10) * 0.5
    hidden = ~torch.isin(torch.arange(10), keep)[None, :] | (torch.arange(10)[None, :] > torch.arange(7, 10)[:, None])
    want = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)[:, :, keep]
    assert torch.allclose(got, want, atol=1e-6)
    assert got[:, 0, keep > 7].abs().max() == 0  # the query at 7 does not see 8 and 9


def test_selection_per_head_and_per_token():
    assert top_slots(torch.tensor([3.0, 1.0, 3.0, 2.0, 3.0]), 2).tolist() == [2, 4]  # ties keep the newer
    layer0 = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    layer1 = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 2.0, 3.0]])
    per_head = select_keep([layer0, layer1], 2, "per-head")
    assert per_head.tolist() == [[[0, 1], [2, 3]], [[1, 2], [1, 3]]]
    # per-row ranks (r - 1) / 3, entry 0: 1 + 0 + 0 + 0; 1: 2/3 + 1/3 + 1 + 1; 2: 1/3 + 2/3 + 2/3 + 1/3; 3: 0 + 1 + 1/3
    # + 2/3
    ranks = torch.stack([percentile_rank(x) for x in (layer0, layer1)]).mean(dim=(0, 1))
    assert torch.allclose(ranks, torch.tensor([1 / 4, 3 / 4, 1 / 2, 1 / 2]))
    per_token = select_keep([layer0, layer1], 2, "per-token")  # entry 1, then the newer of the tied 2 and 3
    assert per_token.tolist() == [[[1, 3]] * 2] * 2


def test_history_scorers_are_not_live():
    live = live_scorer_names()
    assert {"rkv", "attention", "avokv_e", "snapkv", "tova"} <= set(live)
    assert not {"h2o", "lazyeviction", "thinkv", "vatp"} & set(live)  # vatp's default base is h2o


def test_check_answer():
    assert check_answer("so \\boxed{42}.", "42") is True
    assert check_answer("so \\boxed{41}.", "42") is False
    assert check_answer("anything", None) is None


# --------------------------------------------------------------------------- the command


def test_replay_outputs_and_resume(tiny_llama, tmp_path):
    from kvdiag.tasks.prompts import load_prompts

    settings = ReplaySettings(scorers=["rkv", "attention"], budgets=[96, 48], interval=16, max_new_tokens=24,
                              chat=False, instruction=None)
    prompts = load_prompts("builtin:arith", limit=2)
    out = replay(tiny_llama, tmp_path / "r", settings, prompts=prompts, command="test", show_progress=False)
    df = pl.read_parquet(out / "generations.parquet")
    assert df.height == 2 * (1 + 2 * 2)
    for col in (
        "prompt_id", "scorer", "budget", "prompt_len", "token_ids", "text", "peak_kv", "mean_kv", "compressions",
        "compression_steps", "max_length_hit", "correct", "kl_mean",
    ):
        assert col in df.columns
    squeezed = df.filter(pl.col("scorer") != "full_kv")
    assert (squeezed["peak_kv"] <= squeezed["budget"] + 16).all() and (squeezed["compressions"] > 0).all()
    assert (squeezed["kl_mean"] > 0).all() and df.filter(pl.col("scorer") == "full_kv")["kl_mean"].is_null().all()
    assert df["correct"].is_not_null().all()  # builtin prompts carry answers
    summary = pl.read_csv(out / "summary.csv")
    assert summary["scorer"].to_list() == ["FullKV", "rkv", "attention"]
    assert summary.columns[1:4] == ["accuracy@48", "max_length_hits@48", "kl_mean@48"]
    for name in ("summary.md", "budget.png", "budget.pdf", "budget.csv", "config.json"):
        assert (out / name).is_file()
    # the summary-only path (no model) rewrites every table from generations.parquet and config.json, byte for byte
    from kvdiag.replay.run import summarize_files

    tables = ("summary.md", "summary.csv", "budget.csv", "outcomes.md", "outcomes.csv", "outcomes_summary.csv",
              "paired.csv")
    written = {name: (out / name).read_bytes() for name in tables}
    for name in tables:
        (out / name).unlink()
    summarize_files(out)
    assert {name: (out / name).read_bytes() for name in tables} == written
    from kvdiag.replay.run import generation_outcomes  # the same rows without FullKV's outcomes.csv

    want = pl.read_csv(out / "outcomes.csv", infer_schema_length=None).select("prompt_id", "scorer", "correct", "loop")
    assert generation_outcomes(out).select(want.columns).rows() == want.rows()
    stamp = {p: p.stat().st_mtime_ns for p in (out / "parts").iterdir()}
    replay(tiny_llama, out, settings, prompts=prompts, command="test", show_progress=False)
    assert {p: p.stat().st_mtime_ns for p in (out / "parts").iterdir()} == stamp  # finished parts are reused


def test_a_replay_without_fullkv_writes_the_rules_outcomes(tiny_llama, tmp_path):
    """--no-full-kv: no FullKV row, and still each rule's outcomes (outcomes.csv, outcomes.md; fidelity and the
    paired test need FullKV: left out, said so); summary.md does not speak of a FullKV row it lacks."""
    from kvdiag.replay.run import summarize_files
    from kvdiag.tasks.prompts import load_prompts

    settings = ReplaySettings(scorers=["knorm"], budgets=[16], interval=8, max_new_tokens=24, full_kv=False,
                              chat=False, instruction=None)
    out = replay(tiny_llama, tmp_path / "r", settings, prompts=load_prompts("builtin:arith", limit=2),
                 command="test", show_progress=False)
    rows = pl.read_csv(out / "outcomes.csv", infer_schema_length=None)
    assert rows["scorer"].to_list() == ["knorm", "knorm"] and rows["correct"].is_not_null().all()
    assert not (out / "paired.csv").exists() and "without FullKV" in (out / "outcomes.md").read_text()
    assert "FullKV" not in (out / "summary.md").read_text()
    tables = ("summary.md", "summary.csv", "outcomes.md", "outcomes.csv", "outcomes_summary.csv")
    written = {name: (out / name).read_bytes() for name in tables}
    for name in tables:
        (out / name).unlink()
    summarize_files(out)
    assert {name: (out / name).read_bytes() for name in tables} == written


def test_teacher_forced_replay_of_a_trace(tiny_trace, tmp_path):
    from kvdiag.cli.main import main

    T = max(tiny_trace.length(pid) for pid in tiny_trace.prompt_ids)
    with pytest.raises(SystemExit) as exit_:
        main(["replay", "--teacher-forced", str(tiny_trace.path), "--scorer", "rkv", "--budget", f"24,{T}",
              "--interval", "8", "--out", str(tmp_path / "tf"), "--quiet"])
    assert exit_.value.code in (0, None)
    df = pl.read_parquet(tmp_path / "tf" / "generations.parquet")
    assert set(df["mode"]) == {"teacher_forced"} and df["correct"].is_null().all()
    assert (df.filter(pl.col("budget") == T)["kl_max"] <= 1e-6).all()
    assert (df.filter(pl.col("budget") == 24)["kl_mean"] > 0).all()


@pytest.mark.parametrize("args, needle", [
    (["--scorer", "rkv", "--budget", "4"], "--budget 4"),  # R-KV keeps its last 8 entries
    (["--scorer", "avokv_e", "--budget", "100"], "--budget 100"),  # W_delay = 128 entries are kept
    (["--scorer", "rkv", "--interval", "0"], "--interval 0"),
    (["--scorer", "h2o"], "--scorers h2o"),  # the deprecated flag name still works
    (["--scorer", "vatp"], "--scorers vatp"),
    (["--scorer", "nope"], "nope"),
    (["--scorer", "rkv", "--budget", "12,x"], "--budget"),
    (["--scorer", "rkv", "--selection", "per-layer"], "--selection"),
])
def test_bad_input_exits_2(args, needle, capsys, tmp_path):
    from kvdiag.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(
            ["replay", "--model", "tiny:llama", "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path), *args]
        )
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err
