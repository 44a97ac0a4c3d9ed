"""Tracing in bounded memory: token statistics computed as tokens are produced (no [T, V] logits), q/k/v rows
written into growing blocks, and the generation settings a reasoning researcher sets."""

from __future__ import annotations

import json

import polars as pl
import torch

from kvdiag.tasks.prompts import load_prompts
from kvdiag.trace import GenerationSettings, trace_prompts
from kvdiag.trace.hooks import Recorder


def test_token_stats_equal_the_logits_of_a_plain_forward(tiny_llama, tmp_path):
    """logprob/entropy of each generated token equal those of the raw next-token distribution of a plain forward
    over the traced tokens (different shapes and paths: 1e-4 absolute on values of order 1-5)."""
    settings = GenerationSettings(max_new_tokens=24, chat=False, instruction=None, storage_dtype="float32")
    trace_prompts(tiny_llama, load_prompts("builtin:arith", limit=1), tmp_path / "t", settings, show_progress=False)
    toks = pl.read_parquet(tmp_path / "t" / "tokens.parquet")
    ids = torch.tensor(toks["token_id"].to_list())[None]
    P = int(toks["is_prompt"].sum())
    with torch.no_grad():
        logp = torch.log_softmax(tiny_llama.model(ids).logits[0].double(), -1)  # row i predicts token i + 1
    gen = ids[0, P:]
    want_lp = logp[P - 1 : len(ids[0]) - 1].gather(1, gen[:, None]).squeeze(1)
    want_h = -(logp.exp() * logp).sum(-1)[P - 1 : len(ids[0]) - 1]
    torch.testing.assert_close(
        torch.tensor(toks["logprob"].to_list()[P:], dtype=torch.float64), want_lp, rtol=0, atol=1e-4
    )
    torch.testing.assert_close(
        torch.tensor(toks["entropy"].to_list()[P:], dtype=torch.float64), want_h, rtol=0, atol=1e-4
    )


def test_min_new_tokens_and_sampling_settings_are_recorded(tiny_llama, tmp_path):
    eos = tiny_llama.tokenizer.eos_token_id
    settings = GenerationSettings(max_new_tokens=30, min_new_tokens=30, sample=True, temperature=1.5, top_p=0.9, seed=3,
                                  chat=False, instruction=None)
    trace_prompts(tiny_llama, load_prompts("builtin:arith", limit=2), tmp_path / "t", settings, show_progress=False)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["generation"]["min_new_tokens"] == 30 and manifest["generation"]["sample"] is True
    assert manifest["generation"]["temperature"] == 1.5 and manifest["generation"]["top_p"] == 0.9
    toks = pl.read_parquet(tmp_path / "t" / "tokens.parquet")
    for pid, entry in manifest["prompts"].items():
        assert entry["generated"] == 30  # no end-of-sequence before the minimum
        gen = toks.filter((pl.col("prompt_id") == pid) & ~pl.col("is_prompt"))["token_id"].to_list()
        assert eos not in gen[:-1]


def test_recorder_blocks_hold_the_rows_and_at_most_twice_their_size():
    rec = Recorder(1, torch.float16)
    rows = []
    for step in range(300):
        n = 17 if step == 0 else 1  # a prefill, then one row per decode step
        q, k, v = torch.randn(4, n, 8), torch.randn(2, n, 8), torch.randn(2, n, 8)
        rec.add(0, q, k, v)
        rows.append((q, k, v))
    got = rec.layer(0)
    for i, name in enumerate("qkv"):
        # a pure copy with the same fp32 -> fp16 conversion on both sides: equal bit for bit
        torch.testing.assert_close(got[name], torch.cat([r[i] for r in rows], dim=1).half(), rtol=0, atol=0)
    T = 17 + 299
    row_bytes = (4 + 2 + 2) * 8 * 2  # q, k, v rows of one position in fp16
    assert rec.nbytes() <= 2 * T * row_bytes
