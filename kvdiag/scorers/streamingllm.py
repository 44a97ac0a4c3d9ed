"""StreamingLLM: attention sinks plus the most recent entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import check_positive
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.registry import register_scorer


@register_scorer("streamingllm")
@dataclass
class StreamingLLM(Scorer):
    """StreamingLLM (Xiao et al. 2023; mit-han-lab/streaming-llm ``StartRecentKVCache``): sinks + recency.

    StreamingLLM keeps the first ``n_sink`` tokens and the most recent ``recent_size``. As a ranking: sinks get the
    kept score and every other entry scores its position (newer = keep), so evicting the lowest-scored fraction
    at any budget is exactly StreamingLLM at that budget (its recent size is implied by the budget, so it is not
    a parameter). Positions are not re-rotated (the official "pos shift" does not apply to scoring).

    Parameters
    ----------
    n_sink : attention sinks kept (official start_size 4).
    """

    protects: ClassVar = (None, "n_sink")  # never evicted: the ``n_sink`` first entries
    continuous: ClassVar[bool] = False  # a recency order, not a graded preference: nothing to draw from
    n_sink: int = 4

    def __post_init__(self):
        check_positive(f"{self.name}.n_sink", self.n_sink, 0)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.positions.float().expand(ctx.num_kv_heads, -1)
