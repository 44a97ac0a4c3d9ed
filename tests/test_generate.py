"""``model.generate`` under a kvdiag rule (``kvdiag.generate.EvictingCache``): token for token equal to replay's
free-running decode, batched, sampled and stopped as transformers does; sliding-window models against their own
cache (no-op budget) and against a slow reference (physical deletion as a position mask over a full cache)."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvdiag.core.errors import UserError
from kvdiag.generate import EvictingCache, Policy, PositionedCache, make_scorer, position_mask
from kvdiag.model.load import load_model
from kvdiag.replay.decoding import decode, decode_batch

PROMPT = list(range(40, 70))  # 30 byte tokens: longer than budget + interval below (chunked prefill)


def evicting_generate(lm, prompts: list[list[int]], rule, budget: int, interval: int, selection="per-head",
                      prompt_ids=None, **generate):
    """Tokens [b, P + G] of ``model.generate`` under an EvictingCache (the prompt fed in replay's chunks), and the
    cache."""
    cache = EvictingCache(lm.model, rule, budget=budget, interval=interval, selection=selection,
                          prompt_ids=prompt_ids or [f"p{r}" for r in range(len(prompts))])
    ids = torch.tensor(prompts)
    cache.prefill(ids)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **generate)
    return out, cache


@pytest.mark.parametrize("selection", ["per-head", "per-token", "stochastic:0.3"])
@pytest.mark.parametrize("rule", ["rkv", "tova"])
def test_generate_equals_replay_token_for_token(tiny_model, rule, selection):
    """Greedy, a prompt longer than budget + interval: the same tokens and the same compaction steps as replay."""
    policy = Policy(make_scorer(rule), 16, 8, selection)
    want = decode(tiny_model, PROMPT, policy, max_new_tokens=40, prompt_id="p0")
    out, cache = evicting_generate(tiny_model, [PROMPT], rule, 16, 8, selection, max_new_tokens=40,
                                   do_sample=False)
    assert out[0].tolist() == want.token_ids
    assert cache.compressions == want.compressions and len(want.compressions) >= 3
    assert max(len(layer) for layer in cache.layers) <= 16 + 8


def test_generate_batch_equals_replay_batch(tiny_llama):
    """Two rows of one prompt length, each its own prompt id (per-head contexts, seeds): replay's batch, per row."""
    prompts = [PROMPT, list(range(90, 120))]
    policy = Policy(make_scorer("knorm"), 16, 8)
    want = decode_batch(tiny_llama, prompts, [policy, policy], 30, ["a", "b"])
    out, cache = evicting_generate(tiny_llama, prompts, "knorm", 16, 8, prompt_ids=["a", "b"], max_new_tokens=30,
                                   do_sample=False)
    assert [row.tolist() for row in out] == [w.token_ids for w in want]
    assert cache.compressions == want[0].compressions


def test_a_rule_instance_and_a_budget_at_least_the_sequence_are_plain_generation(tiny_llama):
    """A Scorer instance is accepted; a budget no cache reaches never compacts, and sampled generation (transformers'
    own sampler, one seed) writes the tokens it writes with its own cache."""
    ids = torch.tensor([PROMPT])
    torch.manual_seed(3)
    plain = tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=True,
                                      temperature=0.8, top_p=0.9)
    cache = EvictingCache(tiny_llama.model, make_scorer("rkv"), budget=4096, interval=8)
    torch.manual_seed(3)
    same = tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=30,
                                     do_sample=True, temperature=0.8, top_p=0.9)
    assert torch.equal(plain, same) and cache.compressions == []


def test_sampled_generation_compacts_and_stopping_criteria_stop_it(tiny_llama):
    """Sampling, a user stopping criterion: the cache compacts on schedule and generate stops where asked."""

    class AtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= len(PROMPT) + 21, dtype=torch.bool)

    torch.manual_seed(0)
    out, cache = evicting_generate(tiny_llama, [PROMPT, PROMPT], "rkv", 16, 8, max_new_tokens=60, do_sample=True,
                                   temperature=1.0, stopping_criteria=StoppingCriteriaList([AtLength()]))
    assert out.shape == (2, len(PROMPT) + 21)
    assert cache.compressions == [24, 30, 38, 46]  # prompt chunks end at 24 and 30, then every 8 generated tokens
    assert max(len(layer) for layer in cache.layers) <= 16 + 8


def test_a_long_prompt_without_prefill_is_refused_before_any_output(tiny_llama):
    cache = EvictingCache(tiny_llama.model, "rkv", budget=16, interval=8)
    ids = torch.tensor([PROMPT])
    with pytest.raises(UserError, match="cache.prefill"):
        tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=5)


def test_bad_input_is_one_line_before_generation(tiny_llama):
    model = tiny_llama.model
    with pytest.raises(UserError, match="always keeps"):  # below the rule's protected window
        EvictingCache(model, "rkv", budget=4, interval=8)
    with pytest.raises(UserError, match="needs_history"):  # H2O reads every past query's attention
        EvictingCache(model, "h2o", budget=32)
    with pytest.raises(UserError, match="no continuous score"):
        EvictingCache(model, "streamingllm", budget=32, selection="stochastic")
    with pytest.raises(UserError, match="params apply to a rule given by name"):
        EvictingCache(model, make_scorer("rkv"), budget=64, params={"window": 8})
    with pytest.raises(UserError, match="sliding window of 8"):  # every layer slides: nothing to evict
        EvictingCache(load_model("tiny:mistral_sw").model, "streamingllm", budget=7)
    with pytest.raises(UserError, match="per-token keeps one set"):
        EvictingCache(load_model("tiny:gemma3").model, "rkv", budget=12, selection="per-token")


# --------------------------------------------------------------------------- sliding windows


@pytest.fixture(scope="module")
def tiny_gemma3():
    return load_model("tiny:gemma3")


def test_sliding_model_with_a_noop_budget_is_its_own_generate(tiny_gemma3):
    """Prompt and generation cross the window (8) many times: the positioned cache's position mask is the
    model's own sliding cache, token for token."""
    ids = torch.tensor([PROMPT])
    plain = tiny_gemma3.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                       cache=DynamicCache(config=tiny_gemma3.model.config))
    cache = EvictingCache(tiny_gemma3.model, "rkv", budget=4096, interval=8)
    same = tiny_gemma3.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=40,
                                      do_sample=False)
    assert torch.equal(plain, same) and cache.compressions == []
    assert len(cache.layers[0]) == 7  # the sliding layer keeps what a later query can see, W - 1
    replayed = decode(tiny_gemma3, PROMPT, Policy(make_scorer("rkv"), 4096, 8), max_new_tokens=40)
    assert replayed.token_ids == plain[0].tolist()  # replay runs sliding models through the same cache


def test_sliding_model_generate_equals_replay(tiny_gemma3):
    policy = Policy(make_scorer("rkv", w_obs=4), 12, 4)
    want = decode(tiny_gemma3, PROMPT[:20], policy, max_new_tokens=30, prompt_id="p0")
    out, cache = evicting_generate(tiny_gemma3, [PROMPT[:20]], make_scorer("rkv", w_obs=4), 12, 4,
                                   max_new_tokens=30, do_sample=False)
    assert out[0].tolist() == want.token_ids and cache.compressions == want.compressions


REF_ATTN = "kvdiag_test_deletion"
_MASKS: dict[int, torch.Tensor] = {}


def _deletion_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention over a full cache with the layer's deletion mask (``_MASKS``), ignoring transformers' mask."""
    kwargs.pop("sliding_window", None)
    return sdpa_attention_forward(module, query, key, value, _MASKS[module.layer_idx], scaling=scaling, **kwargs)


AttentionInterface.register(REF_ATTN, _deletion_attention)


@pytest.mark.parametrize("selection", ["per-head", "stochastic:0.5"])
def test_sliding_eviction_equals_physical_deletion(tiny_gemma3, selection):
    """The slow reference: one forward over the whole sequence in a full cache (slot = position), each query seeing
    key ``k`` of (layer, KV head) iff ``k <= q``, ``q - k < W`` on a sliding layer, and ``k`` was not evicted by the
    last compaction before ``q`` (the kept sets recorded from the EvictingCache). Its logits at the generated steps
    equal generate's within 1e-4 (fp32; other shapes, so not bitwise) and give the same tokens."""
    model, history = tiny_gemma3.model, []
    checkpoint = EvictingCache.checkpoint

    def recording(self, t):
        checkpoint(self, t)
        history.append((t, [p[0].clone() for p in self.positions]))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EvictingCache, "checkpoint", recording)
        out, cache = evicting_generate(tiny_gemma3, [PROMPT[:20]], "rkv", 12, 4, selection, max_new_tokens=30,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens, T = out.sequences[0], out.sequences.shape[1] - 1  # the last token is never fed
    assert len(history) > 4
    windows = [layer.window for layer in tiny_gemma3.attention.layers]
    H, Hkv = tiny_gemma3.attention.num_heads, tiny_gemma3.attention.num_kv_heads
    q = torch.arange(T)
    for layer, window in enumerate(windows):
        keys = torch.arange(T).expand(Hkv, T)
        visible = position_mask(q[None], keys[None], window, H)[0].expand(H, T, T).clone()  # [H, T(q), T(k)]
        for t, kept in history:  # later compactions overwrite: each query sees the last one before it
            alive = torch.zeros(Hkv, T, dtype=torch.bool)
            alive.scatter_(1, kept[layer], True)
            alive[:, t:] = True
            visible[:, t:] &= alive.repeat_interleave(H // Hkv, dim=0)[:, None, :]
        _MASKS[layer] = visible[None]
    P, got = 20, torch.stack(out.logits)[:, 0]  # [G, V]
    logits = _reference_logits(model, tokens[None, :-1])
    assert torch.allclose(logits[P - 1 :], got, atol=1e-4, rtol=0)
    assert logits[P - 1 :].argmax(-1).tolist() == tokens[P:].tolist()
    for layer, window in enumerate(windows):  # the check can fail: without the deletions the logits move
        _MASKS[layer] = position_mask(q[None], torch.arange(T).expand(1, Hkv, T), window, H)
    assert (_reference_logits(model, tokens[None, :-1])[P - 1 :] - got).abs().max() > 1e-2


def _reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[T, V] fp32 logits of one forward over ``ids [1, T]`` at positions 0..T-1 through ``_MASKS``."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(REF_ATTN)
    try:
        with torch.no_grad():
            return model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(previous)


def test_positioned_cache_refuses_a_foreign_attention(tiny_llama):
    """A positioned cache run through another attention function would mask sliding layers by slot: refused."""
    cache = PositionedCache([None, None], 0)
    assert tiny_llama.model.config._attn_implementation == "sdpa"  # EvictingCache's forwards switched it back
    with pytest.raises(RuntimeError, match="attention function other than kvdiag's"):
        tiny_llama.model(torch.tensor([PROMPT[:5]]), cache=cache, use_cache=True)


@pytest.mark.slow
def test_generate_equals_replay_on_smollm2():
    lm = load_model("smollm2")
    prompt = lm.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    policy = Policy(make_scorer("rkv"), 16, 8)
    want = decode(lm, prompt, policy, max_new_tokens=24, prompt_id="p0")
    out, cache = evicting_generate(lm, [prompt], "rkv", 16, 8, max_new_tokens=24, do_sample=False)
    assert out[0].tolist() == want.token_ids and len(cache.compressions) >= 2


@pytest.mark.slow
def test_the_docs_example_runs_as_printed(capsys):
    """docs/generate.md's first example, executed as printed on the embedded SmolLM2: it compacts where it says."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "generate.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/generate.md", "exec"), {})
    stated = code.split("# [", 1)[1].split("]", 1)[0]
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"compactions at [{stated}]"


@pytest.mark.slow
def test_gemma3_270m_runs_under_the_evicting_cache_and_replay():
    """The embedded sliding-window model (window 512 on most layers): a budget no cache reaches is its own
    generate; under eviction (its sliding layers hold more than the budget too) generate equals replay."""
    lm = load_model("gemma3-270m")
    prompt = lm.tokenizer("Alice has 3 apples. Bob gives her 4 more. How many apples does she have?")["input_ids"]
    ids = torch.tensor([prompt])
    plain = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              cache=DynamicCache(config=lm.model.config))
    noop = EvictingCache(lm.model, "rkv", budget=4096, interval=16)
    assert torch.equal(plain, lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                                do_sample=False, cache=noop))
    rule = make_scorer("rkv", w_obs=8)
    want = decode(lm, prompt, Policy(rule, 16, 8), max_new_tokens=24, prompt_id="p0")
    out, cache = evicting_generate(lm, [prompt], rule, 16, 8, prompt_ids=["p0"], max_new_tokens=24, do_sample=False)
    assert out[0].tolist() == want.token_ids and len(cache.compressions) >= 3


def test_a_plugin_rule_by_name_equals_replay(tiny_llama):
    """A rule registered by a plugin (a value-norm rule with four sinks) runs under EvictingCache by its name, with
    the tokens replay writes under it."""
    from dataclasses import dataclass

    from kvdiag.scorers import Scorer, register_scorer
    from kvdiag.scorers.registry import SCORERS

    @dataclass
    class ValueSinks(Scorer):
        def score(self, ctx):
            return ctx.v.norm(dim=-1)

        def protected(self, age, position):
            return position < 4

    register_scorer(ValueSinks, "gen_test_value_sinks")
    try:
        want = decode(tiny_llama, PROMPT, Policy(make_scorer("gen_test_value_sinks"), 16, 8), max_new_tokens=30,
                      prompt_id="p0")
        out, cache = evicting_generate(tiny_llama, [PROMPT], "gen_test_value_sinks", 16, 8, max_new_tokens=30,
                                       do_sample=False)
        assert out[0].tolist() == want.token_ids and len(cache.compressions) >= 3
        assert all(bool((layer.positions[..., :4] == torch.arange(4)).all()) for layer in cache.layers)  # sinks kept
    finally:
        del SCORERS["gen_test_value_sinks"]
