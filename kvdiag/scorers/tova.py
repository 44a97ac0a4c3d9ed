"""TOVA: the attention of the newest query."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.registry import register_scorer


@register_scorer("tova")
@dataclass
class TOVA(Scorer):
    """TOVA (Oren et al. 2024; schwartz-lab-NLP/TOVA ``TOVACache.reduce``): last-query attention.

    The attention row of the newest query (position ``t - 1``), exact fp32 softmax, averaged over **all** query
    heads and repeated to every KV head (TOVA selects layer-wise). No sinks and no recent window, as the official
    code (kvpress ``TOVAPress`` additionally protects the last token). No parameters; it reads the newest query.
    """

    @property
    def query_window(self) -> int:
        return 1

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        last = ctx.window_attention(1)[:, -1]  # [H, t]
        return last.mean(dim=0).expand(ctx.num_kv_heads, -1).clone()
