"""kvdiag rules as NVIDIA kvpress presses: :func:`as_press` (the other direction of ``kvpress:<Press>`` scorers).

    from kvpress import KVPressTextGenerationPipeline
    press = as_press("rkv", model, budget=128, interval=128)
    pipe(context, question=question, press=press, max_new_tokens=256)

The press is kvpress's ``PrefillDecodingPress``: its prefill press keeps ``budget`` entries per (layer, KV head)
at the end of the context, its ``DecodingPress`` brings the cache back to ``budget`` every ``interval`` decoding
forwards. Each compression scores the layer's cache with the kvdiag rule exactly as a live checkpoint does
(``kvdiag.generate.live.score_layer``: the last ``W_q`` post-RoPE queries, recomputed from the layer's buffered
attention inputs; each entry's absolute position, which the press tracks itself; the rule's protected entries) and
keeps each KV head's top ``budget`` (kvdiag's tie-break: the newer entry), in position order.

Where kvpress's semantics differ from ``EvictingCache`` (docs/generate.md): it compresses layer by layer, inside
the forward, right after that layer's attention (the prefill's later layers are unaffected: they already read
the full context, as in kvdiag); its decoding schedule counts forwards, not tokens (the question is one forward);
its pipeline feeds the context without the question and then drops the answer's entries after each question; the
query window of a decoding compression is the layer's ``hidden_states_buffer_size`` last attention inputs.

kvpress 0.5.5 reads ``past_key_values`` and ``cache_position`` from the attention's kwargs, which transformers 5
renamed (``cache``) and dropped; the presses here restore both names before kvpress's hooks read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvdiag.core.errors import UserError
from kvdiag.core.selection import top_slots
from kvdiag.generate.live import check_live_scorer, make_scorer, score_layer
from kvdiag.model.adapters import model_attention, rotary_embedding
from kvdiag.scorers import Scorer
from kvdiag.scorers.kvpress_press import INSTALL, PREFIX


def as_press(rule: Scorer | str, model, budget: int, interval: int = 128, params: dict | None = None,
             hidden_states_buffer_size: int = 256):
    """A kvpress press running ``rule`` (a Scorer or a registered name, with ``params``) on ``model``: ``budget``
    entries per (layer, KV head) after the context and every ``interval`` decoding forwards.

    Refused in one line (UserError) where kvpress cannot express the rule: it needs every past query's attention
    or the Trace's model, it is itself a kvpress press, its protected entries exceed the budget, or the model has
    sliding-window layers (kvpress's cache rolls them by slot)."""
    if isinstance(rule, str) and rule.startswith(PREFIX):
        raise UserError(f"as_press {rule}: already a kvpress press; use {rule[len(PREFIX):]} itself")
    scorer = rule if isinstance(rule, Scorer) else make_scorer(rule, params)
    attention = model_attention(model)
    if any(layer.window is not None for layer in attention.layers):
        raise UserError(f"as_press {scorer.name}: this model has sliding-window layers, which kvpress's cache rolls by "
                        "slot (a compacted window would be wrong); use kvdiag.generate.EvictingCache")
    if scorer.needs_history or scorer.needs_model:
        what = "every past query's attention" if scorer.needs_history else "the Trace's model"
        raise UserError(f"as_press {scorer.name}: the rule reads {what}, which a kvpress press does not have; use a "
                        "rule that scores from its query window")
    check_live_scorer(scorer, budget, interval, attention.num_heads // attention.num_kv_heads,
                      attention.qk_head_dim)
    if budget < 1 or interval < 1:
        raise UserError(f"as_press {scorer.name}: budget {budget} and interval {interval} must be positive")
    if scorer.query_window > hidden_states_buffer_size:
        raise UserError(f"as_press {scorer.name}: its query window ({scorer.query_window}) is longer than the "
                        f"decoding buffer ({hidden_states_buffer_size}); raise hidden_states_buffer_size")
    classes = press_classes()
    prefill = classes.Rule(scorer=scorer, target_size=budget)
    decoding = classes.Decoding(base_press=classes.Rule(scorer=scorer, shared=prefill.shared),
                                compression_interval=interval, target_size=budget,
                                hidden_states_buffer_size=hidden_states_buffer_size)
    return classes.PrefillDecoding(prefilling_press=prefill, decoding_press=decoding)


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
        from kvpress.utils import get_prerope_query_states
    except ImportError:
        raise UserError(f"as_press needs kvpress: {INSTALL}") from None

    @dataclass
    class KvdiagRulePress(ScorerPress):
        """A ``ScorerPress`` scoring with a kvdiag rule; keeps ``target_size`` entries (else kvpress's ratio).

        shared : what the prefill and decoding presses of one :func:`as_press` share: per layer the absolute
            positions [b, Hkv, n] of the cached entries, and ``prompt_len`` (the context's length).
        """

        scorer: Scorer | None = None
        target_size: int | None = None
        shared: dict = field(default_factory=dict)

        def post_init_from_model(self, model):
            self.model, self.attention = model, model_attention(model)

        def forward_hook(self, module, input, kwargs, output):
            return super().forward_hook(module, input, restore_kwargs(kwargs), output)

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            n, layer = keys.shape[2], module.layer_idx
            keep = n if self.target_size is None else min(n, self.target_size)
            if self.target_size is None:
                from kvpress.utils import compute_n_kept

                keep = compute_n_kept(n, self.compression_ratio)
            end = int(kwargs["position_ids"][0, -1]) + 1  # the cache holds the survivors of [0, end)
            self.shared.setdefault("prompt_len", end)  # the first compression is the context's
            pos = self._positions(layer, keys.shape[0], keys.shape[1], n, end)
            if keep >= n:
                return keys, values
            scores = self._scores(module, hidden_states, keys, values, pos, end)
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

        def _scores(self, module, hidden_states, keys, values, pos, end) -> torch.Tensor:
            """[b, Hkv, n] the rule's live scores at checkpoint ``end`` (fp32, on the keys' device)."""
            w = min(max(self.scorer.query_window, 1), hidden_states.shape[1])
            queries = get_prerope_query_states(module, hidden_states[:, -w:])  # [b, H, w, d]
            where = torch.arange(end - w, end, device=hidden_states.device)[None]
            cos, sin = rotary_embedding(self.model, module.layer_idx)(hidden_states[:, -w:], where)
            half = queries.shape[-1] // 2
            rotated = torch.cat([-queries[..., half:], queries[..., :half]], dim=-1)
            queries = queries * cos[:, None] + rotated * sin[:, None]
            layer = module.layer_idx
            o_proj = module.o_proj.weight.detach().float().cpu()
            rows = [score_layer(self.scorer, keys[r], values[r], pos[r], queries[r], end,
                                self.attention.layers[layer], self.shared["prompt_len"], layer, "", None,
                                "per-head", o_proj)
                    for r in range(keys.shape[0])]
            return torch.stack(rows)

    @dataclass
    class KvdiagDecodingPress(DecodingPress):
        def forward_hook(self, module, input, kwargs, output):
            return super().forward_hook(module, input, restore_kwargs(kwargs), output)

        def _find_target_compression_ratio(self, q_len: int, target_tokens: int) -> float:
            self.base_press.target_size = target_tokens  # kvdiag's budget rule: keep exactly the target
            return 0.0

    @dataclass
    class KvdiagPrefillDecodingPress(PrefillDecodingPress):
        def forward_hook(self, module, input, kwargs, output):
            return super().forward_hook(module, input, restore_kwargs(kwargs), output)

    return type("PressClasses", (), {"Rule": KvdiagRulePress, "Decoding": KvdiagDecodingPress,
                                     "PrefillDecoding": KvdiagPrefillDecodingPress})
