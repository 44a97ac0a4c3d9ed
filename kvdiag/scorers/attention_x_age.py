"""Attention × age: window attention scaled by how long the entry has been cached."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.scorers.attention import AttentionScorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.registry import register_scorer


@register_scorer("attention_x_age")
@dataclass
class AttentionXAge(AttentionScorer):
    """``attention_i × (t - i)``: the attention-only score times the entry's age.

    Source: the "attention × age" row of AvoKV-E's Table 3 (no formula published; this product is ours). Old
    entries that are still read score high; young ones, which few queries could read yet, score low.

    Parameters
    ----------
    window : observation window of the attention term (default 32).
    """

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return super().score(ctx) * ctx.age.float()
