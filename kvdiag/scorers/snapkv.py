"""SnapKV: observation-window attention with 1-D pooling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.core.errors import check_choice, check_positive
from kvdiag.scorers.base import QueryWindowScorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import avg_pool, group_reduce, max_pool
from kvdiag.scorers.registry import register_scorer


@register_scorer("snapkv")
@dataclass
class SnapKV(QueryWindowScorer):
    """SnapKV (Li et al. 2024; FasterDecoding/SnapKV ``SnapKVCluster``), applied at a decode checkpoint.

    The last ``window`` queries attend with an fp32 softmax over their full causal row (window keys included);
    the attention on the prefix ``[0, t - window)`` is summed over the window, smoothed by 1-D pooling (kernel
    5, stride 1, same padding, zero padding counted as ``F.avg_pool1d`` does), and the window itself is kept.
    Deviation: SnapKV scores per query head on an expanded cache; here the group's query heads are averaged
    (kvpress ``SnapKVPress``). SnapKV is prefill-only; here it runs on the decode-time cache.

    Parameters
    ----------
    window : W (official 32).
    kernel_size : pooling kernel (official 5; 7 in the LongBench configs).
    pooling : ``avgpool`` (official default) or ``maxpool`` (LongBench configs).
    """

    window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"

    def __post_init__(self):
        super().__post_init__()
        check_positive(f"{self.name}.kernel_size", self.kernel_size)
        check_choice(self.pooling, ("avgpool", "maxpool"), f"{self.name}.pooling")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        attn = ctx.window_attention(self.window)  # [H, w, t]
        window = ctx.recent(attn.shape[1])
        prefix = int((~window).sum())  # entries are in position order: the window comes last
        out = torch.zeros(ctx.num_kv_heads, ctx.t)
        if prefix > 0:
            pool = avg_pool if self.pooling == "avgpool" else max_pool
            out[:, :prefix] = group_reduce(pool(attn[:, :, :prefix].sum(dim=1), self.kernel_size), ctx.num_kv_heads)
        return out
