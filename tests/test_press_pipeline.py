"""``as_press`` through kvpress's own ``KVPressTextGenerationPipeline`` (tiny Llama, offline): every built-in rule
either writes, token for token, what ``EvictingCache`` writes on the pipeline's schedule, or is refused by name at
``as_press(...)`` time with its reason; ``compression_ratio=`` is the budget it implies (kvpress's count); the
context is compressed kvpress's way (once) or replay's (in chunks); bad arguments are one ValueError/TypeError
naming the Python argument."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvdiag.generate import EvictingCache, prompt_chunks
from kvdiag.generate.live import kept_entries
from kvdiag.scorers.names import BUILTIN_SCORERS

kvpress = pytest.importorskip("kvpress")

from kvpress import KVPressTextGenerationPipeline  # noqa: E402

from kvdiag.generate.kvpress_export import as_press  # noqa: E402
from tests.test_kvpress_export import answer  # noqa: E402  (the pipeline's loop after the context)

CONTEXT = ("The garden behind the old library has three apple trees, a stone bench and a narrow path to a pond. "
           "Ducks swim there every morning; the gardener counts them at noon, writes the number on a slate by the "
           "gate and feeds them.")  # 223 byte tokens on the tiny models (a leading BOS)
QUESTION = "How many trees?"  # 16 byte tokens (a trailing newline)
# budget (at least every built-in's protected entries: avokv_e keeps 128), interval (below SnapKV's 32-query window:
# the issue's crash), answer tokens (3 intervals: the press's last compression follows the answer's last forward, so
# both caches end compressed)
B, K, G = 128, 16, 48

# every built-in rule without a default instance needs a setting (fitted: its model file)
NEEDS_SETTINGS = {"fitted"}
# the built-ins as_press refuses, and the reason it gives (at as_press time, before any forward)
REFUSED = {name: "every past query's attention" for name in ("h2o", "lazyeviction", "thinkv", "vatp")}


class PipelineSchedule(EvictingCache):
    """EvictingCache compacting where kvpress's pipeline compresses a ``PrefillDecodingPress``: after the context
    (``C`` tokens: once, or at each of replay's chunk ends for ``prefill="chunked"``), then after every ``interval``
    decoding *forwards*, the question (``q`` tokens) being the first: the cache holds ``[0, C + q - 1 + j K)``."""

    def __init__(self, *args, context_len: int, question_len: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.context_len, self.question_len = context_len, question_len

    def checkpoints(self, start: int, end: int) -> list[int]:
        C, q, K = self.context_len, self.question_len, self.policy.interval
        ends = [e for _, e in prompt_chunks(C, self.policy)]
        return [t for t in [*ends, *range(C + q - 1 + K, end, K)] if start <= t < end]


@pytest.fixture(scope="module")
def pipe(tiny_llama):
    return KVPressTextGenerationPipeline(model=tiny_llama.model, tokenizer=tiny_llama.tokenizer)


@pytest.fixture(scope="module")
def inputs(pipe):
    """The context and question token ids [1, n] exactly as kvpress's pipeline tokenizes them."""
    tensors = pipe.preprocess(CONTEXT, [QUESTION], answer_prefix="", max_context_length=10_000)
    return tensors["context_ids"], tensors["questions_ids"][0]


def pipeline_answer(pipe, lm, press, monkeypatch) -> list[int]:
    """The token ids kvpress's pipeline writes with ``press`` (read where it decodes them)."""
    written, decode = [], lm.tokenizer.decode
    monkeypatch.setattr(lm.tokenizer, "decode", lambda ids, **kw: written.append(ids.tolist()) or decode(ids, **kw))
    with torch.no_grad():
        pipe(CONTEXT, question=QUESTION, press=press, max_new_tokens=G)
    monkeypatch.setattr(lm.tokenizer, "decode", decode)
    return written[-1]


@torch.no_grad()
def greedy(lm, cache, context_ids, question_ids, prefill: str) -> list[int]:
    """The pipeline's decoding loop (``generate_answer``) over ``cache``: the context in one forward (EvictingCache
    feeds it in chunks itself through ``prefill``), the question in one forward, then one token per forward."""
    C = context_ids.shape[1]
    if prefill == "chunked":
        cache.prefill(context_ids)
        start = prompt_chunks(C, cache.policy)[-1][0]
        lm.model(input_ids=context_ids[:, start:], cache=cache, use_cache=True, logits_to_keep=1,
                 position_ids=torch.arange(start, C)[None])
    else:
        lm.model(input_ids=context_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return answer(lm, cache, C, question_ids, G)


def reference(lm, rule, inputs, prefill: str, **budget):
    """EvictingCache on the pipeline's schedule: its answer and the cache after the press's last compression."""
    context_ids, question_ids = inputs
    C, q = context_ids.shape[1], question_ids.shape[1]
    cache = PipelineSchedule(lm.model, rule, interval=K, prefill=prefill, context_len=C, question_len=q, **budget)
    out = greedy(lm, cache, context_ids, question_ids, prefill)
    last = C + q - 1 + len(out)  # the cache holds [0, last) after the answer's last forward
    if (last - (C + q - 1)) % K == 0 and len(cache) > cache.policy.budget:
        cache.checkpoint(last)  # the press compresses after that forward too
    return out, cache


RUNS = [name for name in BUILTIN_SCORERS if name not in REFUSED and name not in NEEDS_SETTINGS]


def test_every_builtin_rule_is_classified():
    """A built-in is run below or refused with a pinned reason: the lists name real rules and cover them all."""
    assert set(REFUSED) <= set(BUILTIN_SCORERS) and NEEDS_SETTINGS <= set(BUILTIN_SCORERS)
    assert len(RUNS) + len(REFUSED) + len(NEEDS_SETTINGS) == len(BUILTIN_SCORERS) >= 20


@pytest.mark.parametrize("rule", RUNS)
def test_builtin_rule_through_the_pipeline_equals_the_evicting_cache(tiny_llama, pipe, inputs, rule, monkeypatch):
    """kvpress's pipeline with ``as_press(rule, budget=128, interval=16)``: the answer is EvictingCache's on the same
    schedule, token for token (48 tokens: the context compressed once, then three decoding compressions), and after
    the last compression every layer and KV head holds the same positions. SnapKV (32-query window, interval 16) is the
    issue's crash: the press keeps its own query window across compressions."""
    press = as_press(rule, tiny_llama.model, budget=B, interval=K)
    got = pipeline_answer(pipe, tiny_llama, press, monkeypatch)
    want, cache = reference(tiny_llama, rule, inputs, "once", budget=B)
    assert got == want and len(got) == G
    C, q = inputs[0].shape[1], inputs[1].shape[1]
    assert cache.compressions == [C, C + q - 1 + K, C + q - 1 + 2 * K, C + q - 1 + 3 * K]
    for layer, ev in enumerate(cache.layers):
        assert torch.equal(press.prefilling_press.shared[layer], ev.positions), (rule, layer)


@pytest.mark.parametrize("rule", sorted(REFUSED))
def test_rules_a_press_cannot_run_are_refused_by_name(tiny_llama, rule):
    with pytest.raises(ValueError, match=rf"rule='{rule}'.*{REFUSED[rule]}"):
        as_press(rule, tiny_llama.model, budget=B, interval=K)


def test_the_issue_example_runs(tiny_llama, pipe):
    """``as_press("snapkv", budget=32, interval=16)``: the decoding compressions asked for 32 queries while kvpress's
    buffer held fewer (``ValueError: a window of 32 queries was asked, the live context holds 29``)."""
    press = as_press("snapkv", tiny_llama.model, budget=32, interval=16)
    with torch.no_grad():
        out = pipe(CONTEXT, question=QUESTION, press=press, max_new_tokens=G)
    assert isinstance(out["answer"], str)
    assert all(press.prefilling_press.shared[layer].shape[-1] == 32 for layer in range(2))


@pytest.mark.parametrize("rule", ["rkv", "snapkv", "knorm"])
def test_chunked_context_equals_the_evicting_cache(tiny_llama, pipe, inputs, rule, monkeypatch):
    """``prefill="chunked"``: the press feeds the 223-token context in replay's chunks (144 tokens, then 16 at a
    time, a compression after each) and writes EvictingCache's answer with its default (chunked) prefill, token for
    token; the context is compressed six times, not once."""
    press = as_press(rule, tiny_llama.model, budget=B, interval=K, prefill="chunked")
    got = pipeline_answer(pipe, tiny_llama, press, monkeypatch)
    want, cache = reference(tiny_llama, rule, inputs, "chunked", budget=B)
    assert got == want and len(got) == G
    C = inputs[0].shape[1]
    assert cache.compressions[:6] == [144, 160, 176, 192, 208, 223] and C == 223
    for layer, ev in enumerate(cache.layers):
        assert torch.equal(press.prefilling_press.shared[layer], ev.positions), (rule, layer)
    once = as_press(rule, tiny_llama.model, budget=B, interval=K)
    assert pipeline_answer(pipe, tiny_llama, once, monkeypatch) != got or rule == "knorm"  # knorm reads no queries


def test_chunked_context_keeps_what_replay_keeps(tiny_model):
    """The context alone, outside the pipeline: after replay's chunked prefill the press and EvictingCache hold the
    same positions and (the press recomputes its queries from the kept attention inputs) the same keys and values
    within 1e-5."""
    model, ids = tiny_model.model, torch.tensor([list(range(40, 140))])
    press = as_press("tova", model, budget=32, interval=16, prefill="chunked")
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, cache=cache)
    evicting = EvictingCache(model, "tova", budget=32, interval=16)
    with torch.no_grad():
        evicting.prefill(ids)
        start = prompt_chunks(100, evicting.policy)[-1][0]
        model(ids[:, start:], cache=evicting, use_cache=True, position_ids=torch.arange(start, 100)[None])
    evicting.checkpoint(100)
    assert evicting.compressions == [48, 64, 80, 96, 100]
    for layer, (kv, ev) in enumerate(zip(cache.layers, evicting.layers, strict=True)):
        assert torch.equal(press.prefilling_press.shared[layer], ev.positions), layer
        assert torch.allclose(kv.keys, ev.keys, atol=1e-5) and torch.allclose(kv.values, ev.values, atol=1e-5)


# --------------------------------------------------------------------------- compression_ratio


def test_kept_entries_is_kvpress_count():
    from kvpress.utils import compute_n_kept

    for n in (1, 2, 7, 61, 100, 4096):
        for ratio in (0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 0.9, 0.99):
            assert kept_entries(n, ratio) == compute_n_kept(n, ratio), (n, ratio)


@pytest.mark.parametrize("prefill", ["once", "chunked"])
def test_compression_ratio_is_the_budget_it_implies(tiny_llama, pipe, inputs, prefill, monkeypatch):
    """``compression_ratio=0.45`` on the 223-token context is a budget of 122 (kvpress's count): through the pipeline
    the same answer and the same kept positions as ``budget=122``, and both equal EvictingCache given the ratio."""
    C = inputs[0].shape[1]
    assert kept_entries(C, 0.45) == 122
    by_ratio = as_press("rkv", tiny_llama.model, compression_ratio=0.45, interval=K, prefill=prefill)
    by_budget = as_press("rkv", tiny_llama.model, budget=122, interval=K, prefill=prefill)
    got = pipeline_answer(pipe, tiny_llama, by_ratio, monkeypatch)
    assert got == pipeline_answer(pipe, tiny_llama, by_budget, monkeypatch) and len(got) == G
    assert by_ratio.prefilling_press.shared["budget"] == 122
    for layer in range(tiny_llama.attention.num_layers):
        assert torch.equal(by_ratio.prefilling_press.shared[layer], by_budget.prefilling_press.shared[layer])
    want, cache = reference(tiny_llama, "rkv", inputs, prefill, compression_ratio=0.45)
    assert got == want and cache.budgets == [122]


def test_a_ratio_below_the_protected_entries_is_refused_when_the_context_arrives(tiny_llama, pipe):
    """The budget of a ratio depends on the context: rkv keeps its last 8 entries, and 0.98 of 223 tokens leaves 4."""
    press = as_press("rkv", tiny_llama.model, compression_ratio=0.98, interval=K)
    with pytest.raises(ValueError, match=r"compression_ratio=0.98 keeps 4 of the context's 223 entries: budget=4 is "
                                         r"smaller than the 8 entries rkv always keeps"):
        pipe(CONTEXT, question=QUESTION, press=press, max_new_tokens=4)


# --------------------------------------------------------------------------- bad arguments


BAD = [
    (dict(), ValueError, "exactly one of budget= .* and compression_ratio="),
    (dict(budget=32, compression_ratio=0.5), ValueError, "exactly one of budget="),
    (dict(budget=float("nan")), ValueError, "budget=nan"),
    (dict(budget=float("inf")), ValueError, "budget=inf"),
    (dict(budget=2.5), ValueError, "budget=2.5"),
    (dict(budget="x"), TypeError, "budget='x'"),
    (dict(budget=0), ValueError, "budget=0 is out of range"),
    (dict(budget=True), TypeError, "budget=True"),
    (dict(budget=2**40), ValueError, "budget=1099511627776 is out of range"),
    (dict(compression_ratio=float("nan")), ValueError, "compression_ratio=nan is out of range"),
    (dict(compression_ratio=float("inf")), ValueError, "compression_ratio=inf is out of range"),
    (dict(compression_ratio=1.0), ValueError, "compression_ratio=1.0 is out of range"),
    (dict(compression_ratio=-0.1), ValueError, r"compression_ratio=-0.1 is out of range"),
    (dict(compression_ratio="half"), TypeError, "compression_ratio='half'"),
    (dict(budget=32, interval=0), ValueError, "interval=0 is out of range"),
    (dict(budget=32, interval=1.5), ValueError, "interval=1.5"),
    (dict(budget=32, prefill="twice"), ValueError, "prefill='twice' is not valid"),
    (dict(budget=32, hidden_states_buffer_size=-1), ValueError, "hidden_states_buffer_size=-1"),
    (dict(budget=4, interval=8), ValueError, "budget=4 is smaller than the 8 entries rkv always keeps"),
    (dict(budget=32, params={"nope": 1}), ValueError, "rule='rkv': scorer rkv has no parameter 'nope'"),
    (dict(budget=32, params=[1]), TypeError, "params="),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD)
def test_bad_arguments_are_one_error_naming_the_argument(tiny_llama, kwargs, error, message):
    with pytest.raises(error, match=message) as caught:
        as_press("rkv", tiny_llama.model, **kwargs)
    assert "--" not in str(caught.value)  # the Python API names arguments, not CLI flags


@pytest.mark.parametrize(("rule", "model", "error", "message"), [
    (None, "tiny", TypeError, "rule=None"),
    (42, "tiny", TypeError, "rule=42"),
    ("nope", "tiny", ValueError, "rule='nope': unknown scorer"),
    ("kvpress:KnormPress", "tiny", ValueError, "already a kvpress press"),
    ("rkv", None, TypeError, "model=NoneType"),
    ("rkv", "a string", TypeError, "model=str"),
])
def test_bad_rules_and_models_are_named(tiny_llama, rule, model, error, message):
    with pytest.raises(error, match=message) as caught:
        as_press(rule, tiny_llama.model if model == "tiny" else model, budget=32)
    assert "--" not in str(caught.value)


@pytest.mark.parametrize(("family", "refused"), [
    ("llama", None), ("qwen2", None), ("qwen3", None), ("mistral", None), ("granite", None),
    ("qwen3_moe", "cannot recompute this qwen3_moe model's queries"),  # per-head q_norm kvpress does not apply
    ("olmo2", "cannot recompute this olmo2 model's queries"),  # q_norm over the whole projection
    ("cohere", "cannot recompute this cohere model's queries"),  # interleaved RoPE pairs
    ("smollm3", "cannot recompute this smollm3 model's queries"),  # layers without RoPE (NoPE)
    ("phi3", "partial rotary"), ("gpt_neox", "fused query_key_value"), ("gpt_oss", "half-width RoPE"),
    ("gemma3", "sliding-window layers"),
])
def test_families_whose_queries_the_press_cannot_recompute_are_refused(family, refused):
    """``as_press`` checks, on an 8-token probe, that the queries it recomputes from a layer's attention inputs
    (kvpress's projection, rotate-half RoPE) are the model's own post-RoPE queries, layer by layer: four tiny families
    differ by O(1) of their size and would have been scored from other queries without a word."""
    from kvdiag.generate.kvpress_export import PROBE_TOLERANCE, check_queries
    from kvdiag.model.load import load_model

    lm = load_model(f"tiny:{family}")
    if refused is None:
        press = as_press("rkv", lm.model, budget=32, interval=16)
        assert press.prefilling_press.config.budget == 32
        check_queries(lm.model, lm.attention)  # passes within PROBE_TOLERANCE of the queries' size
        assert PROBE_TOLERANCE <= 1e-3
        return
    with pytest.raises(ValueError, match=rf"^model: .*{refused}"):
        as_press("rkv", lm.model, budget=32, interval=16)
