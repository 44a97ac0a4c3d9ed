"""LazyEviction: recurrence-interval tracking, replayed over the decode steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import check_positive
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import group_reduce
from kvdiag.scorers.registry import register_scorer


def lazyeviction_score(ts: torch.Tensor, mri: torch.Tensor, step: int) -> torch.Tensor:
    """LazyEviction's score from the recurrence state at decode step ``step`` (code version, not arXiv v1 Eq. 2).

    ``s_freq = 0`` if ``MRI = 0`` else ``2 / (1 + exp(MRI − 1))``; ``s_surv = 2 / (1 + exp(1 + (step − TS) /
    (MRI + 1e-5)))``; score = ``s_surv + s_freq``. ts, mri: any shape, in steps.
    """
    s_freq = torch.where(mri > 0, 2.0 / (1.0 + torch.exp(mri - 1.0)), torch.zeros_like(mri))
    s_surv = 2.0 / (1.0 + torch.exp(1.0 + (step - ts) / (mri + 1e-5)))
    return s_surv + s_freq


@register_scorer("lazyeviction")
@dataclass
class LazyEviction(Scorer):
    """LazyEviction (Zhang et al. 2025; official ``Halo-949/LazyEviction`` as vendored in WeianMao/triattention).

    The per-(query head, token) state ``TS`` (last step with attention ``>= alpha``) and ``MRI`` (maximum
    recurrence interval) is replayed over every decode step before ``t`` with that step's single query
    (:class:`kvdiag.scorers.features.Recurrence`), then scored by :func:`lazyeviction_score` at step ``t - prompt_len``.
    The last ``window`` entries are kept (W is both the eviction interval and the protected window). Defaults:
    DeepSeek-R1-Distill-Llama-8B on MATH (the embedded model is Llama): alpha 5e-4, W 52 (Qwen-7B: 1e-4, 175).
    Deviations: the state is per query head on the full (uncompressed) cache and the group's query-head scores
    are averaged to one score per KV head (the official code expands the cache to every query head);
    thresholds in fp32 (the official one thresholds an fp16 copy); the prompt is not protected (as official).

    Parameters
    ----------
    alpha : attention threshold of a "recurrence" (official 5e-4 for Llama-8B).
    window : protected recent entries W (official ``decoding_recent_size`` 52 for Llama-8B / MATH).
    """

    protects: ClassVar = ("window", None)  # never evicted: the last ``window`` entries
    needs_history: ClassVar[bool] = True  # the recurrence state replays every decode query
    alpha: float = 5e-4
    window: int = 52

    def __post_init__(self):
        check_positive(f"{self.name}.alpha", self.alpha, 1e-12)
        check_positive(f"{self.name}.window", self.window, 0)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        ts, mri = ctx.recurrence(self.alpha)
        per_head = lazyeviction_score(ts, mri, max(0, ctx.t - ctx.prompt_len))
        return group_reduce(per_head, ctx.num_kv_heads)
