"""The eviction attention function: N candidate rows over one shared prefix, each with its exclusions.

Registered as ``kvdiag_evict``. The model runs the W teacher-forced tokens of every row without a
cache object (``use_cache=False``), so ``key``/``value`` are exactly the rows' own suffixes; the
shared prefix (never copied per row) and the per-layer exclusions travel in a context variable.
Attention itself is ``kvdiag.kernels.shared_prefix_attention`` (Triton on CUDA, torch on CPU), with each
layer's window, softcap and sinks from ``kvdiag.model.adapters`` (the kwargs the model passes are checked against it).
A horizon run in chunks keeps each row's keys and values of the earlier chunks in ``EvictionBatch.suffix`` (the
continuation cache, allocated once per layer for the whole horizon and filled chunk by chunk, so it is never copied
to grow): a chunk's queries see them before their own.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvdiag.kernels import shared_prefix_attention
from kvdiag.model.adapters import LayerAttention, check_kwargs
from kvdiag.model.attention import attention_context

EVICT_ATTN = "kvdiag_evict"


@dataclass
class EvictionBatch:
    """prefix[l] = (k [Hkv, P, d], v [Hkv, P, d]) at positions [0, P); exclude[l] = int64 [N, Hkv, E]
    (-1 = none) or None; attention[l]: the layer's semantics (scale, window, softcap, sinks). suffix: None (one
    forward per horizon), or per layer the rows' (k, v) [N, Hkv, steps, d] continuation cache (None until the layer's
    first chunk), of which steps [0, offset) are filled: chunked horizons."""

    prefix: list[tuple[torch.Tensor, torch.Tensor]]
    exclude: list[torch.Tensor | None]
    attention: list[LayerAttention]
    backend: str = "auto"
    suffix: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    steps: int = 0  # the horizon the continuation caches hold
    offset: int = 0  # the horizon step of this forward's first token (set before each chunk)


_BATCH: ContextVar[EvictionBatch | None] = ContextVar("kvdiag_eviction_batch", default=None)


def evict_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [N, H, W, d], key/value [N, Hkv, W, d] (the rows' suffixes) -> [N, W, H, d]."""
    batch = _BATCH.get()
    if batch is None:
        raise RuntimeError(f"{EVICT_ATTN} attention called outside kvdiag.label.hooks.evicting()")
    spec = batch.attention[module.layer_idx]
    check_kwargs(module, spec, kwargs, "label")
    if scaling is not None and abs(scaling - spec.scale) > 1e-12 * abs(spec.scale):
        raise RuntimeError(f"layer {module.layer_idx} scales attention by {scaling}, the adapter says {spec.scale}")
    pk, pv = batch.prefix[module.layer_idx]
    if batch.suffix is not None:  # a chunk: the queries are the last W of the row's continuation so far
        if batch.suffix[module.layer_idx] is None:
            n, hkv, _, d = key.shape
            batch.suffix[module.layer_idx] = tuple(key.new_empty(n, hkv, batch.steps, d) for _ in range(2))
        k, v = batch.suffix[module.layer_idx]
        end = batch.offset + key.shape[2]
        k[:, :, batch.offset : end] = key
        v[:, :, batch.offset : end] = value
        key, value = k[:, :, :end], v[:, :, :end]
    sinks = None if spec.sinks is None else spec.sinks.to(query.device)
    out = shared_prefix_attention(
        query, pk, pv, key, value, batch.exclude[module.layer_idx], scale=spec.scale, backend=batch.backend,
        window=spec.window, softcap=spec.softcap, sinks=sinks,
    )
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    """The kernel applies causality and exclusions itself; skip building HF's mask."""
    return


AttentionInterface.register(EVICT_ATTN, evict_attention)
AttentionMaskInterface.register(EVICT_ATTN, _no_mask)


def evicting(model, batch: EvictionBatch):
    """Run ``model``'s attention as N candidate rows over ``batch``'s shared prefix."""
    return attention_context(model, EVICT_ATTN, _BATCH, batch)
