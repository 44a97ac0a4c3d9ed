"""Attention-function hooks registered with transformers' ``AttentionInterface``.

Recording goes through a registered attention function (not patched model classes), so every
architecture that uses the interface works. The function receives post-RoPE (and, for Qwen3,
post q/k-norm) queries ``[B, H, q, d]`` and the full cached keys/values ``[B, Hkv, kv, d]``;
it records the newest rows and then calls the model's own attention implementation (SDPA, or the
model file's eager function where SDPA cannot express its attention: softcap, sinks; chosen by
``kvdiag.model.adapters``), so outputs are unchanged. The generation's cache is the positioned cache
(``kvdiag.cache.PositionedCache`` with a capacity: blocks allocated once), whose hand-off the function reads.
Each variant is registered with its own mask builder: without one transformers passes no mask and SDPA would slice
the keys wrongly when ``q > 1`` over a non-empty cache; eager needs a float additive mask.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvdiag.cache import append_rows, take_handoff
from kvdiag.model.adapters import check_kwargs, model_attention
from kvdiag.model.attention import attention_context, model_eager_attention

TRACE_ATTN = "kvdiag_trace"  # records, then runs SDPA
TRACE_ATTN_EAGER = "kvdiag_trace_eager"  # records, then runs the model file's eager attention
# generate() rejects unknown model kwargs, so the active recorder travels in a context variable
_RECORDER: ContextVar[Recorder | None] = ContextVar("kvdiag_recorder", default=None)


class Recorder:
    """Collects per-layer post-RoPE q/k/v rows of batch row 0 in ``dtype``, written as they arrive into
    preallocated blocks per layer: memory is the rows themselves (O(1) per step, no per-step tensor objects).
    With ``capacity`` (the trace's longest possible length) each block is allocated once and its pages are
    touched only as rows arrive; without it, or past it, blocks double when full (never more than twice
    the rows)."""

    def __init__(self, num_layers: int, dtype: torch.dtype, capacity: int = 64):
        self.dtype, self.capacity = dtype, capacity
        self.attention = None  # the model's ModelAttention, set by recording()
        self.blocks: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]  # name -> [heads, capacity, d]
        self.length = [0] * num_layers

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        start, blocks = self.length[layer], self.blocks[layer]
        for name, rows in (("q", q), ("k", k), ("v", v)):
            # a copy (to the CPU, in the storage dtype): never a view of the cache
            blocks[name] = append_rows(blocks.get(name), start, rows, self.capacity, self.dtype, torch.device("cpu"))
        self.length[layer] = start + q.shape[1]

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """q [H, T, d], k [Hkv, T, d], v [Hkv, T, d] of one layer, contiguous (copies of the filled rows)."""
        T = self.length[layer]
        return {name: block[:, :T].contiguous() for name, block in self.blocks[layer].items()}

    def nbytes(self) -> int:
        """Bytes held by the blocks (capacity, not only the filled rows)."""
        return sum(b.numel() * b.element_size() for blocks in self.blocks for b in blocks.values())


def _record(module, query, key, value, kwargs) -> None:
    # the positioned cache's hand-off is read here: its layers are contiguous in position (never compacted), so
    # transformers' slot-based masks (sliding windows included) are exact and are kept as the model's own
    take_handoff()
    recorder = _RECORDER.get()
    # semantics kwargs (window, softcap, sinks) must agree with the adapter; unknown ones are refused
    check_kwargs(
        module, recorder.attention.layers[module.layer_idx] if recorder and recorder.attention else None, dict(kwargs),
        "trace",
    )
    if recorder is not None:
        n = query.shape[2]
        recorder.add(module.layer_idx, query[0], key[0, :, -n:], value[0, :, -n:])


def trace_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, q, d], key/value [B, Hkv, kv, d] (whole cache) -> SDPA output [B, q, H, d]."""
    _record(module, query, key, value, kwargs)
    kwargs.pop("output_attentions", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def trace_attention_eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """As :func:`trace_attention`, through the model file's eager attention (output [B, q, H, d], weights)."""
    _record(module, query, key, value, kwargs)
    return model_eager_attention(module)(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


AttentionInterface.register(TRACE_ATTN, trace_attention)
AttentionMaskInterface.register(TRACE_ATTN, sdpa_mask)
AttentionInterface.register(TRACE_ATTN_EAGER, trace_attention_eager)
AttentionMaskInterface.register(TRACE_ATTN_EAGER, eager_mask)


def recording(model, recorder: Recorder):
    """Route ``model``'s attention through the tracing function and record into ``recorder``; the function
    runs the implementation that reproduces the model (``kvdiag.model.adapters``: SDPA or eager)."""
    ma = model_attention(model)
    recorder.attention = ma
    return attention_context(
        model, TRACE_ATTN_EAGER if ma.implementation == "eager" else TRACE_ATTN, _RECORDER, recorder
    )


def attention_scale(model) -> float:
    """The softmax scale of the model's first layer (the manifest's legacy ``scale``; per-layer semantics,
    windows, softcap and sinks are in the manifest's ``model.attention``, from ``kvdiag.model.adapters``)."""
    return model_attention(model).scale
