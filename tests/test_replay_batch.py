"""Batched and sampled replay: a batch decodes every row as it would alone (tokens, compactions, kept entries;
log-probs within 1e-4 nats, since batched GEMMs round differently), rows leave at EOS, and sampling is seeded,
coupled across policies and draws from the (temperature, top-p) distribution."""

from __future__ import annotations

import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.generate.live import make_scorer
from kvdiag.replay import Policy, decoding
from kvdiag.replay.decoding import decode, decode_batch
from kvdiag.replay.sampling import Sampling

PROMPTS = [list(range(40 + 7 * r, 70 + 7 * r)) for r in range(4)]  # four prompts of 30 byte tokens
# not knorm: qwen3's k_norm gives every key nearly the same norm, so its ranking is float noise (a tie, not a bug)
RULES = ["rkv", "snapkv", "random", "streamingllm", "tova", "avokv_e"]


def policy(name, budget, interval, selection="per-head"):
    return Policy(make_scorer(name), budget, interval, selection)


def _same(alone, batched):
    assert batched.token_ids == alone.token_ids and batched.stop == alone.stop
    assert batched.compressions == alone.compressions and batched.active == alone.active
    assert len(batched.kept) == len(alone.kept)
    for (t1, k1), (t2, k2) in zip(alone.kept, batched.kept, strict=True):
        assert t1 == t2 and torch.equal(k1, k2)
    if alone.logprobs is not None:
        torch.testing.assert_close(batched.logprobs, alone.logprobs, atol=1e-4, rtol=0)


def _runs(lm, pols, sampling=None, samples=None, max_new=40):
    ids = [f"p{r % len(PROMPTS)}" for r in range(len(pols))]
    prompts = [PROMPTS[r % len(PROMPTS)] for r in range(len(pols))]
    samples = samples or [0] * len(pols)
    alone = [decode(lm, p, pol, max_new, pid, keep_logprobs=True, keep_history=True, sampling=sampling, sample=s)
             for p, pol, pid, s in zip(prompts, pols, ids, samples, strict=True)]
    batched = decode_batch(lm, prompts, pols, max_new, ids, keep_logprobs=True, keep_history=True, sampling=sampling,
                           samples=samples)
    return alone, batched


@pytest.mark.parametrize("selection", ["per-head", "per-token"])
def test_a_batch_of_rules_decodes_each_row_as_alone(tiny_model, selection):
    pols = [policy(name, budget=16, interval=6, selection=selection) for name in RULES]
    alone, batched = _runs(tiny_model, pols)
    assert all(run.compressions for run in alone)  # the budget bites: the rows were compacted
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)


def test_full_kv_rows_batch_and_rows_leave_at_eos(tiny_llama, monkeypatch):
    full = [decode(tiny_llama, p, None, 40) for p in PROMPTS]
    # an EOS that one row writes at its 10th step and some row never writes: rows leave the batch at different steps
    stopper = full[0].token_ids[30 + 9]
    assert any(stopper not in run.token_ids[30:] for run in full)
    monkeypatch.setattr(decoding, "eos_ids", lambda lm: {stopper})
    for pols in ([None] * 4, [policy(name, budget=16, interval=6) for name in RULES[:4]]):
        alone, batched = _runs(tiny_llama, pols)
        assert {run.stop for run in alone} == {"eos", "max_new_tokens"}
        for a, b in zip(alone, batched, strict=True):
            _same(a, b)


def test_sampling_is_seeded_coupled_and_independent_of_the_batch(tiny_llama):
    sampling = Sampling(temperature=1.0, top_p=0.95, seed=3)
    pols = [policy("rkv", budget=16, interval=6), policy("tova", budget=16, interval=6)] * 2
    alone, batched = _runs(tiny_llama, pols, sampling, samples=[0, 0, 1, 1])
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    # a budget covering the sequence changes nothing, so with the same draws it writes FullKV's sampled tokens
    wide = decode(tiny_llama, PROMPTS[0], policy("rkv", budget=100, interval=6), 40, "p0", sampling=sampling)
    full = decode(tiny_llama, PROMPTS[0], None, 40, "p0", sampling=sampling)
    assert wide.token_ids == full.token_ids
    other = decode(tiny_llama, PROMPTS[0], None, 40, "p0", sampling=sampling, sample=1)
    greedy = decode(tiny_llama, PROMPTS[0], None, 40, "p0")
    assert len({tuple(r.token_ids) for r in (full, other, greedy)}) == 3


def test_sampling_draws_from_the_nucleus_in_proportion():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.02, 0.3, 0.2, 0.03]))
    draw = Sampling(temperature=1.0, top_p=0.85, seed=0)
    gen = draw.generator("x", 0)
    counts = torch.bincount(torch.tensor([draw.pick(logits, gen) for _ in range(20000)]), minlength=6).double()
    # nucleus: 0.4 + 0.3 + 0.2 = 0.9 >= 0.85, so tokens 1, 3, 4 renormalized; 3-sigma of a 20000-draw frequency < 0.011
    want = torch.tensor([0, 0.4, 0, 0.3, 0.2, 0]) / 0.9
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts / counts.sum(), want.double(), atol=0.011, rtol=0)
    hot = Sampling(temperature=0.5, seed=0)  # temperature sharpens: p^2 renormalized
    gen = hot.generator("x", 0)
    counts = torch.bincount(torch.tensor([hot.pick(logits, gen) for _ in range(20000)]), minlength=6).double()
    p2 = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.2, 0.03]).double() ** 2
    torch.testing.assert_close(counts / counts.sum(), p2 / p2.sum(), atol=0.011, rtol=0)


def test_nucleus_equals_a_sort_of_the_whole_vocabulary():
    """The top-k search (k doubled from 2 here) returns the nucleus a full stable sort gives, ties included."""
    from kvdiag.replay.sampling import nucleus

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits = torch.randn(300, generator=gen, dtype=torch.float64) * (0.5 + trial % 5)
        if trial % 3 == 0:  # ties: many tokens share a few logits
            logits = (logits * 2).round() / 2
        probs = torch.softmax(logits, dim=-1)
        for top_p in (0.05, 0.5, 0.9, 0.999):
            ranked, order = probs.sort(descending=True, stable=True)
            want = order[ranked.cumsum(0) - ranked < top_p].sort().values
            assert torch.equal(nucleus(probs, top_p, k=2), want)


@pytest.mark.parametrize(("kwargs", "fragment"), [({"temperature": 0.0}, "--temperature 0.0"),
                                                  ({"temperature": 1.0, "top_p": 1.5}, "--top-p 1.5"),
                                                  ({"top_p": 0.9}, "needs --temperature")])
def test_bad_sampling_is_refused(kwargs, fragment):
    with pytest.raises(UserError, match=fragment.replace(".", r"\.")):
        Sampling(**kwargs)


def test_bench_replay_decodes_the_same_rows_alone_and_batched(tiny_llama):
    """``kvdiag bench replay``'s rows (prompts × scorers × samples) write the same tokens alone and batched."""
    from kvdiag.replay.bench import run_replay_bench

    pols = [policy("rkv", budget=16, interval=6), policy("tova", budget=16, interval=6)]
    r = run_replay_bench(tiny_llama, PROMPTS[:2], ["p0", "p1"], pols, 24, batch_size=3,
                         sampling=Sampling(temperature=1.0, top_p=0.9, seed=1), samples=2)
    assert r.rows == 8 and r.same_tokens == {"alone": 8, "batched": 8} and r.tokens > 0 and r.batch_size == 3
    assert r.alone_s > 0 and r.batched_s > 0
