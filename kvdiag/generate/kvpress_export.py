"""kvdiag rules as NVIDIA kvpress presses: :func:`as_press` (the other direction of ``kvpress:<Press>`` scorers).

    from kvpress import KVPressTextGenerationPipeline
    press = as_press("rkv", model, budget=128, interval=128)           # or compression_ratio=0.5, kvpress's way
    pipe(context, question=question, press=press, max_new_tokens=256)

The press is kvpress's ``PrefillDecodingPress``: its prefill press keeps ``budget`` entries per (layer, KV head) of
the context, its ``DecodingPress`` brings the cache back to ``budget`` every ``interval`` decoding forwards. Each
compression scores the layer's cache with the kvdiag rule exactly as a live checkpoint does
(``kvdiag.generate.live.score_layer``: the last ``W_q`` post-RoPE queries, recomputed from the layer's attention
inputs, which the press keeps across compressions as ``EvictingCache`` keeps its query window; each entry's absolute
position, which the press tracks itself; the token ids fed; the rule's protected entries) and keeps each KV head's top
``budget`` (kvdiag's tie-break: the newer entry), in position order.

The context is compressed kvpress's way (``prefill="once"``: one forward, each layer compressed once right after
its attention, as kvpress's presses compress in prefill) or replay's (``prefill="chunked"``: the press feeds the
context in ``EvictingCache``'s chunks, ``budget + interval`` tokens then ``interval`` at a time, each followed by a
compression, so the later chunks attend the compressed cache).

Where kvpress's semantics differ from ``EvictingCache`` (docs/generate.md): it compresses layer by layer, inside
the forward, right after that layer's attention (the later layers of that forward are unaffected: they already read
the full input, as in kvdiag); its decoding schedule counts forwards, not tokens (the question is one forward); its
pipeline feeds the context without the question and then drops the answer's entries after each question.

kvpress 0.5.5 reads ``past_key_values`` and ``cache_position`` from the attention's kwargs, which transformers 5
renamed (``cache``) and dropped; the presses here restore both names before kvpress's hooks read them.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvdiag.core.selection import top_slots
from kvdiag.generate.live import (
    ArgumentError,
    check_choice_arg,
    check_count,
    check_live_scorer,
    check_model,
    check_ratio,
    kept_entries,
    max_positions,
    python_message,
    rule_scorer,
    score_layer,
)
from kvdiag.generate.policy import PREFILLS, Policy, prompt_chunks
from kvdiag.model.adapters import attention_modules, model_attention, rotary_embedding
from kvdiag.model.families import FAMILIES
from kvdiag.scorers import Scorer
from kvdiag.scorers.kvpress_press import INSTALL, PREFIX


def as_press(rule: Scorer | str, model, budget: int | None = None, interval: int = 128, params: dict | None = None,
             hidden_states_buffer_size: int = 256, *, compression_ratio: float | None = None, prefill: str = "once"):
    """A kvpress press running ``rule`` (a Scorer or a registered name, with ``params``) on ``model``.

    budget : entries kept per (layer, KV head) after the context and every ``interval`` decoding forwards; or
        ``compression_ratio`` instead (exactly one; kvpress's own: the fraction of the context's entries removed):
        the budget is then ``max(1, int(C * (1 - compression_ratio)))`` for a context of ``C`` tokens (kvpress's
        ``compute_n_kept``), fixed when the context is fed.
    prefill : ``"once"`` (kvpress's: the context in one forward, compressed once after it) or ``"chunked"``
        (replay's and ``EvictingCache``'s: the press feeds the context in chunks, a compression after each).
    hidden_states_buffer_size : the size of kvpress's own decoding buffer (the rule reads its own query window).

    Refused in one line (``ValueError``/``TypeError`` naming the argument, a ``UserError`` for the CLI) where kvpress
    cannot express the rule: it needs every past query's attention or the Trace's model, it is itself a kvpress
    press, its protected entries exceed the budget, the model's family is one kvpress cannot recompute queries for,
    or the model has sliding-window layers (kvpress's cache rolls them by slot); and for every bad argument."""
    if isinstance(rule, str) and rule.startswith(PREFIX):
        raise ArgumentError(f"rule={rule!r} is already a kvpress press; use {rule[len(PREFIX):]} itself")
    attention = check_model(model)
    scorer = rule_scorer(rule, params)
    family = FAMILIES.get(attention.family)
    if family is not None and family.kvpress:
        raise ArgumentError(f"model: as_press cannot run on {attention.family} models: {family.kvpress}")
    if any(layer.window is not None for layer in attention.layers):
        raise ArgumentError(f"model: as_press {scorer.name}: this model has sliding-window layers, which kvpress's "
                            "cache rolls by slot (a compacted window would be wrong); use "
                            "kvdiag.generate.EvictingCache")
    if scorer.needs_history or scorer.needs_model:
        what = "every past query's attention" if scorer.needs_history else "the Trace's model"
        raise ArgumentError(f"rule={scorer.name!r}: the rule reads {what}, which a kvpress press does not have; use a "
                            "rule that scores from its query window")
    if (budget is None) == (compression_ratio is None):
        raise ArgumentError("give exactly one of budget= (entries kept per (layer, KV head)) and compression_ratio= "
                            f"(the fraction of the context removed); got budget={budget!r}, "
                            f"compression_ratio={compression_ratio!r}")
    budget = None if budget is None else check_count("budget", budget)
    ratio = None if compression_ratio is None else check_ratio("compression_ratio", compression_ratio)
    interval = check_count("interval", interval)
    buffer = check_count("hidden_states_buffer_size", hidden_states_buffer_size, low=0)
    prefill = check_choice_arg("prefill", prefill, PREFILLS)
    check_queries(model, attention)
    group = attention.num_heads // attention.num_kv_heads
    check_live_scorer(scorer, budget, interval, group, attention.qk_head_dim, api=True, limit=max_positions(model))
    config = PressConfig(scorer, budget, ratio, interval, prefill, group, attention.qk_head_dim, max_positions(model))
    classes = press_classes()
    shared: dict = {}
    prefilling = classes.Rule(scorer=scorer, config=config, shared=shared)
    # target_size: kvpress asserts one; the press reads the budget the context fixed (a ratio's is not known yet)
    decoding = classes.Decoding(base_press=classes.Rule(scorer=scorer, config=config, shared=shared),
                                compression_interval=interval, target_size=budget or 1,
                                hidden_states_buffer_size=buffer)
    return classes.PrefillDecoding(prefilling_press=prefilling, decoding_press=decoding, config=config, shared=shared)


@dataclass(frozen=True)
class PressConfig:
    """What one :func:`as_press` was asked (checked): its rule, budget or ratio, schedule and the checks' sizes."""

    scorer: Scorer
    budget: int | None
    compression_ratio: float | None
    interval: int
    prefill: str
    group: int
    head_dim: int
    limit: int

    def budget_for(self, context: int) -> int:
        """The budget of a ``context``-token context: the one given, or the compression ratio's (then checked
        against the rule's protected entries, one ArgumentError naming ``compression_ratio``)."""
        if self.budget is not None:
            return self.budget
        budget = kept_entries(context, self.compression_ratio)
        try:
            check_live_scorer(self.scorer, budget, self.interval, self.group, self.head_dim, api=True,
                              limit=self.limit)
        except ArgumentError as err:
            raise ArgumentError(f"compression_ratio={self.compression_ratio} keeps {budget} of the context's "
                                f"{context} entries: {python_message(err)}") from None
        return budget


def recompute_queries(model, module, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """[b, H, w, d] the post-RoPE queries of attention inputs ``hidden [b, w, hidden]`` at positions
    ``[start, start + w)``, as the press computes them: kvpress's pre-RoPE query projection, then the layer's rotary
    tables (rotate-half RoPE)."""
    from kvpress.utils import get_prerope_query_states

    queries = get_prerope_query_states(module, hidden)  # [b, H, w, d]
    where = torch.arange(start, start + hidden.shape[1], device=hidden.device)[None]
    cos, sin = rotary_embedding(model, module.layer_idx)(hidden, where)
    half = queries.shape[-1] // 2
    rotated = torch.cat([-queries[..., half:], queries[..., :half]], dim=-1)
    return queries * cos[:, None] + rotated * sin[:, None]


# tokens and tolerance of as_press's check that the press recomputes the model's own queries (relative to their size:
# fp32 recomputations agree to ~1e-6; a missing q_norm or another RoPE layout is off by O(1))
PROBE_TOKENS, PROBE_TOLERANCE = 8, 1e-3


@torch.no_grad()
def check_queries(model, attention) -> None:
    """Refuse ``model`` unless the press's recomputed queries (:func:`recompute_queries`) are the post-RoPE queries
    its own attention computes, on every layer, for a short probe: kvpress's projection knows some families' query
    norms and not others' (OLMo 2 and Qwen3-MoE norm their queries, Cohere rotates interleaved pairs), and a press
    scoring from other queries would keep other entries without a word."""
    from kvdiag.cache import PositionedCache, observing

    try:
        from kvpress.utils import get_prerope_query_states  # noqa: F401  (the recomputation's; checked here)
    except ImportError:
        raise ArgumentError(f"as_press needs kvpress: {INSTALL}") from None
    inputs: dict[int, torch.Tensor] = {}

    def keep(module, args, kwargs):
        inputs[module.layer_idx] = kwargs.get("hidden_states", args[0] if args else None)

    found = attention_modules(model)
    modules = [found[layer] for layer in range(attention.num_layers)]
    hooks = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in modules]
    cache = PositionedCache.for_model(model, PROBE_TOKENS)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.arange(PROBE_TOKENS, device=model.device)[None] % vocab
    try:
        with observing(model):
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    for layer, module in enumerate(modules):
        want = cache.queries.rows[layer].float()
        got = recompute_queries(model, module, inputs[layer], 0).float()
        error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))
        if got.shape != want.shape or not error <= PROBE_TOLERANCE:
            raise ArgumentError(f"model: as_press cannot recompute this {attention.family} model's queries from its "
                                f"attention inputs (layer {layer}: {error:.2g} of their size apart; kvpress's query "
                                "projection and rotate-half RoPE are not this family's); use "
                                "kvdiag.generate.EvictingCache")


def restore_kwargs(kwargs: dict) -> dict:
    """The attention kwargs as kvpress 0.5.5 reads them (``past_key_values``, ``cache_position``)."""
    if "past_key_values" not in kwargs:
        kwargs["past_key_values"] = kwargs.get("cache")
    if "cache_position" not in kwargs:
        kwargs["cache_position"] = kwargs["position_ids"][0]
    return kwargs


@functools.cache
def press_classes():
    """The press classes (kvpress is an optional extra: imported on first use)."""
    try:
        from kvpress import DecodingPress, PrefillDecodingPress, ScorerPress
        from kvpress.utils import extract_keys_and_values
    except ImportError:
        raise ArgumentError(f"as_press needs kvpress: {INSTALL}") from None
    from transformers import QuantizedCache

    @dataclass
    class KvdiagRulePress(ScorerPress):
        """A ``ScorerPress`` scoring with a kvdiag rule; keeps the budget of :class:`PressConfig`.

        shared : the state one :func:`as_press`'s presses share, reset when a new context starts: per layer the
            absolute positions [b, Hkv, n] of the cached entries; ``("window", layer)``: the layer's last ``W_q``
            attention inputs [b, w, hidden]; ``prompt_len`` (the context's length), ``budget``, ``ids`` (the token
            ids [b, c] of each forward; None once embeddings were fed) and ``prefill`` (the forward feeds the
            context).
        """

        scorer: Scorer | None = None
        config: PressConfig | None = None
        shared: dict = field(default_factory=dict)

        def post_init_from_model(self, model):
            self.model = model

        def forward_hook(self, module, input, kwargs, output):
            """Compress after this layer's attention in every forward that feeds the context (kvpress's prefill
            compresses only the first: a context fed in chunks is compressed after each)."""
            kwargs = restore_kwargs(kwargs)
            cache = kwargs["past_key_values"]
            if isinstance(cache, QuantizedCache):
                raise ArgumentError("cache: as_press does not compress a QuantizedCache; use a DynamicCache")
            keys, values = extract_keys_and_values(cache, module.layer_idx)
            keys, values = self.compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            cache.layers[module.layer_idx].keys, cache.layers[module.layer_idx].values = keys, values
            return output

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            """keys, values [b, Hkv, n, d] -> the budget's entries per (row, KV head), in position order."""
            n, layer = keys.shape[2], module.layer_idx
            end = int(kwargs["position_ids"][0, -1]) + 1  # the cache holds the survivors of [0, end)
            pos = self._positions(layer, keys.shape[0], keys.shape[1], n, end)
            keep = self.shared["budget"]
            if keep >= n:
                return keys, values
            scores = self._scores(module, keys, values, pos, end)
            slots = top_slots(scores, keep)  # [b, Hkv, keep] ascending: the newer of tied entries
            self.shared[layer] = pos.gather(-1, slots)
            idx = slots.to(keys.device)[..., None].expand(-1, -1, -1, keys.shape[-1])
            return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()

        def _positions(self, layer: int, b: int, Hkv: int, n: int, end: int) -> torch.Tensor:
            """[b, Hkv, n]: the tracked positions of the entries kept so far, then the newest ``n - kept``."""
            known = self.shared.get(layer, torch.empty(b, Hkv, 0, dtype=torch.long))
            if known.shape[-1] > n:  # the pipeline dropped an answer's entries: a new question starts over them
                known = known[..., :n]
            new = torch.arange(end - (n - known.shape[-1]), end).expand(b, Hkv, -1)
            self.shared[layer] = torch.cat([known, new], dim=-1)
            return self.shared[layer]

        def _scores(self, module, keys, values, pos, end) -> torch.Tensor:
            """[b, Hkv, n] the rule's live scores at checkpoint ``end`` (fp32, CPU), from the last
            ``min(W_q, end)`` queries: the layer's kept attention inputs, projected and rotated again."""
            hidden = self.shared[("window", module.layer_idx)]
            w = min(max(self.scorer.query_window, 1), end)
            if hidden.shape[1] < w:
                raise RuntimeError(f"as_press: {hidden.shape[1]} attention inputs kept for a window of {w} (a forward "
                                   "ran without the press)")
            queries = recompute_queries(self.model, module, hidden[:, hidden.shape[1] - w :], end - w)
            layer = module.layer_idx
            o_proj = module.o_proj.weight.detach().float().cpu()
            ids = self.shared.get("ids")
            tokens = None if ids is None else torch.cat(ids, dim=1)  # [b, end]
            attention = model_attention(self.model)
            rows = [score_layer(self.scorer, keys[r], values[r], pos[r], queries[r], end, attention.layers[layer],
                                self.shared["prompt_len"], layer, "", None if tokens is None else tokens[r],
                                "per-head", o_proj)
                    for r in range(keys.shape[0])]
            return torch.stack(rows)

    @dataclass
    class KvdiagDecodingPress(DecodingPress):
        def forward_hook(self, module, input, kwargs, output):
            return super().forward_hook(module, input, restore_kwargs(kwargs), output)

        def _resolve_target_size(self, kwargs: dict) -> int:
            return self.base_press.shared["budget"]  # the as_press budget (a compression ratio's: the context's)

        def _find_target_compression_ratio(self, q_len: int, target_tokens: int) -> float:
            return 0.0  # unused: the rule press keeps exactly the budget

    @dataclass
    class KvdiagPrefillDecodingPress(PrefillDecodingPress):
        """kvpress's ``PrefillDecodingPress``, told the phase by the forward (a forward over an empty cache feeds the
        context) rather than by ``cache_position``, which a chunked context does not start at 0."""

        config: PressConfig | None = None
        shared: dict = field(default_factory=dict)

        def forward_hook(self, module, input, kwargs, output):
            kwargs = restore_kwargs(kwargs)
            self._remember(module.layer_idx, kwargs["hidden_states"])
            if self.shared.get("prefill"):
                return self.prefilling_press.forward_hook(module, input, kwargs, output)
            return self.decoding_press.forward_hook(module, input, kwargs, output)

        def _remember(self, layer: int, hidden: torch.Tensor) -> None:
            """Keep the layer's last ``W_q`` attention inputs [b, w, hidden] (kvpress clears its own buffer at each
            compression; the rule's query window outlives compressions, as EvictingCache's does)."""
            w = max(self.config.scorer.query_window, 1)
            key = ("window", layer)
            old = self.shared.get(key)
            both = hidden.detach() if old is None else torch.cat([old, hidden.detach()], dim=1)
            self.shared[key] = both[:, max(0, both.shape[1] - w) :].clone()

        @contextmanager
        def __call__(self, model):
            language = model.model.language_model if hasattr(model.model, "language_model") else model.model
            handle = language.register_forward_pre_hook(self._before_forward, with_kwargs=True)
            try:
                with super().__call__(model):
                    yield
            finally:
                handle.remove()

        def _before_forward(self, language, args: tuple, kwargs: dict):
            """The language model's pre-hook: a forward over an empty cache starts a context (the shared state is
            reset, the budget set); ``prefill="chunked"`` feeds all its chunks but the last from here."""
            if self.shared.get("feeding"):  # a chunk this hook feeds itself
                return None
            kwargs = dict(kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if ids is None and kwargs.get("inputs_embeds") is None:
                return None
            c = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
            starts = cache is None or cache.get_seq_length() == 0
            self.shared["prefill"] = starts
            if not starts:
                if self.shared.get("ids") is not None:
                    self.shared["ids"].append(None if ids is None else ids.detach().cpu())
                    if ids is None:
                        self.shared["ids"] = None
                return None
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and not bool((mask != 0).all()):
                raise ArgumentError("attention_mask: as_press does not take padded contexts (the press numbers "
                                    "entries from 0 in every row); give one row, or rows of one length")
            self.shared.clear()
            self.shared.update(prefill=True, prompt_len=c, budget=self.config.budget_for(c), ids=[])
            chunks = [(0, c)]
            if self.config.prefill == "chunked":
                policy = Policy(self.config.scorer, self.shared["budget"], self.config.interval, prefill="chunked")
                chunks = prompt_chunks(c, policy)
            if len(chunks) == 1:  # the context in this one forward (kvpress's way, or shorter than a chunk)
                self.shared["ids"] = None if ids is None else [ids.detach().cpu()]
                return None
            if ids is None:
                if len(chunks) > 1:
                    raise ArgumentError("inputs_embeds: as_press(prefill='chunked') feeds the context's token ids in "
                                        "chunks; pass input_ids")
                return None
            if cache is None:  # the chunks need one cache to share
                from transformers import DynamicCache

                cache = DynamicCache()
            kwargs.pop("past_key_values", None)
            kwargs.pop("attention_mask", None)
            kwargs.pop("input_ids", None)
            args = ()
            kwargs["cache"] = cache
            self.shared["feeding"] = True
            try:
                for start, end in chunks[:-1]:
                    self.shared["ids"].append(ids[:, start:end].detach().cpu())
                    language(input_ids=ids[:, start:end], cache=cache, use_cache=True,
                             position_ids=torch.arange(start, end, device=ids.device)[None])
            finally:
                self.shared["feeding"] = False
            start = chunks[-1][0]
            self.shared["ids"].append(ids[:, start:].detach().cpu())
            kwargs["input_ids"] = ids[:, start:]
            kwargs["position_ids"] = torch.arange(start, c, device=ids.device)[None]
            return args, kwargs

    return type("PressClasses", (), {"Rule": KvdiagRulePress, "Decoding": KvdiagDecodingPress,
                                     "PrefillDecoding": KvdiagPrefillDecodingPress})
