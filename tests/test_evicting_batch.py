"""``EvictingCache`` beyond prompts of one length: left-padded batches (how transformers users batch prompts of
different lengths) token for token against one-row generation of each prompt; ``compression_ratio=``; kvpress's
``prefill="once"`` against replay's loop; one generation per cache; every bad argument one ValueError/TypeError
naming the Python argument, with nothing allocated in proportion to a number given."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvdiag.generate import EvictingCache, Policy, make_scorer
from kvdiag.generate.live import kept_entries
from kvdiag.model.load import load_model
from kvdiag.replay.decoding import decode

# three prompts of different lengths: 30 tokens (chunked at budget + interval = 24, then 30), 22 and 17 (one forward)
PROMPTS = [list(range(40, 70)), list(range(90, 112)), list(range(120, 137))]
G = 30


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [b, P] as a tokenizer with ``padding_side="left"`` writes them."""
    P = max(map(len, prompts))
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def alone(lm, prompt: list[int], rule, prompt_id: str, **settings) -> tuple[list[int], list[int]]:
    """One row generated alone (greedy): its new tokens and its compaction checkpoints."""
    cache = EvictingCache(lm.model, rule, prompt_ids=[prompt_id], **settings)
    ids = torch.tensor([prompt])
    cache.prefill(ids)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=G, do_sample=False)
    return out[0, len(prompt):].tolist(), cache.compressions


def until_eos(lm, tokens: torch.Tensor) -> list[int]:
    """A batch row's new tokens up to its first EOS (``generate`` pads a finished row; alone it stops there)."""
    eos = lm.model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    tokens = tokens.tolist()
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]


def same_checkpoints(cache, row: int, prompt: list[int], tokens: list[int], alone: list[int]) -> bool:
    """The batch row's checkpoints up to the last position the row fed alone (after its EOS the batch feeds it
    padding, alone it stops) are the row's own alone."""
    last = len(prompt) + len(tokens) - 2
    return [t for t in cache.row_compressions[row] if t <= last] == alone


def batched(lm, prompts, rule, **settings):
    """The prompts left-padded in one batch (the prompt fed by ``prefill`` with its mask, then ``generate``)."""
    ids, mask = left_padded(prompts)
    cache = EvictingCache(lm.model, rule, prompt_ids=[f"p{r}" for r in range(len(prompts))], **settings)
    cache.prefill(ids, mask)
    out = lm.model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=G, do_sample=False,
                            pad_token_id=0)
    return out[:, ids.shape[1]:], cache


@pytest.mark.parametrize("prefill", ["chunked", "once"])
@pytest.mark.parametrize(("rule", "selection"), [("rkv", "per-head"), ("tova", "stochastic:0.3")])
def test_left_padded_batch_equals_each_prompt_alone(tiny_model, rule, selection, prefill):
    """Each row of a left-padded batch writes the tokens its prompt writes alone, token for token, and is compacted
    at the same checkpoints of its own positions (the 30-token row: chunk ends 24 and 30, then every 8 tokens; the
    17-token row: 17, 25, ...), under replay's chunked prefill and kvpress's one compaction."""
    settings = dict(budget=16, interval=8, selection=selection, prefill=prefill)
    out, cache = batched(tiny_model, PROMPTS, rule, **settings)
    for r, prompt in enumerate(PROMPTS):
        tokens, compressions = alone(tiny_model, prompt, rule, f"p{r}", **settings)
        assert until_eos(tiny_model, out[r]) == tokens, r
        assert same_checkpoints(cache, r, prompt, tokens, compressions), r
    chunked = prefill == "chunked"
    assert cache.row_compressions[0][:3] == ([24, 30, 38] if chunked else [30, 38, 46])
    assert cache.row_compressions[2][:2] == [17, 25]
    assert max(len(layer) for layer in cache.layers) <= 16 + 8  # pads left the cache with the first compaction


def test_left_padded_batch_on_a_sliding_window_model():
    """Tiny Gemma 3 (sliding window 8 on some layers: the layer drops, per row, what its own next position no longer
    sees): each row as alone."""
    lm = load_model("tiny:gemma3")
    settings = dict(budget=12, interval=4)
    out, cache = batched(lm, PROMPTS, "rkv", **settings)
    for r, prompt in enumerate(PROMPTS):
        tokens, compressions = alone(lm, prompt, "rkv", f"p{r}", **settings)
        assert until_eos(lm, out[r]) == tokens and same_checkpoints(cache, r, prompt, tokens, compressions), r


def test_left_padded_short_prompts_need_no_prefill(tiny_llama):
    """Prompts no longer than budget + interval: ``generate`` alone (its one prefill forward reads the padding from
    the attention mask); the batch's compactions are steps counted with the padding."""
    prompts = [p[:14] for p in PROMPTS[:2]] + [PROMPTS[2][:9]]
    ids, mask = left_padded(prompts)
    cache = EvictingCache(tiny_llama.model, "rkv", budget=16, interval=8, prompt_ids=["p0", "p1", "p2"])
    out = tiny_llama.model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=G, do_sample=False,
                                    pad_token_id=0)
    for r, prompt in enumerate(prompts):
        tokens, compressions = alone(tiny_llama, prompt, "rkv", f"p{r}", budget=16, interval=8)
        new = until_eos(tiny_llama, out[r, ids.shape[1]:])
        assert new == tokens and same_checkpoints(cache, r, prompt, tokens, compressions), r
    # rows 0 and 2 first hold more than 16 at their positions 22 and 17: the same step, 22 (row 2 has 5 pads)
    assert cache.row_compressions[0][0] == 22 and cache.row_compressions[2][0] == 17 and cache.compressions[0] == 22


def test_left_padded_decoding_is_masked_only_while_padding_or_filler_is_held(tiny_llama, monkeypatch):
    """#58: a left-padded batch's one-token forward runs attention unmasked (as unpadded decoding) once a layer holds
    no padding or filler slot, and masked by position while it does; the prompt's forward is always masked. Row 1
    (40 tokens, under the budget of 48) is not compacted at step 96, so row 0's compaction tops it up with filler
    until both compact at step 112; each row still writes its tokens alone."""
    import kvdiag.cache.attend as attend

    calls, handed = [], []
    take, sdpa = attend.take_handoff, attend.sdpa_attention_forward

    def take_handoff():
        handoff = take()
        handed.append(None if handoff is None else int(handoff[0].visible_positions.min()))
        return handoff

    def recording_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((query.shape[2], handed[-1], attention_mask is None))
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(attend, "take_handoff", take_handoff)
    monkeypatch.setattr(attend, "sdpa_attention_forward", recording_sdpa)
    prompts = [list(range(3, 99)), list(range(100, 140))]
    out, cache = batched(tiny_llama, prompts, "rkv", budget=48, interval=16, prefill="once")
    assert all((q == 1 and low >= 0) == unmasked for q, low, unmasked in calls), calls
    decoding = [unmasked for q, _, unmasked in calls if q == 1]
    assert not all(decoding) and any(decoding) and decoding == sorted(decoding)  # masked, then unmasked
    assert cache.row_compressions[1][:1] == [56]  # step 112
    monkeypatch.undo()
    for r, prompt in enumerate(prompts):
        assert until_eos(tiny_llama, out[r]) == alone(tiny_llama, prompt, "rkv", f"p{r}", budget=48, interval=16,
                                                      prefill="once")[0], r


def test_padding_that_is_not_on_the_left_is_refused(tiny_llama):
    ids = torch.tensor([PROMPTS[0][:10], PROMPTS[1][:10]])
    mask = torch.ones_like(ids)
    mask[0, -1] = 0  # right padding
    cache = EvictingCache(tiny_llama.model, "rkv", budget=16, interval=8)
    with pytest.raises(ValueError, match="attention_mask: only left padding is supported"):
        tiny_llama.model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, pad_token_id=0)


# --------------------------------------------------------------------------- prefill once, compression ratio


@pytest.mark.parametrize("rule", ["rkv", "snapkv"])
def test_prefill_once_equals_replay_on_the_same_policy(tiny_llama, rule):
    """``prefill="once"``: a 30-token prompt (longer than budget + interval) in ``generate``'s one forward, one
    compaction at its end, then every interval: token for token replay's own loop under ``Policy(prefill="once")``
    (the loop feeds the prompt in ``prompt_chunks``, one chunk here), the same checkpoints; no ``prefill()`` call."""
    scorer = make_scorer(rule, w_obs=8)
    want = decode(tiny_llama, PROMPTS[0], Policy(scorer, 16, 8, prefill="once"), max_new_tokens=G, prompt_id="p0")
    cache = EvictingCache(tiny_llama.model, scorer, budget=16, interval=8, prefill="once", prompt_ids=["p0"])
    ids = torch.tensor([PROMPTS[0]])
    out = tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=G,
                                    do_sample=False)
    assert out[0].tolist() == want.token_ids
    assert cache.compressions == want.compressions == [30, 38, 46, 54]
    chunked = decode(tiny_llama, PROMPTS[0], Policy(scorer, 16, 8), max_new_tokens=G, prompt_id="p0")
    assert chunked.compressions[:2] == [24, 30]  # the other schedule (the check can fail)


def test_compression_ratio_is_the_budget_it_implies(tiny_llama):
    """``compression_ratio=0.5`` on a 30-token prompt keeps 15 (kvpress's count): the tokens and checkpoints of
    ``budget=15``; in a left-padded batch each row's budget is its own prompt's (15, 11, 8), each row as alone."""
    ids = torch.tensor([PROMPTS[0]])
    runs = []
    for budget in ({"compression_ratio": 0.5}, {"budget": 15}):
        cache = EvictingCache(tiny_llama.model, "rkv", interval=8, **budget)
        cache.prefill(ids)
        out = tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=G,
                                        do_sample=False)
        runs.append((out.tolist(), cache.compressions, cache.budgets))
    assert runs[0] == (runs[1][0], runs[1][1], [15]) and kept_entries(30, 0.5) == 15
    out, cache = batched(tiny_llama, PROMPTS, "rkv", compression_ratio=0.5, interval=8)
    assert cache.budgets == [15, 11, 8]
    for r, prompt in enumerate(PROMPTS):
        tokens, compressions = alone(tiny_llama, prompt, "rkv", f"p{r}", budget=cache.budgets[r], interval=8)
        assert until_eos(tiny_llama, out[r]) == tokens and same_checkpoints(cache, r, prompt, tokens, compressions), r


def test_a_ratio_below_the_protected_entries_is_refused_at_the_prompt(tiny_llama):
    """kvpress's count: int(30 * (1 - 0.9)) = int(2.99...) = 2 entries, below the 8 rkv always keeps."""
    cache = EvictingCache(tiny_llama.model, "rkv", compression_ratio=0.9, interval=8)
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match=r"compression_ratio=0.9 keeps 2 of a 30-token prompt's entries: budget=2 "
                                         r"is smaller than the 8 entries rkv always keeps"):
        cache.prefill(ids)


# --------------------------------------------------------------------------- one generation per cache


def test_a_cache_serves_one_generation(tiny_llama):
    """Continuing the same generation (its output as the next call's input, as replay does when rows leave) is one
    generation: token for token a single call of 20 tokens. Another prompt, shorter or longer, is refused."""
    ids = torch.tensor([PROMPTS[0][:20]])
    cache = EvictingCache(tiny_llama.model, "rkv", budget=16, interval=8)
    out = tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=10,
                                    do_sample=False)
    more = tiny_llama.model.generate(out, attention_mask=torch.ones_like(out), cache=cache, max_new_tokens=10,
                                     do_sample=False)
    once = EvictingCache(tiny_llama.model, "rkv", budget=16, interval=8)
    assert torch.equal(more, tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), cache=once,
                                                       max_new_tokens=20, do_sample=False))
    for other in (torch.tensor([PROMPTS[1][:20]]), torch.tensor([PROMPTS[1] * 3]), torch.tensor([PROMPTS[1][:5]])):
        with pytest.raises(ValueError, match="^cache: this EvictingCache already holds 39 tokens of another "
                                             "generation"):
            tiny_llama.model.generate(other, attention_mask=torch.ones_like(other), cache=cache, max_new_tokens=3,
                                      do_sample=False)
    with pytest.raises(ValueError, match="^cache: this EvictingCache already holds a prompt"):
        cache.prefill(ids)


# --------------------------------------------------------------------------- bad arguments


BAD = [
    (dict(budget=float("nan")), ValueError, r"^budget=nan: give a whole number"),
    (dict(budget=float("inf")), ValueError, r"^budget=inf: give a whole number"),
    (dict(budget=2.5), ValueError, r"^budget=2.5: give a whole number"),
    (dict(budget="x"), TypeError, r"^budget='x': give an int"),
    (dict(budget=None), ValueError, r"^give exactly one of budget="),
    (dict(budget=0), ValueError, r"^budget=0 is out of range"),
    (dict(budget=-3), ValueError, r"^budget=-3 is out of range"),
    (dict(budget=10**12), ValueError, r"^budget=1000000000000 is out of range"),
    (dict(budget=16, compression_ratio=0.5), ValueError, r"^give exactly one of budget="),
    (dict(compression_ratio=float("nan")), ValueError, r"^compression_ratio=nan is out of range"),
    (dict(compression_ratio=1), ValueError, r"^compression_ratio=1 is out of range"),
    (dict(compression_ratio="0.5"), TypeError, r"^compression_ratio='0.5'"),
    (dict(budget=16, interval=0), ValueError, r"^interval=0 is out of range"),
    (dict(budget=16, interval=float("nan")), ValueError, r"^interval=nan"),
    (dict(budget=16, selection="greedy"), ValueError, r"^selection='greedy' is not valid"),
    (dict(budget=16, selection=3), TypeError, r"^selection=3"),
    (dict(budget=16, backend="cuda"), ValueError, r"^backend='cuda' is not valid"),
    (dict(budget=16, prefill="twice"), ValueError, r"^prefill='twice' is not valid"),
    (dict(budget=16, seed="0"), TypeError, r"^seed='0'"),
    (dict(budget=16, prompt_ids="p0"), TypeError, r"^prompt_ids='p0'"),
    (dict(budget=16, params=["window"]), TypeError, r"^params=\['window'\]"),
    (dict(budget=16, params={"window": "a"}), ValueError, r"^rule='rkv': params=\{'window': 'a'\}: not a valid int"),
    (dict(budget=4, interval=8), ValueError, r"^budget=4 is smaller than the 8 entries rkv always keeps .* use "
                                             r"budget >= 8 or shrink its windows with params="),
    (dict(budget=16, selection="stochastic", rule="streamingllm"), ValueError,
     r"^selection='stochastic': streamingllm has no continuous score"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD)
def test_bad_arguments_are_one_error_naming_the_argument(tiny_llama, kwargs, error, message):
    kwargs = {"rule": "rkv", **kwargs}
    with pytest.raises(error, match=message) as caught:
        EvictingCache(tiny_llama.model, **kwargs)
    assert "--" not in str(caught.value)  # Python-level errors name arguments, never CLI flags


@pytest.mark.parametrize(("model", "rule", "error", "message"), [
    (None, "rkv", TypeError, r"^model=NoneType: give a transformers causal LM"),
    ("gpt2", "rkv", TypeError, r"^model=str"),
    ("tiny", None, TypeError, r"^rule=None"),
    ("tiny", 42, TypeError, r"^rule=42"),
    ("tiny", [], ValueError, r"^rule=\[\]"),
    ("tiny", "nope", ValueError, r"^rule='nope': unknown scorer"),
    ("tiny", "h2o", ValueError, r"^rule='h2o' needs every past query's attention"),
    ("tiny", "fitted", ValueError, r"^rule='fitted': scorer fitted needs its model: .* params=\{'path': "),
])
def test_bad_models_and_rules_are_named(tiny_llama, model, rule, error, message):
    with pytest.raises(error, match=message) as caught:
        EvictingCache(tiny_llama.model if model == "tiny" else model, rule, budget=16)
    assert "--" not in str(caught.value)


def test_a_huge_budget_allocates_nothing_in_proportion():
    """``budget=10**9`` (once 22 GB: the budget check measured the rule on a cache of budget + interval entries) and
    a plugin rule whose protected() must be measured: both made and run in a process limited to 4 GiB of address
    space (torch and the tiny model need about 1.3 GiB), and a budget no cache reaches never compacts."""
    code = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        from dataclasses import dataclass
        import torch
        from kvdiag.generate import EvictingCache
        from kvdiag.model.load import load_model
        from kvdiag.scorers import Scorer

        @dataclass
        class OwnProtection(Scorer):
            def score(self, ctx):
                return ctx.k.norm(dim=-1)

            def protected(self, age, position):  # not the declared span: measured on a cache of entries
                return age <= 2

        lm = load_model("tiny:llama")
        ids = torch.tensor([list(range(40, 70))])
        for rule in ("rkv", OwnProtection()):
            cache = EvictingCache(lm.model, rule, budget=10**9, interval=8)
            lm.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=4)
            assert cache.compressions == [], cache.compressions
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
