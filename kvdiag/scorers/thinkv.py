"""ThinKV-style proxy: thought-segment importance and transition demotion, as a per-token score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import UserError, check_choice, check_positive
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import THOUGHT_CLASSES, TRANSITION, thought_segments
from kvdiag.scorers.registry import register_scorer


@register_scorer("thinkv")
@dataclass
class ThinKVProxy(Scorer):
    """A ThinKV-style proxy (Ramachandran et al. 2025, arXiv 2510.01290). Not ThinKV: it has no public code and
    no per-token score; this emulates the order in which its segment policy evicts.

    1. Attention sparsity of each decode query (share of its row below ``rel_threshold`` × the row max, mean
       over this layer's query heads) labels each ``segment_len``-step segment Transition / Reasoning /
       Execution (:func:`kvdiag.scorers.features.thought_segments`; ThinKV uses a calibrated layer subset and KDE
       thresholds, here: this layer and, by default, the tertiles of the segment sparsities at ``t``).
    2. ``level``: number of Transition segments after the entry's segment (ThinKV demotes every older segment
       one retention level per new transition), capped at ``max_level`` (schedule {64, 32, 16, 8, 4}: five levels).
    3. ``ρ``: segment importance T 0 < E 1 < R 2 (ThinKV's counterfactual ranking).
    4. ``rep``: ``(1 + cos(k_i, mean key of its segment)) / 2`` per KV head, a K = 1 stand-in for ThinKV's
       K-means "nearest real key to a centroid".

    ``score = −w_level·level + w_rho·ρ + w_rep·rep``; the default weights make the order lexicographic
    (level, then ρ, then rep). The prompt is one segment of class ``prompt_class``.

    Parameters
    ----------
    segment_len : steps per segment (ThinKV τ = 128).
    rel_threshold : sparsity threshold relative to the row max (ThinKV 1%).
    thresholds : fixed (low, high) sparsity thresholds, or None for quantiles.
    quantiles : (low, high) quantiles of the segment sparsities used when ``thresholds`` is None (ours: tertiles).
    rho : importance of (T, R, E) segments (ThinKV: 0, 2, 1).
    prompt_class : class given to the prompt segment (ours: R).
    max_level : demotion cap (ThinKV schedule has 5 levels: 4).
    w_level, w_rho, w_rep : weights of the three terms (ours: 1, 0.25, 0.1).
    """

    needs_history: ClassVar[bool] = True  # the sparsity of every decode query
    segment_len: int = 128
    rel_threshold: float = 0.01
    thresholds: tuple[float, ...] | None = None
    quantiles: tuple[float, ...] = (1 / 3, 2 / 3)
    rho: tuple[float, ...] = (0.0, 2.0, 1.0)
    prompt_class: str = "R"
    max_level: int = 4
    w_level: float = 1.0
    w_rho: float = 0.25
    w_rep: float = 0.1

    def __post_init__(self):
        check_positive(f"{self.name}.segment_len", self.segment_len)
        check_positive(f"{self.name}.max_level", self.max_level, 0)
        check_choice(self.prompt_class, tuple(THOUGHT_CLASSES), f"{self.name}.prompt_class")
        for what, value, size in (
            ("thresholds", self.thresholds, 2), ("quantiles", self.quantiles, 2), ("rho", self.rho, 3),
        ):
            if value is not None and len(value) != size:
                raise UserError(f"{self.name}.{what}={','.join(map(str, value))}: give {size} comma-separated numbers")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        step_sparsity = ctx.sparsity(self.rel_threshold).mean(dim=0)
        segment, classes = thought_segments(
            step_sparsity, ctx.prompt_len, self.segment_len,
            tuple(self.thresholds) if self.thresholds is not None else None, tuple(self.quantiles), self.prompt_class,
        )
        is_t = (classes == TRANSITION).long()
        later_t = is_t.flip(0).cumsum(0).flip(0) - is_t  # transitions strictly after each segment
        level = later_t.clamp(max=self.max_level).float()
        rho = torch.tensor(self.rho, dtype=torch.float32)[classes]
        centroid = torch.zeros(ctx.num_kv_heads, len(classes), ctx.k.shape[2]).index_add_(1, segment, ctx.k)
        cos = torch.cosine_similarity(ctx.k, centroid[:, segment], dim=-1)
        return -self.w_level * level[segment] + self.w_rho * rho[segment] + self.w_rep * (1 + cos) / 2
