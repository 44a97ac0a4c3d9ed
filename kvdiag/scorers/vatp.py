"""VATP: attention × value norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import check_choice, check_positive
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import group_reduce
from kvdiag.scorers.registry import register_scorer


@register_scorer("vatp")
@dataclass
class VATP(Scorer):
    """VATP (Guo, Kamigaito, Watanabe, EMNLP 2024, arXiv 2406.12335): ``s_j · ‖v_j‖₁``.

    ``s_j`` is the base method's attention score: by default H2O's cumulative attention, normalized by the
    number of queries that saw the entry as our ``h2o`` scorer does (``base=window``: the attention-only
    window mean). Attention-sink tokens have tiny value norms and are kept separately; VATP publishes no code,
    so ``n_sink = 4`` (StreamingLLM's count) is our choice. GQA: ``s`` is averaged over the group.

    Parameters
    ----------
    base : ``h2o`` (VATP's figure) or ``window``.
    window : observation window when ``base=window`` (default 32).
    n_sink : first tokens kept (ours: 4).
    """

    protects: ClassVar = (None, "n_sink")  # never evicted: the ``n_sink`` first entries
    window_field: ClassVar[str | None] = "window"
    base: str = "h2o"
    window: int = 32
    n_sink: int = 4

    def __post_init__(self):
        check_choice(self.base, ("h2o", "window"), f"{self.name}.base")
        check_positive(f"{self.name}.window", self.window)
        check_positive(f"{self.name}.n_sink", self.n_sink, 0)

    @property
    def needs_history(self) -> bool:
        """``base=h2o`` reads every past query's attention."""
        return self.base == "h2o"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if self.base == "h2o":
            attention = ctx.column_sum() / ctx.age.float()
        else:
            attention = ctx.window_attention(self.window).mean(dim=1)
        return group_reduce(attention, ctx.num_kv_heads) * ctx.payload("l1")
