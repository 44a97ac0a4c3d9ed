"""kvdiag rules as kvpress presses (``kvdiag.generate.kvpress_export.as_press``): through kvpress's own pipeline, equal
to
``EvictingCache`` where the two semantics meet (the compaction at the end of the context), refused where kvpress
cannot express the rule."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvdiag.core.errors import UserError
from kvdiag.generate import EvictingCache
from kvdiag.model.load import load_model

kvpress = pytest.importorskip("kvpress")

from kvdiag.generate.kvpress_export import as_press  # noqa: E402

CONTEXT = list(range(40, 101))  # 61 byte tokens


@pytest.mark.parametrize("rule", ["rkv", "tova", "knorm"])
def test_prefill_press_keeps_what_the_evicting_cache_keeps(tiny_model, rule):
    """One compaction of the whole context (budget + interval >= its length, so EvictingCache does not chunk it):
    the same kept positions per (layer, KV head), and the same keys and values (the press recomputes the query
    window from the layer's inputs; EvictingCache records it in the attention: equal within 1e-5)."""
    model, ids = tiny_model.model, torch.tensor([CONTEXT])
    press = as_press(rule, model, budget=32, interval=32)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, cache=cache)
    evicting = EvictingCache(model, rule, budget=32, interval=32)
    with torch.no_grad():
        model(ids, cache=evicting, use_cache=True)
    evicting.checkpoint(len(CONTEXT))  # what the first decoding forward runs first
    for layer, (kv, ev) in enumerate(zip(cache.layers, evicting.layers, strict=True)):
        assert torch.equal(press.prefilling_press.shared[layer], ev.positions), layer
        assert torch.allclose(kv.keys, ev.keys, atol=1e-5) and torch.allclose(kv.values, ev.values, atol=1e-5)


def test_a_kvdiag_rule_runs_in_kvpress_pipeline(tiny_llama):
    """kvpress's KVPressTextGenerationPipeline with the press: it answers, the context was compressed to the
    budget and decoding compressions ran (the press's tracked positions end inside the answer)."""
    from kvpress import KVPressTextGenerationPipeline

    pipe = KVPressTextGenerationPipeline(model=tiny_llama.model, tokenizer=tiny_llama.tokenizer)
    press = as_press("rkv", tiny_llama.model, budget=16, interval=8)
    context = "Alice has 3 apples and Bob has 4 apples. "
    out = pipe(context, question="How many apples?", press=press, max_new_tokens=30)
    assert isinstance(out["answer"], str)
    shared = press.prefilling_press.shared
    n_context = shared["prompt_len"]
    assert n_context > 16
    for layer in range(tiny_llama.attention.num_layers):
        kept = shared[layer]
        assert kept.shape[-1] == 16  # the last decoding compression brought the cache back to the budget
        assert int(kept.max()) >= n_context + 8  # ... after at least one interval of decoding
        assert bool((kept.diff(dim=-1) > 0).all())  # position order, no duplicates


def test_inexpressible_rules_are_refused_in_one_line(tiny_llama):
    model = tiny_llama.model
    with pytest.raises(UserError, match="every past query's attention"):
        as_press("h2o", model, budget=32)
    with pytest.raises(UserError, match="already a kvpress press"):
        as_press("kvpress:KnormPress", model, budget=32)
    with pytest.raises(UserError, match="always keeps"):
        as_press("rkv", model, budget=4, interval=8)
    with pytest.raises(UserError, match="sliding-window layers"):
        as_press("rkv", load_model("tiny:gemma3").model, budget=32)


# --------------------------------------------------------------------------- SmolLM2: decoding, token for token

SMOL_CONTEXT = ("Remember the code 7311. The garden behind the old library has three apple trees, a stone bench and "
                "a narrow path that leads to a pond where ducks swim every morning. Count the trees, then the ducks.")
SMOL_QUESTION = "What is the code? Answer, then describe the garden step by step."


class PipelineSchedule(EvictingCache):
    """EvictingCache compacting on the schedule kvpress's pipeline runs a ``PrefillDecodingPress`` on: once at the
    end of the context (``C``: the question then attends the compacted context), then after every ``interval``
    decoding *forwards*, the question (``q`` tokens) being the first: the cache holds ``[0, C + q - 1 + j K)``."""

    def __init__(self, *args, context_len: int, question_len: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.context_len, self.question_len = context_len, question_len

    def checkpoints(self, start: int, end: int) -> list[int]:
        C, q, K = self.context_len, self.question_len, self.policy.interval
        return [t for t in [C, *range(C + q - 1 + K, end, K)] if start <= t < end]


def pipeline_inputs(lm):
    """The context and question token ids [1, n] exactly as kvpress's pipeline tokenizes them."""
    from kvpress import KVPressTextGenerationPipeline

    pipe = KVPressTextGenerationPipeline(model=lm.model, tokenizer=lm.tokenizer)
    tensors = pipe.preprocess(SMOL_CONTEXT, [SMOL_QUESTION], answer_prefix="", max_context_length=10_000)
    return pipe, tensors["context_ids"], tensors["questions_ids"][0]


def pipeline_answer(pipe, lm, rule, budget, interval, max_new, monkeypatch) -> tuple[list[int], object]:
    """kvpress's pipeline with ``as_press``: the answer's token ids (as the pipeline decodes them) and the press."""
    press = as_press(rule, lm.model, budget=budget, interval=interval)
    written, decode = [], lm.tokenizer.decode
    monkeypatch.setattr(lm.tokenizer, "decode", lambda ids, **kw: written.append(ids.tolist()) or decode(ids, **kw))
    with torch.no_grad():
        pipe(SMOL_CONTEXT, question=SMOL_QUESTION, press=press, max_new_tokens=max_new)
    monkeypatch.setattr(lm.tokenizer, "decode", decode)
    return written[-1], press


@torch.no_grad()
def greedy(lm, cache, context_ids, question_ids, max_new: int) -> list[int]:
    """The pipeline's decoding loop (``generate_answer``) over ``cache``: the context, the question in one forward,
    then one token per forward with explicit positions, up to EOS or ``max_new`` tokens."""
    lm.model(input_ids=context_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return answer(lm, cache, context_ids.shape[1], question_ids, max_new)


@torch.no_grad()
def answer(lm, cache, C: int, question_ids, max_new: int) -> list[int]:
    """The rest of the pipeline's loop once ``cache`` holds the C context tokens: the question in one forward, then
    one token per forward with explicit positions, up to EOS or ``max_new`` tokens (test_press_pipeline's too)."""
    q = question_ids.shape[1]
    logits = lm.model(input_ids=question_ids, cache=cache, use_cache=True,
                      position_ids=torch.arange(C, C + q)[None]).logits
    eos, out = lm.model.generation_config.eos_token_id, [int(logits[0, -1].argmax())]
    eos = set(eos) if isinstance(eos, list) else {eos}
    for i in range(max_new - 1):
        if out[-1] in eos:
            break
        logits = lm.model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True,
                          position_ids=torch.tensor([[C + q + i]])).logits
        out.append(int(logits[0, -1].argmax()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["rkv", "tova"])
def test_kvpress_pipeline_decoding_equals_the_evicting_cache_on_its_schedule(rule, monkeypatch):
    """SmolLM2, budget 32, interval 16, a 70-token context, 64 generated tokens: ``as_press`` through kvpress's own
    ``KVPressTextGenerationPipeline`` writes token for token what ``EvictingCache`` writes once the one named
    difference, the schedule, is aligned (PipelineSchedule: kvpress compacts the context before the question and
    counts the question as one decoding forward), and after the last compaction both hold the same positions in every
    layer and KV head.

    The other differences need no alignment here. kvpress compacts each layer right after its attention, inside the
    forward; EvictingCache compacts every layer before the next forward: no layer reads its cache in between, so the
    next token sees the same state. kvpress's budget rule (a ratio at prefill, ``target_size`` while decoding) is set
    to exactly the budget by ``as_press``. The press recomputes the query window from the layer's buffered inputs
    (q_proj and RoPE again) where EvictingCache records it in the attention: no tolerance was needed, the kept sets
    and tokens are equal. Plain ``EvictingCache`` (replay's schedule on context + question) writes another answer:
    the schedule difference is real."""
    lm = load_model("smollm2")
    B, K, G = 32, 16, 64
    pipe, context_ids, question_ids = pipeline_inputs(lm)
    C, q = context_ids.shape[1], question_ids.shape[1]
    assert C > B + 8 and q < B  # the context is compacted; the question is one forward, not compressed alone
    want, press = pipeline_answer(pipe, lm, rule, B, K, G, monkeypatch)

    aligned = PipelineSchedule(lm.model, rule, budget=B, interval=K, context_len=C, question_len=q)
    got = greedy(lm, aligned, context_ids, question_ids, G)
    assert got == want and len(got) == G
    aligned.checkpoint(C + q + G - 1)  # the press compacts after the last forward too (the answer's 64th)
    assert aligned.compressions == [C, *range(C + q - 1 + K, C + q + G, K)]
    for layer, ev in enumerate(aligned.layers):
        assert torch.equal(press.prefilling_press.shared[layer], ev.positions), layer

    plain = EvictingCache(lm.model, rule, budget=B, interval=K)  # replay's schedule on context + question
    ids = torch.cat([context_ids, question_ids], dim=1)
    plain.prefill(ids)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), cache=plain, max_new_tokens=G, do_sample=False)
    assert C not in plain.compressions and out[0, C + q:].tolist() != want
