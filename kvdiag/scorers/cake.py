"""CAKE: the mean and the variance of the observation window's attention (its eviction indicator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.core.errors import check_positive
from kvdiag.scorers.base import QueryWindowScorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import avg_pool, group_reduce
from kvdiag.scorers.registry import register_scorer


@register_scorer("cake")
@dataclass
class CAKE(QueryWindowScorer):
    """CAKE's eviction indicator (Qin et al., ICLR 2025, arXiv 2503.12491; antgroup/cakekv
    ``cake/model/modify_llama.py`` ``llama_attn_forward_cake``, the prefill branch).

    The last ``window`` queries attend with an fp32 softmax over their full causal row; per query head and entry
    ``j < t - W``: ``I_j = mean_τ A_τj + γ · var_τ A_τj`` (unbiased variance over the W queries: an entry whose
    attention shifts across the window is kept), 1-D average pooling (kernel 5, zero padding counted), then the
    mean over the GQA group; the window itself is kept.

    Out of scope: CAKE's per-layer budget allocation (its preference score from the entropy and variance of each
    layer's attention, ``tau1``/``tau2``, and the cascading ``adjust_budgets``): kvdiag ranks entries within a layer
    and head, so only the indicator is scored. CAKE computes the indicator at prefill; during decoding its
    ``CakeDecodingKVCache_LayerWise`` ranks by the newest query's pooled attention alone. Here the indicator runs on
    the decode-time cache, as SnapKV does. Deviations: fp32 (CAKE casts the softmax to bf16); the model's attention
    scale (CAKE: 1/√d); with a single window query the variance is 0 (CAKE's would be NaN).

    Parameters
    ----------
    window : W, the observation window and the protected recent entries (official 32, ``pred_cake.py``).
    gamma : γ, the weight of the variance (official 200).
    kernel_size : average-pooling kernel (official 5; 1: off).
    """

    window: int = 32
    gamma: float = 200.0
    kernel_size: int = 5

    def __post_init__(self):
        super().__post_init__()
        check_positive(f"{self.name}.gamma", self.gamma, 0)
        check_positive(f"{self.name}.kernel_size", self.kernel_size)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        attn = ctx.window_attention(self.window)  # [H, w, t]
        prefix = int((~ctx.recent(attn.shape[1])).sum())  # entries are in position order: the window comes last
        out = torch.zeros(ctx.num_kv_heads, ctx.t)
        if prefix > 0:
            rows = attn[:, :, :prefix]
            spread = rows.var(dim=1, correction=1) if rows.shape[1] > 1 else torch.zeros_like(rows[:, 0])
            indicator = rows.mean(dim=1) + self.gamma * spread
            out[:, :prefix] = group_reduce(avg_pool(indicator, self.kernel_size), ctx.num_kv_heads)
        return out
