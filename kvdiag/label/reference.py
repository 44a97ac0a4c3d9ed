"""The slow, obvious per-candidate reference: copy the cache, physically delete, decode step by step.

For each candidate: build a fresh ``DynamicCache`` from the prefix, physically delete the entry from
the affected layers' key/value tensors (for ``head`` granularity, from one KV head inside a reference
attention function, since one cache tensor cannot hold heads of different lengths), then teacher-force
the H tokens one at a time with explicit absolute ``position_ids``. Used by the tests to prove the
batched engine exact, and by ``kvdiag bench label`` as the naive baseline.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvdiag.label.engine import Row, cache_from_prefix
from kvdiag.trace.hooks import attn_implementation

HEAD_DELETE_ATTN = "kvdiag_head_delete"
_TARGET: dict = {}


def _head_delete_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """q = 1 decode step; at the target layer, KV head ``h`` attends over its keys without slot ``i``."""
    kwargs.pop("output_attentions", None)
    if module.layer_idx != _TARGET.get("layer"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    B, H, q, d = query.shape
    Hkv = key.shape[1]
    g = H // Hkv
    out = torch.empty(B, q, H, d, dtype=query.dtype, device=query.device)
    for h in range(H):
        kv = h // g
        k, v = key[0, kv], value[0, kv]
        if kv == _TARGET["kv_head"]:
            keep = torch.arange(k.shape[0], device=k.device) != _TARGET["slot"]
            k, v = k[keep], v[keep]
        w = torch.softmax((query[0, h].float() @ k.float().T) * scaling, dim=-1)
        out[0, :, h] = (w @ v.float()).to(query.dtype)
    return out, None


AttentionInterface.register(HEAD_DELETE_ATTN, _head_delete_attention)
AttentionMaskInterface.register(HEAD_DELETE_ATTN, sdpa_mask)


@contextmanager
def _head_target(model, layer: int, kv_head: int, slot: int):
    _TARGET.update(layer=layer, kv_head=kv_head, slot=slot)
    try:
        with attn_implementation(model, HEAD_DELETE_ATTN):
            yield
    finally:
        _TARGET.clear()


@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor, t: int, horizon: int, prefix, row: Row) -> torch.Tensor:
    """log P [H, V] (fp32) with ``row``'s entry physically deleted from a copied cache; prefix[l] = (k, v) [Hkv, t, d]."""
    copied = []
    for l, (k, v) in enumerate(prefix):
        if row.position >= 0 and row.kv_head < 0 and row.layer in (-1, l):
            keep = torch.arange(k.shape[1], device=k.device) != row.position
            k, v = k[:, keep], v[:, keep]
        copied.append((k.clone(), v.clone()))
    cache = cache_from_prefix(model.config, copied)
    ctx = _head_target(model, row.layer, row.kv_head, row.position) if row.kv_head >= 0 else nullcontext()
    out = []
    with ctx:
        for s in range(horizon):
            pos = torch.tensor([[t + s]], device=ids.device)  # absolute positions, whatever the cache length
            logits = model(ids[None, t + s : t + s + 1], cache=cache, position_ids=pos, use_cache=True).logits[0, -1]
            out.append(torch.log_softmax(logits.float(), -1))
    return torch.stack(out)
