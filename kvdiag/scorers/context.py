"""What a scorer reads: the cache of one (prompt, checkpoint, layer) as a :class:`ScoreContext`, with the
features several scorers share computed once; a *live* context describes a compacted cache (replay).

Tensor shapes: ``q [H, t, d]`` (live: ``[H, w, d]``), ``k, v [Hkv, t, d]``; scores ``[Hkv, t]``, higher = keep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdiag.core.errors import UserError
from kvdiag.model.adapters import LayerAttention, as_layer_attention
from kvdiag.model.attention import group_size
from kvdiag.scorers import features


@dataclass
class ScoreContext:
    """Everything a scorer may read at one (prompt, checkpoint ``t``, layer): the cache ``[0, t)``.

    A *live* context (``positions`` given, as in ``kvdiag replay``) describes a compacted cache instead: it
    holds the ``t`` entries at absolute ``positions`` (ascending) of a checkpoint ``checkpoint``, and ``q``
    only the last ``w`` queries, at positions ``[checkpoint - w, checkpoint)`` (what a real compressor keeps).
    Causality, ages, recent windows and sinks then follow the absolute positions; features that need every
    past query (:meth:`column_sum`, :meth:`recurrence`, :meth:`sparsity`) raise :class:`HistoryUnavailable`.

    Parameters
    ----------
    q : [H, t, d] fp32 post-RoPE queries at positions ``< t`` only (a scorer never sees the future);
        live: [H, w, d], the queries at positions ``[checkpoint - w, checkpoint)``.
    k, v : [Hkv, t, d] fp32 cached keys and values.
    scale : the layer's attention semantics, a :class:`kvdiag.model.adapters.LayerAttention` (scale, sliding window,
        softcap, sinks), or a bare float: plain causal attention with that scale (1/√d for Llama/Qwen).
    prompt_len : prompt tokens; positions ``>= prompt_len`` were generated.
    layer, prompt_id : where this context sits (used by seeded scorers).
    token_ids : LongTensor [t] or None.
    candidates : LongTensor [C] of positions ``< t`` returned by ``Scorer.__call__`` (default: all).
    o_proj : the layer's output projection [hidden, H*d] (only for the ``wo_l2`` payload), or None.
    history : the layer's :class:`kvdiag.scorers.features.AttentionHistory` shared across checkpoints; built from
        ``q``/``k`` on first use when None.
    positions : LongTensor [t], ascending absolute positions of the cached entries (live context), or None:
        the full cache, ``arange(t)``.
    checkpoint : the absolute checkpoint (live: required, ``> positions[-1]``); None: ``t``.
    trace : the Trace being scored (None in replay): scorers that rerun its model read it (``kvpress:`` presses).
    shared : what every context of one scoring run shares (the Trace's model run of the ``kvpress:`` presses); the
        run owns it, so nothing outlives it.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: LayerAttention | float
    prompt_len: int
    layer: int = 0
    prompt_id: str = ""
    token_ids: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    o_proj: torch.Tensor | None = None
    history: features.AttentionHistory | None = None
    cache: dict = field(default_factory=dict, repr=False)
    positions: torch.Tensor | None = None
    checkpoint: int | None = None
    trace: Any = field(default=None, repr=False)
    shared: dict = field(default_factory=dict, repr=False)
    live: bool = field(init=False, repr=False)

    def __post_init__(self):
        self.q, self.k, self.v = self.q.float(), self.k.float(), self.v.float()
        self.live = self.positions is not None
        if self.v.shape[1] != self.t or (not self.live and self.q.shape[1] != self.t):
            raise ValueError(f"q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, v {tuple(self.v.shape)}: need the "
                             "same t")
        if self.live:
            if self.checkpoint is None or self.positions.shape != (self.t,):
                raise ValueError(f"a live context needs positions [t={self.t}] and a checkpoint")
            if (self.t and int(self.positions[-1]) >= self.checkpoint) or self.q.shape[1] > self.checkpoint:
                raise ValueError(f"live context: entries and queries must precede the checkpoint {self.checkpoint}")
        else:
            self.positions, self.checkpoint = torch.arange(self.t), self.t
        group_size(self.num_heads, self.num_kv_heads)
        if self.candidates is None:
            self.candidates = torch.arange(self.t)
        elif len(self.candidates) and (self.candidates.min() < 0 or self.candidates.max() >= self.t):
            raise ValueError(f"candidates must be positions in [0, {self.t})")

    @property
    def attn(self) -> LayerAttention:
        """The layer's attention semantics (``scale`` as a :class:`kvdiag.model.adapters.LayerAttention`)."""
        return as_layer_attention(self.scale)

    @property
    def t(self) -> int:
        """Number of cached entries (the checkpoint, unless the context is live)."""
        return self.k.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def age(self) -> torch.Tensor:
        """[t] ``checkpoint - position`` of every cached entry (``t - i`` for the full cache)."""
        return self.checkpoint - self.positions

    def recent(self, window: int) -> torch.Tensor:
        """[t] bool: entries at positions ``>= checkpoint - window`` (the last ``window`` of the full cache)."""
        return self.positions >= self.checkpoint - window

    def sinks(self, n_sink: int) -> torch.Tensor:
        """[t] bool: entries at positions ``< n_sink`` (attention sinks, if still cached)."""
        return self.positions < n_sink

    def window_queries(self, window: int) -> torch.Tensor:
        """[H, w, d] the queries at positions ``[checkpoint - window, checkpoint)`` (clipped at 0)."""
        w = min(window, self.checkpoint)
        if w > self.q.shape[1]:
            raise ValueError(f"a window of {window} queries was asked, the live context holds {self.q.shape[1]}")
        return self.q[:, self.q.shape[1] - w :]

    def cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per context (features shared by the scorers of one checkpoint and layer)."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def window_attention(self, window: int) -> torch.Tensor:
        """[H, w, t] attention of the queries ``[t - window, t)`` (see ``features.window_attention``; live:
        :func:`live_attention` over the cached entries)."""
        wider = [key for key in self.cache if key[0] == "window" and key[1] >= window]
        if wider:  # the last rows of a wider window are this window
            rows = self.cache[min(wider)]
            return rows[:, rows.shape[1] - min(window, self.checkpoint) :]
        if not self.live:
            return self.cached(("window", window), lambda: features.window_attention(self.q, self.k, self.attn, window))
        return self.cached(("window", window), lambda: live_attention(
            self.window_queries(window), self.k, self.positions, self.checkpoint, self.attn))

    def _history(self) -> features.AttentionHistory:
        if self.live:
            raise HistoryUnavailable("this scorer needs the attention of every past query, which a live (compacted) "
                                     "cache does not keep")
        if self.history is None:
            self.history = features.AttentionHistory(self.q, self.k, self.attn)
        return self.history

    def column_sum(self) -> torch.Tensor:
        """[H, t] ``Σ_{tau < t} a_{tau, j}``: attention received from every past query (H2O)."""
        H, T = self.num_heads, self._history().q.shape[1]
        return self.cached(
            ("colsum",),
            lambda: self._history().get(("colsum",), lambda: features.ColumnSum(H, T), self.t).snapshot(self.t),
        )

    def recurrence(self, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        """LazyEviction's ``(TS, MRI)`` [H, t] replayed over the decode steps ``< t`` (see ``features.Recurrence``)."""
        H, T, P = self.num_heads, self._history().q.shape[1], self.prompt_len
        key = ("recurrence", alpha)
        return self.cached(
            key, lambda: self._history().get(key, lambda: features.Recurrence(H, T, P, alpha), self.t).snapshot(self.t)
        )

    def sparsity(self, rel_threshold: float) -> torch.Tensor:
        """[H, t] ThinKV attention sparsity of the query at each position ``< t``."""
        H, T = self.num_heads, self._history().q.shape[1]
        key = ("sparsity", rel_threshold)
        return self.cached(
            key,
            lambda: (
                self._history()
                .get(key, lambda: features.Sparsity(H, T, rel_threshold, self.attn.window), self.t)
                .snapshot(self.t)
            ),
        )

    def payload(self, kind: str) -> torch.Tensor:
        """[Hkv, t] value payload (``features.value_payload``)."""
        return self.cached(("payload", kind), lambda: features.value_payload(self.v, kind, self.o_proj, self.num_heads))


class HistoryUnavailable(UserError):
    """A scorer asked a live context for a feature of every past query (cumulative attention, recurrence)."""


def live_attention(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, checkpoint: int,
                   attn: LayerAttention | float) -> torch.Tensor:
    """Exact fp32 attention of the queries at ``[checkpoint - w, checkpoint)`` over a compacted cache.

    q [H, w, d], k [Hkv, n, d] at absolute ``positions [n]``: query ``tau`` sees the cached entries at positions
    ``<= tau`` (and inside the layer's sliding window: causality and windows by absolute position, whatever was
    evicted); ``attn``: the layer's ``LayerAttention`` (softcap, sinks) or a bare scale. Returns [H, w, n].
    """
    attn = as_layer_attention(attn)
    H, w, d = q.shape
    Hkv, n, _ = k.shape
    g = group_size(H, Hkv)
    logits = attn.logits((q.reshape(Hkv, g * w, d) @ k.transpose(1, 2)).reshape(H, w, n))
    hidden = attn.hidden(torch.arange(checkpoint - w, checkpoint), positions)  # [w, n]
    # a query whose visible entries were all evicted reads nothing (instead of a NaN row)
    probs = attn.softmax(logits.masked_fill(hidden, float("-inf")), heads_dim=0)
    return torch.where(hidden.all(dim=-1)[None, :, None], 0.0, probs)
