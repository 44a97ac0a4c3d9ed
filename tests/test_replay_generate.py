"""Free-running replay through ``model.generate`` (``kvdiag.replay.generating.generate_batch``) against replay's own
loop (``decode_batch``): tokens, stop, compaction steps, entries attended and the kept log-probabilities are the same
(bitwise: generate runs the loop's forwards on the same shapes: finished rows leave both batches, and rows of one
prompt share the first chunk of a chunked prefill), greedy and sampled, mixed rules in one batch, the full cache,
rows that end early, a run ending on a checkpoint, and a sliding-window model."""

from __future__ import annotations

import pytest
import torch

import kvdiag.replay.decoding as decoding
import kvdiag.replay.generating as generating
from kvdiag.generate import Policy, make_scorer
from kvdiag.model.load import load_model
from kvdiag.replay.decoding import decode_batch
from kvdiag.replay.generating import generate_batch
from kvdiag.replay.sampling import Sampling

PROMPTS = [list(range(40, 70)), list(range(90, 120)), list(range(40, 70))]  # rows 0 and 2: one prompt
IDS = ["a", "b", "c"]


def assert_same(loop, gen, bitwise: bool = True) -> None:
    """Tokens and bookkeeping equal; log-probabilities bitwise (the same forwards on the same shapes), or within 1e-5
    absolute (fp32 log-probabilities of magnitude < 30) where ``generate`` prefills a batch the loop runs with fewer
    rows (the full cache: generate's one prefill forward holds every row, the loop runs each distinct prompt once)."""
    assert len(loop) == len(gen)
    for want, got in zip(loop, gen, strict=True):
        assert got.token_ids == want.token_ids and got.stop == want.stop
        assert got.compressions == want.compressions and got.active == want.active
        assert (got.logprobs is None) == (want.logprobs is None)
        if want.logprobs is not None and bitwise:
            assert torch.equal(got.logprobs, want.logprobs)
        elif want.logprobs is not None:
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)


def forward_shapes(model, run) -> list[tuple[int, ...]]:
    """The input shapes [b, c] of every forward of ``model`` during ``run()``."""
    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs.get("input_ids", args[0] if args else None).shape)),
        with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return shapes


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, 0.9, 1)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("rules", [("rkv", "tova", "knorm"), None], ids=["rules", "full"])
def test_generate_batch_equals_the_loop(tiny_llama, rules, sampling):
    """25 new tokens after 30: the last position (54) is a checkpoint the loop compacts at and generate never feeds."""
    pols = [Policy(make_scorer(r), 16, 8) for r in rules] if rules else [None] * 3
    kw = dict(keep_logprobs=True, sampling=sampling, samples=[0, 1, 2])
    loop = decode_batch(tiny_llama, PROMPTS, pols, 25, IDS, **kw)
    gen = generate_batch(tiny_llama, PROMPTS, pols, 25, IDS, **kw)
    assert_same(loop, gen, bitwise=rules is not None)
    if rules:
        assert loop[0].compressions == [24, 30, 38, 46, 54]  # prompt chunks, then every 8
    if not sampling.greedy:  # the rows of one prompt drew differently: the draws are each row's own
        assert loop[0].token_ids != loop[2].token_ids


def test_rows_that_end_early(tiny_llama, monkeypatch):
    """An EOS chosen among row 0's tokens: both drop the row from their batch (generate ends its call there and
    continues the other rows from the cache), so every forward has the loop's shape; every row keeps the same tokens,
    bookkeeping and log-probabilities."""
    pols = [Policy(make_scorer("rkv"), 16, 8)] * 3
    free = decode_batch(tiny_llama, PROMPTS, pols, 30, IDS)
    eos = free[0].token_ids[30 + 11]  # row 0's 12th new token
    assert eos not in free[1].token_ids[30:] or eos != free[1].token_ids[30 + 11]
    monkeypatch.setattr(decoding, "eos_ids", lambda lm: {eos})
    monkeypatch.setattr(generating, "eos_ids", lambda lm: {eos})
    runs: dict[str, list] = {}
    shapes = {name: forward_shapes(tiny_llama.model, lambda name=name, fn=fn: runs.setdefault(
        name, fn(tiny_llama, PROMPTS, pols, 30, IDS, keep_logprobs=True))) for name, fn in
              (("loop", decode_batch), ("generate", generate_batch))}
    assert_same(runs["loop"], runs["generate"])
    loop = runs["loop"]
    assert loop[0].stop == "eos" and loop[0].generated <= 12 and loop[1].generated > loop[0].generated
    assert shapes["generate"] == shapes["loop"]
    # the shared first chunk of rows 0 and 2 (one prompt, one rule: they also end together), then row 1 alone
    assert shapes["loop"][:3] == [(2, 24), (3, 6), (3, 1)] and shapes["loop"][-1] == (1, 1)


def test_sliding_window_model(tiny_gemma3_model):
    pols = [Policy(make_scorer("rkv", w_obs=4), 6, 4)] * 2  # budget + interval fit in a window of 8
    prompts = [list(range(40, 52)), list(range(60, 72))]
    assert_same(decode_batch(tiny_gemma3_model, prompts, pols, 30, ["a", "b"], keep_logprobs=True),
                generate_batch(tiny_gemma3_model, prompts, pols, 30, ["a", "b"], keep_logprobs=True))


@pytest.fixture(scope="module")
def tiny_gemma3_model():
    return load_model("tiny:gemma3")


def test_bench_replay_generate_arm(tiny_llama):
    """``kvdiag bench replay --arms generate``: the same rows and batches through generate, every row's tokens equal
    to the batched loop's, and the checkpoints' time split into scoring/choosing and compacting."""
    from kvdiag.replay.bench import run_replay_bench

    pols = [Policy(make_scorer("rkv"), 16, 6), Policy(make_scorer("tova"), 16, 6)]
    r = run_replay_bench(tiny_llama, PROMPTS[:2], ["p0", "p1"], pols, 24, batch_size=3, arms=("generate",))
    assert list(r.seconds) == ["batched", "generate"] and r.speedup is None
    assert r.rows == 4 and r.same_tokens == {"batched": 4, "generate": 4}
    assert set(r.compaction_s) == {"score_choose", "compact"} and all(s > 0 for s in r.compaction_s.values())
    assert 0 < r.compaction_share < 1 and r.generate_ratio > 0
    assert r.compact_share == r.compaction_s["compact"] / r.seconds["generate"] < r.compaction_share
    assert set(r.cpu_s) == {"batched", "generate"} and all(c > 0 for c in r.cpu_s.values())
    assert r.to_json()["generate_cpu_ratio"] == r.cpu_s["batched"] / r.cpu_s["generate"]


def test_a_rule_reading_token_ids_sees_the_same_ids(tiny_llama):
    """A rule that scores by token id (a plugin may read ``ctx.token_ids``) keeps the same entries in both paths:
    the cache records the ids each forward feeds, and every live scoring of both paths saw them."""
    from kvdiag.scorers import Scorer

    calls: list[bool] = []  # per score() call: whether it had token ids (the live checks probe without)

    class ById(Scorer):
        name = "by_id_test"

        def score(self, ctx):
            calls.append(ctx.token_ids is not None)
            ids = ctx.token_ids if ctx.token_ids is not None else torch.zeros(ctx.k.shape[1])
            return ids.float().expand(ctx.k.shape[0], -1)

    pols = [Policy(ById(), 16, 8)] * 2
    prompts = PROMPTS[:2]
    loop = decode_batch(tiny_llama, prompts, pols, 30, IDS[:2])
    in_loop = sum(calls)
    calls.clear()
    gen = generate_batch(tiny_llama, prompts, pols, 30, IDS[:2])
    assert len(loop[0].compressions) >= 3 and in_loop > 0 and sum(calls) == in_loop
    assert_same(loop, gen)


@pytest.mark.slow
def test_generate_reproduces_the_committed_smollm2_replay():
    """reports/replay-recall (made by replay's own loop, batches of 32 rows): its first two prompts under rkv at
    budget 64, replayed through generate as a batch of two, write the committed tokens, compaction steps, entries
    attended and stops."""
    import json
    from pathlib import Path

    import polars as pl

    from kvdiag.tasks.prompts import encode_prompt, load_prompts

    root = Path(__file__).resolve().parents[1] / "reports" / "replay-recall"
    st = json.loads((root / "config.json").read_text())["settings"]
    lm = load_model("smollm2")
    items = load_prompts("builtin:recall:50", limit=2)
    ids = [encode_prompt(lm.tokenizer, p, chat=st["chat"], instruction=st["instruction"]) for p in items]
    pol = Policy(make_scorer("rkv"), 64, st["interval"], st["selection"])
    runs = generate_batch(lm, ids, [pol, pol], st["max_new_tokens"], [p.prompt_id for p in items])
    committed = pl.read_parquet(root / "generations.parquet").filter((pl.col("scorer") == "rkv")
                                                                     & (pl.col("budget") == 64))
    for p, run in zip(items, runs, strict=True):
        row = committed.filter(pl.col("prompt_id") == p.prompt_id).row(0, named=True)
        assert run.token_ids == row["token_ids"] and run.compressions == row["compression_steps"]
        assert run.peak_kv == row["peak_kv"] and run.mean_kv == pytest.approx(row["mean_kv"], abs=1e-12)
        assert run.stop == row["stop"] and len(run.compressions) >= 2
