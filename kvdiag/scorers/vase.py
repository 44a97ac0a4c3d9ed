"""VaSE: value-aware stochastic eviction: large-value entries kept, the rest drawn by window attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import UserError, check_choice, check_positive
from kvdiag.model.adapters import LayerAttention
from kvdiag.scorers.base import QueryWindowScorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import PAYLOADS, avg_pool, group_reduce
from kvdiag.scorers.normalization import percentile_rank
from kvdiag.scorers.registry import register_scorer

# the window attention a_j lies in [0, 1]: the large-value entries score LARGE_MARGIN + N(m)_j in [2, 3], above it
LARGE_MARGIN = 2.0


def vase_attention(q_window: torch.Tensor, k_candidates: torch.Tensor, attn: LayerAttention, temperature: float,
                   kernel_size: int) -> torch.Tensor:
    """VaSE's sampling weights ``a`` (``EvictLayer._run_eviction.compute_attention_scores``).

    q_window [H, W, d]: the last W queries; k_candidates [Hkv, m, d]: the keys before the residual window. Logits
    ``q·k·scale / temperature`` softmaxed over the candidates only (fp32; every candidate precedes the window, so
    nothing is masked), mean over the W queries, 1-D average pooling per query head (zero padding counted), then the
    mean over the GQA group. Returns [Hkv, m], each entry in [0, 1].
    """
    H, W, d = q_window.shape
    Hkv, m, _ = k_candidates.shape
    logits = attn.logits((q_window.reshape(Hkv, H // Hkv * W, d) @ k_candidates.transpose(1, 2)).reshape(H, W, m))
    probs = torch.softmax(logits / temperature, dim=-1).mean(dim=1)  # [H, m]
    return group_reduce(avg_pool(probs, kernel_size), Hkv)


@register_scorer("vase")
@dataclass
class VaSE(QueryWindowScorer):
    """VaSE (Chang, Fu, Fu, Yang, Thomason, Jia 2026, arXiv 2606.03928; terarachang/VaSE
    ``eval/reasoning_tasks/modified/transformers/cache_utils.py`` ``EvictLayer._run_eviction``, mode
    ``range_sink_sample_attn``), from the official code, as a deterministic score.

    At a compaction VaSE keeps the last ``window`` entries (its residual buffer) and, among the older candidates,
    (1) the ``n_large`` entries of largest value magnitude ``m_j`` (``range``: ``max_d v_j − min_d v_j``; the first
    ``n_sink`` tokens count as ``m = +∞``), then (2) draws the rest without replacement with probability ∝ ``a_j``
    (:func:`vase_attention`). A kvdiag rule returns one deterministic score, so this one returns what the draw reads:
    ``a_j`` for the sampled entries, and ``2 + N(m)_j`` (``N``: percentile rank of ``m`` over the candidates) for the
    ``n_large`` large-value entries: above every ``a_j <= 1``, so they rank as kept, ordered by magnitude. That
    boost is part of the raw score, not a ``protected()`` declaration (which sees ages and positions only): the
    sinks and the residual window are declared protected. Greedy top-k of this score is VaSE's deterministic mode
    with sinks; ``--selection stochastic`` (elsewhere) draws from it.

    Deviations: VaSE sets ``n_large`` to a quarter of the token budget; kvdiag scores without a budget, so it is a
    fixed count (default: the MATH setting, budget 1024). fp32 throughout (VaSE bf16); the model's attention scale
    and softcap (VaSE: 1/√d); the cache is the full one at ``t``.

    Parameters
    ----------
    window : W, the residual buffer kept and the queries read (official 64).
    n_large : entries kept for their value magnitude, sinks included (official: budget / 4; 256 at budget 1024).
    kind : the magnitude, ``range`` (official), ``var``, ``l2`` (VaSE's variants), ``l1`` or ``wo_l2``.
    n_sink : first tokens always kept (official 4).
    kernel_size : average-pooling kernel of the attention (official 5 with ``--smooth``, as every VaSE script; 1: off).
    temperature : divides the logits (official 1.0).
    """

    protects: ClassVar = ("window", "n_sink")  # never evicted: the residual window and the ``n_sink`` first entries
    window: int = 64
    n_large: int = 256
    kind: str = "range"
    n_sink: int = 4
    kernel_size: int = 5
    temperature: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        check_positive(f"{self.name}.n_large", self.n_large, 0)
        check_choice(self.kind, PAYLOADS, f"{self.name}.kind")
        check_positive(f"{self.name}.n_sink", self.n_sink, 0)
        check_positive(f"{self.name}.kernel_size", self.kernel_size)
        if not self.temperature > 0:
            raise UserError(f"{self.name}.temperature={self.temperature} must be positive")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        q_window = ctx.window_queries(self.window)
        m = int((~ctx.recent(q_window.shape[1])).sum())  # entries are in position order: the candidates come first
        out = torch.zeros(ctx.num_kv_heads, ctx.t)
        if m == 0:
            return out
        a = vase_attention(q_window, ctx.k[:, :m], ctx.attn, self.temperature, self.kernel_size)
        magnitude = ctx.payload(self.kind)[:, :m]
        # VaSE's sinks take n_large slots (m = +inf); they are protected, so only the selection sees the +inf
        ranked = magnitude.masked_fill(ctx.sinks(self.n_sink)[:m], float("inf"))
        large = torch.zeros(ctx.num_kv_heads, m, dtype=torch.bool)
        large.scatter_(1, ranked.topk(min(self.n_large, m), dim=1).indices, True)
        out[:, :m] = torch.where(large, LARGE_MARGIN + percentile_rank(magnitude), a)
        return out
