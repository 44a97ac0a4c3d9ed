"""H2O: cumulative attention from every past query (heavy hitters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import check_positive
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import group_reduce
from kvdiag.scorers.registry import register_scorer


@register_scorer("h2o")
@dataclass
class H2O(Scorer):
    """H2O (Zhang et al. 2023; FMInference/H2O ``H2OKVCache_LayerWise``): attention accumulated over all queries.

    ``Σ_{tau < t} a_{tau,i}`` summed over every past query row (prompt and decode), exact fp32 softmax over the
    full causal prefix. Deviations, documented: the sum is divided by the number of queries that could see ``i``
    (``t - i``), as kvpress ``ObservedAttentionPress`` does, because raw sums favour old entries
    (``normalize=False`` gives H2O's raw sum); GQA: mean over the group's query heads (H2O is MHA-only). H2O's
    recent window is a share of the budget (recent_ratio 0.1); a ranking has no budget, so by default nothing
    is protected (``recent_size`` protects the last entries).

    Parameters
    ----------
    normalize : divide by the number of queries that saw the entry (default True).
    recent_size : last entries kept unconditionally (default 0).
    """

    protects: ClassVar = ("recent_size", None)  # never evicted: the last ``recent_size`` entries
    needs_history: ClassVar[bool] = True  # every past query's attention
    normalize: bool = True
    recent_size: int = 0

    def __post_init__(self):
        check_positive(f"{self.name}.recent_size", self.recent_size, 0)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        received = ctx.column_sum()
        if self.normalize:
            received = received / ctx.age.float()
        return group_reduce(received, ctx.num_kv_heads)
