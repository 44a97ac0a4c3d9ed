"""R-KV: window attention with redundancy penalty, faithful to the official code."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.core.errors import check_choice, check_positive
from kvdiag.scorers.base import QueryWindowScorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import max_pool, rkv_redundancy
from kvdiag.scorers.registry import register_scorer


def rkv_importance(
    q_window: torch.Tensor, k_candidates: torch.Tensor, scale: float, pooling: str, kernel_size: int
) -> torch.Tensor:
    """R-KV's importance ``I`` (``R1KV._compute_scores``).

    q_window [H, W, d]: the last W queries; k_candidates [Hkv, m, d]: the keys before the window. Raw logits
    (no causal mask: every candidate precedes the window), pooled over the GQA group *before* the softmax
    (``max`` or ``mean``), softmax over the candidates only (fp32), mean over the W queries, max-pool.
    Returns [Hkv, m].
    """
    H, W, d = q_window.shape
    Hkv = k_candidates.shape[0]
    logits = q_window.reshape(Hkv, H // Hkv, W, d) @ k_candidates.unsqueeze(1).transpose(2, 3) * scale
    pooled = logits.amax(dim=1) if pooling == "max" else logits.mean(dim=1)  # [Hkv, W, m]
    return max_pool(torch.softmax(pooled, dim=-1).mean(dim=1), kernel_size)


@register_scorer("rkv")
@dataclass
class RKV(QueryWindowScorer):
    """R-KV (Cai et al. 2025; Zefan-Cai/R-KV ``rkv/compression/r1_kv.py`` ``R1KV``, ``rkv/utils.py``).

    ``score_j = λ·I_j − (1 − λ)·R_j`` for ``j < t - W``; the last W entries are kept. ``I``: see
    :func:`rkv_importance` (max-logit GQA pooling, softmax over the candidates, mean over the W window queries,
    max-pool kernel 7). ``R``: :func:`kvdiag.scorers.features.rkv_redundancy` over all ``t`` keys (threshold 0.5,
    retain "last", column mean, softmax over ``t``, then cut to the candidates). Defaults: W = 8, kernel 7,
    λ = 0.1 (CLI/README/paper; the ``R1KV`` class default is 0.07), threshold 0.5 (hard-coded there).
    Deviations: fp32 throughout (R-KV casts to bf16, which creates ties); the model's attention scale is used
    (R-KV divides by √d, the same for Llama/Qwen); the cache is the full, uncompressed one at ``t``.

    Parameters
    ----------
    window : W, the query window and the protected recent entries (official 8).
    kernel_size : max-pool kernel (official 7).
    mix_lambda : λ (official 0.1).
    pooling : GQA pooling of the logits, ``max`` (official) or ``mean``.
    threshold : cosine above which a key counts as a near-duplicate (official 0.5).
    """

    window: int = 8
    kernel_size: int = 7
    mix_lambda: float = 0.1
    pooling: str = "max"
    threshold: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_positive(f"{self.name}.kernel_size", self.kernel_size)
        check_choice(self.pooling, ("max", "mean"), f"{self.name}.pooling")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        q_window = ctx.window_queries(self.window)
        window = ctx.recent(q_window.shape[1])
        m = int((~window).sum())  # entries are in position order: the candidates come first
        out = torch.zeros(ctx.num_kv_heads, ctx.t)
        if m > 0:
            importance = rkv_importance(q_window, ctx.k[:, :m], ctx.attn.scale, self.pooling, self.kernel_size)
            redundancy = ctx.cached(("rkv_redundancy", self.threshold), lambda: rkv_redundancy(ctx.k, self.threshold))
            out[:, :m] = self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy[:, :m]
        return out
