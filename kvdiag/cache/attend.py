"""The attention function a positioned cache runs under: the model's own kernel (SDPA, or the model file's eager
attention where SDPA cannot express it), fed a mask built from the cache's positions and recording the queries.

Each :class:`~kvdiag.cache.positioned.PositionedLayer` hands itself to the attention call of its layer (a
context variable set by ``update``, read once here): the attention function then records the layer's post-RoPE
queries into the cache's :class:`QueryWindow` and, for a sliding layer, replaces transformers' slot-based mask by
one from positions (query ``q`` sees key ``k`` iff ``q - W < k <= q``: a window is a position distance). Full layers
keep transformers' own causal mask, which is exact on a compacted cache (kept entries precede the new ones and
``PositionedCache.get_query_offset`` is the physical length), so their kernel path is the one plain decoding takes.
In a left-padded batch every layer is masked by position (transformers' padding mask indexes slots, which a
compaction moves), except a full layer's one-token forward once it holds no padding or filler slot (no negative
position): that query sees every key, and runs unmasked, as unpadded decoding does (#58: building the mask and
the masked SDPA were about 2% of a padded batch's decoding time).
A hand-off left unread means the model ran another attention function: the next ``update`` refuses to continue.
The Trace recorder's attention function (``kvdiag.trace.hooks``) reads the hand-off too (:func:`take_handoff`).
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvdiag.model.adapters import check_kwargs, model_attention
from kvdiag.model.attention import attn_implementation, model_eager_attention

KVDIAG_ATTN = "kvdiag_replay"  # the registered name (also what replay recorded in earlier releases' configs)

# the layer whose keys the next attention call reads: (PositionedLayer, query positions [b, c], QueryWindow or
# None) or None
HANDOFF: ContextVar[tuple | None] = ContextVar("kvdiag_positioned_layer", default=None)


class QueryWindow:
    """The last ``size`` post-RoPE queries of every layer for each batch row, ``[b, H, w, d]`` with ``w <= size``."""

    def __init__(self, num_layers: int, size: int):
        self.size = size
        self.rows: list[torch.Tensor | None] = [None] * num_layers

    def add(self, layer: int, query: torch.Tensor) -> None:
        """query [b, H, c, d]: the newest ``c`` queries of ``layer`` for every batch row."""
        rows = self.rows[layer]
        rows = query if rows is None else torch.cat([rows, query], dim=2)
        self.rows[layer] = rows[:, :, -self.size :].detach()

    def get(self, layer: int, row: int = 0) -> torch.Tensor:
        """[H, w, d] the window of batch row ``row``."""
        return self.rows[layer][row]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (finished generations leave the batch)."""
        self.rows = [None if r is None else r[rows.to(r.device)] for r in self.rows]


def position_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, heads: int,
                  padded: bool = False) -> torch.Tensor:
    """bool [b, H or 1, c, n] (True: attend) from query positions [b, c] and key positions [b, Hkv, n].

    Query ``q`` sees key ``k`` iff ``k <= q`` and, with a sliding ``window`` W, ``q - k < W`` (transformers'
    ``sliding_window_overlay``). ``padded``: negative positions are left padding (``PositionedLayer.offsets``), which
    no real query sees; a padding query sees the padding before it (its output is never read, but a row with nothing
    to attend would be NaN, and NaN values times a zero weight would reach the real rows). Keys shared by every KV
    head give one mask row for all heads; else KV head ``h``'s row serves its ``H / Hkv`` query heads (transformers'
    ``repeat_kv`` order)."""
    shared = bool((key_pos == key_pos[:, :1]).all())
    keys = key_pos[:, :1] if shared else key_pos
    q, k = query_pos[:, None, :, None], keys[:, :, None, :]
    visible = k <= q
    if padded:
        visible &= (k >= 0) | (q < 0)
    if window is not None:
        visible &= q - k < window
    return visible if shared else visible.repeat_interleave(heads // key_pos.shape[1], dim=1)


def take_handoff() -> tuple | None:
    """The hand-off of the layer whose keys this attention call reads (cleared: read once), or None."""
    handoff = HANDOFF.get()
    HANDOFF.set(None)
    return handoff


def _take(module, query: torch.Tensor, attention_mask, kwargs: dict, eager: bool):
    """Record ``query`` [b, H, c, d] into the handing layer's window; its mask for a sliding layer."""
    handoff = take_handoff()  # taken before any refusal, so a refused forward leaves no stale hand-off
    check_kwargs(module, None, dict(kwargs), "kvdiag attention")  # unknown attention arguments are refused
    if handoff is None:
        return attention_mask
    layer, query_pos, queries = handoff
    if queries is not None:
        queries.add(module.layer_idx, query)
    padded = layer.offsets is not None  # transformers' padding mask indexes slots, which a compaction moved
    if layer.sliding_window is None and not padded:
        return attention_mask
    if layer.sliding_window is None and query.shape[2] == 1 and not bool((layer.visible_positions < 0).any()):
        return None  # one query per row and no padding or filler held: every key is visible, as unpadded decoding
    mask = position_mask(query_pos.to(query.device), layer.visible_positions.to(query.device), layer.sliding_window,
                         query.shape[1], padded)
    if eager:  # the model file's eager attention adds its mask
        return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)
    return mask


def kvdiag_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [b, H, q, d] -> SDPA over the positioned cache's keys (outputs as the model's own SDPA)."""
    attention_mask = _take(module, query, attention_mask, kwargs, eager=False)
    kwargs.pop("output_attentions", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def kvdiag_attention_eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """As :func:`kvdiag_attention`, through the model file's eager attention (softcap, sinks)."""
    attention_mask = _take(module, query, attention_mask, kwargs, eager=True)
    return model_eager_attention(module)(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


AttentionInterface.register(KVDIAG_ATTN, kvdiag_attention)
AttentionMaskInterface.register(KVDIAG_ATTN, sdpa_mask)  # without it SDPA mis-slices q > 1 over a cache
AttentionInterface.register(KVDIAG_ATTN + "_eager", kvdiag_attention_eager)
AttentionMaskInterface.register(KVDIAG_ATTN + "_eager", eager_mask)


def implementation(model) -> str:
    """The registered kvdiag attention that reproduces ``model`` (SDPA or eager, from ``kvdiag.model.adapters``)."""
    return KVDIAG_ATTN + "_eager" if model_attention(model).implementation == "eager" else KVDIAG_ATTN


def use_kvdiag_attention(model) -> None:
    """Switch ``model`` to kvdiag's attention for good (an :class:`~kvdiag.generate.EvictingCache` needs it in
    every forward that ``model.generate`` runs)."""
    if model.config._attn_implementation != (name := implementation(model)):
        model.set_attn_implementation(name)


def observing(model):
    """Run ``model`` through kvdiag's attention for the block, then restore its own."""
    return attn_implementation(model, implementation(model))
