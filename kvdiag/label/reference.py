"""The slow, obvious per-candidate reference: copy the cache, physically delete, decode step by step.

For each candidate (an entry, or a set of entries: ``reference_set_logprobs``): build a fresh cache from the prefix,
physically delete the entries from the affected layers' key/value tensors (where the KV heads of a layer evict
different entries, as at ``head`` granularity or for a per-head set, they are hidden from each KV head's query heads
by the mask instead, since one cache tensor cannot hold heads of different lengths), then teacher-force the H tokens
one at a time with explicit absolute ``position_ids``. Attention is the stock model file's
eager function (softcap, sinks and all), with a mask built on the entries' *absolute* positions from
transformers' own ``causal_mask_function`` and ``sliding_window_overlay`` (window from the
``sliding_window`` the layer passes, not from kvdiag's adapter): after a deletion, cache slots are no
longer positions, so transformers' slot-based mask would misplace the window.

Used by the tests to prove the batched engine exact, and by ``kvdiag bench label`` as the naive baseline.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sliding_window_overlay

from kvdiag.label.engine import Row, cache_from_prefix
from kvdiag.model.attention import attn_implementation, model_eager_attention

REFERENCE_ATTN = "kvdiag_reference"


@dataclass
class _State:
    key_pos: list[torch.Tensor]  # per layer: absolute positions of the cache slots (prefix after deletion)
    hide: list[torch.Tensor | None]  # per layer: bool [Hkv, slots], prefix slots one KV head's queries do not see
    num_kv_heads: int


_STATE: list[_State] = []


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, H, q, d], key/value [1, Hkv, kv, d]: the layer's cache plus the new tokens."""
    state = _STATE[-1]
    layer = module.layer_idx
    q_pos = kwargs["position_ids"][0].to(key.device)  # [q] absolute
    kv = key.shape[2]
    prefix = state.key_pos[layer].to(key.device)
    new = kv - len(prefix)
    # the new entries are the teacher-forced tokens so far, at consecutive absolute positions ending at q_pos[-1]
    k_pos = torch.cat([prefix, torch.arange(int(q_pos[-1]) - new + 1, int(q_pos[-1]) + 1, device=key.device)])
    qi, ki = q_pos[:, None], k_pos[None, :]
    visible = causal_mask_function(0, 0, qi, ki)
    window = kwargs.get("sliding_window")
    if window is not None:
        visible = visible & sliding_window_overlay(window)(0, 0, qi, ki)
    H = query.shape[1]
    visible = visible[None, None].expand(1, H, -1, -1).clone()  # [1, H, q, kv]
    hide = state.hide[layer]
    if hide is not None:  # per-KV-head evictions: hidden from that head's query heads (one tensor holds all heads)
        g = H // state.num_kv_heads
        slots = hide.shape[1]
        visible[0, :, :, :slots] &= ~hide.to(key.device).repeat_interleave(g, 0)[:, None, :]
    mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
    mask.masked_fill_(~visible, torch.finfo(query.dtype).min)
    kwargs.pop("output_attentions", None)
    return model_eager_attention(module)(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)


def _no_mask(*args, **kwargs):
    return None  # the reference attention builds its own mask from absolute positions


AttentionInterface.register(REFERENCE_ATTN, _reference_attention)
AttentionMaskInterface.register(REFERENCE_ATTN, _no_mask)


@contextmanager
def _reference(model, state: _State):
    _STATE.append(state)
    try:
        with attn_implementation(model, REFERENCE_ATTN):
            yield
    finally:
        _STATE.pop()


@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor, t: int, horizon: int, prefix, row: Row) -> torch.Tensor:
    """log P [H, V] (fp32) with ``row``'s entry deleted (:func:`reference_set_logprobs` of a one-entry set);
    prefix[l] = (k, v) [Hkv, t, d]."""
    L, Hkv = len(prefix), prefix[0][0].shape[0]
    evict = []
    for l in range(L):
        heads = [row.position if row.position >= 0 and row.layer in (-1, l) and row.kv_head in (-1, h) else -1
                 for h in range(Hkv)]
        evict.append([[p] for p in heads])
    return reference_set_logprobs(model, ids, t, horizon, prefix, torch.tensor(evict))


@torch.no_grad()
def reference_set_logprobs(model, ids: torch.Tensor, t: int, horizon: int, prefix, evict: torch.Tensor) -> torch.Tensor:
    """log P [H, V] (fp32) with the set ``evict`` deleted: [E] positions from every layer and KV head, or
    [L, Hkv, E] per layer and KV head (``-1`` = none). A layer whose KV heads evict the same positions loses them
    physically (a copied cache without those entries); a layer whose heads differ keeps one tensor and hides each
    head's entries from that head's query heads by the mask. The H tokens are then teacher-forced one at a time
    with absolute ``position_ids``; prefix[l] = (k, v) [Hkv, t, d]."""
    L, Hkv = len(prefix), prefix[0][0].shape[0]
    evict = torch.as_tensor(evict, dtype=torch.long).cpu()
    if evict.dim() == 1:
        evict = evict.expand(L, Hkv, -1)
    copied, key_pos, hide = [], [], []
    for l, (k, v) in enumerate(prefix):
        pos = torch.arange(k.shape[1])
        gone = torch.zeros(Hkv, k.shape[1], dtype=torch.bool)
        for h in range(Hkv):
            e = evict[l, h]
            gone[h, e[e >= 0]] = True
        layer_hide = None
        if bool((gone == gone[:1]).all()):  # the same entries from every head: delete them
            keep = ~gone[0]
            k, v, pos = k[:, keep.to(k.device)], v[:, keep.to(v.device)], pos[keep]
        else:
            layer_hide = gone
        copied.append((k.clone(), v.clone()))
        key_pos.append(pos)
        hide.append(layer_hide)
    cache = cache_from_prefix(model.config, copied)
    state = _State(key_pos, hide, Hkv)
    out = []
    with _reference(model, state):
        for s in range(horizon):
            pos = torch.tensor([[t + s]], device=ids.device)  # absolute positions, whatever the cache length
            logits = model(ids[None, t + s : t + s + 1], cache=cache, position_ids=pos, use_cache=True).logits[0, -1]
            out.append(torch.log_softmax(logits.float(), -1))
    return torch.stack(out)
