"""kvdiag rules as kvpress presses (``kvdiag.kvpress_export.as_press``): through kvpress's own pipeline, equal to
``EvictingCache`` where the two semantics meet (the compaction at the end of the context), refused where kvpress
cannot express the rule."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvdiag.errors import UserError
from kvdiag.generate import EvictingCache
from kvdiag.models import load_model

kvpress = pytest.importorskip("kvpress")

from kvdiag.kvpress_export import as_press  # noqa: E402

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
