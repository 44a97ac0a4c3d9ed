"""Exact attention recomputed from recorded post-RoPE queries and keys, and the switch that runs a model through
one of kvdiag's registered attention functions (trace, label and replay each register theirs).

Attention is never stored in a Trace: it is O(T^2). These helpers recompute exact
fp32 softmax rows from ``q`` and ``k``, chunked over queries so memory stays bounded, with the
layer's semantics from ``kvdiag.model.adapters.LayerAttention`` (scale, sliding window, softcap, sinks).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from kvdiag.model.adapters import LayerAttention, as_layer_attention


def group_size(num_heads: int, num_kv_heads: int) -> int:
    """GQA group size g: query head ``h`` reads KV head ``h // g`` (transformers' ``repeat_kv`` order)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return num_heads // num_kv_heads


def attention_rows(
    q: torch.Tensor, k: torch.Tensor, query_positions: torch.Tensor, scale: LayerAttention | float,
    key_limit: int | None = None, chunk: int = 256,
) -> torch.Tensor:
    """Exact attention probabilities of selected queries over all their visible keys.

    q [H, W, d] (queries at absolute ``query_positions [W]``), k [Hkv, T, d] (key j at position j).
    ``scale``: the layer's :class:`~kvdiag.model.adapters.LayerAttention` (a bare float = plain causal softmax with
    that scale). The query at position ``tau`` sees keys ``j <= tau`` (and ``j > tau - window`` on a
    sliding layer); logits are scaled and soft-capped; a layer's sink logits sit in the denominator, so
    rows then sum to less than 1 (as the model's eager weights). ``key_limit`` truncates the returned
    columns to ``[0, key_limit)`` *after* the softmax (the normalizer still covers every visible key).
    Returns fp32 [H, W, key_limit or T].
    """
    attn = as_layer_attention(scale)
    H, W, _ = q.shape
    Hkv, T, _ = k.shape
    g = group_size(H, Hkv)
    cols = T if key_limit is None else key_limit
    out = torch.empty(H, W, cols, dtype=torch.float32)
    kf = k.float()
    key_pos = torch.arange(T)
    for s in range(0, W, chunk):
        qc = q[:, s : s + chunk].float()  # [H, c, d]
        pos = query_positions[s : s + chunk]
        # GQA without repeat_kv: view queries as [Hkv, g*c, d]
        qg = qc.reshape(Hkv, g * qc.shape[1], -1)
        logits = attn.logits((qg @ kf.transpose(1, 2)).reshape(H, qc.shape[1], T))
        logits.masked_fill_(attn.hidden(pos, key_pos)[None], float("-inf"))
        probs = torch.softmax(logits, dim=-1) if attn.sinks is None else attn.softmax(logits, heads_dim=0)
        out[:, s : s + chunk] = probs[..., :cols]
    return out


@torch.no_grad()
def future_attention(trace, pid: str, t: int, window: int) -> torch.Tensor:
    """[L, Hkv, t] fp64: per (layer, KV head), the attention that the full-cache run's queries at ``t .. t + window
    - 1`` pay each entry [0, t), summed over those queries and the KV head's query heads (its GQA group); exact fp32
    probabilities recomputed from the q and k of ``trace`` (a ``kvdiag.trace.Trace``: stored, or rebuilt from its
    model) with each layer's scale, window, softcap and sinks (``Trace.attention``). Belady-style: the entries the
    future reads most. Shared by ``kvdiag decisions`` (a reference set) and teacher-forced replay (a policy)."""
    pos = torch.arange(t, t + window)
    Hkv = trace.num_kv_heads
    return torch.stack([trace.attention(pid, l, pos, key_limit=t).double().view(Hkv, -1, t).sum(1)
                        for l in range(trace.num_layers)])


@contextmanager
def attn_implementation(model, name: str):
    """Switch ``model`` to the registered attention function ``name`` for the block, then restore."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def attention_context(model, name: str, var: ContextVar, value):
    """Run ``model`` with the registered attention function ``name``, which reads ``value`` from ``var``."""
    token = var.set(value)
    try:
        with attn_implementation(model, name):
            yield value
    finally:
        var.reset(token)


def model_eager_attention(module):
    """The eager attention function of ``module``'s model file (softcap, sinks and all)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__module__} has no eager_attention_forward")
    return fn
