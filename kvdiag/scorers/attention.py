"""Attention-only: how strongly the observation window reads each entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import check_positive
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import group_reduce
from kvdiag.scorers.registry import register_scorer


@register_scorer("attention")
@dataclass
class AttentionScorer(Scorer):
    """Attention-only score: the mean attention of the last ``window`` queries on each entry.

    Source: the "attention only" row of AvoKV-E's Table 3, which publishes no formula; this definition is ours.
    Queries ``[t - window, t)``, exact softmax over every key they can see (fp32), mean over the window and over
    the query heads of the GQA group (as kvpress and VaSE). No pooling and no protected entries: entries younger
    than the window are read by fewer queries, which is exactly the routing-only view AvoKV-E criticizes.

    Parameters
    ----------
    window : observation window W_obs (default 32).
    """

    window_field: ClassVar[str | None] = "window"
    window: int = 32

    def __post_init__(self):
        check_positive(f"{self.name}.window", self.window)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return group_reduce(ctx.window_attention(self.window).mean(dim=1), ctx.num_kv_heads)
