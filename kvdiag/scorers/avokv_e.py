"""AvoKV-E: delayed eligibility + rank-normalized read pressure, key redundancy and value payload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import check_choice, check_positive
from kvdiag.core.schema import W_DELAY, W_OBS
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import PAYLOADS, mean_cosine_redundancy, read_pressure
from kvdiag.scorers.normalization import percentile_rank, protect, zscore
from kvdiag.scorers.registry import register_scorer

NORMALIZATIONS = ("rank", "zscore")


def avokv_score(
    p: torch.Tensor, r: torch.Tensor, b: torch.Tensor, eligible: torch.Tensor,
    lambda_p: float = 1.0, lambda_r: float = 1.0, lambda_b: float = 1.0, normalization: str = "rank",
) -> torch.Tensor:
    """``S_i = λ_p·N(p)_i − λ_r·N(r)_i + λ_b·N(b)_i`` over the eligible entries; the others are kept.

    p, r, b [Hkv, t] raw features; eligible [t] bool. ``N`` is the percentile rank over the eligible set
    (``rank``, ``N_t``) or the z-score over it (``zscore``, the "− rank norm." ablation). Ineligible
    entries get :func:`protect`'s kept score. Returns [Hkv, t].
    """
    norm = percentile_rank if normalization == "rank" else zscore
    score = torch.zeros_like(p)
    for weight, feature in ((lambda_p, p), (-lambda_r, r), (lambda_b, b)):
        if weight:  # a zero weight drops the term (its NaNs outside the eligible set included)
            score = score + weight * norm(feature, eligible)
    return protect(torch.where(eligible, score, torch.zeros_like(score)), ~eligible)


@register_scorer("avokv_e")
@dataclass
class AvoKVE(Scorer):
    """AvoKV-E (Yu et al., Oct 2026), **reconstructed from the abstract**: the paper's formulas,
    windows and weights are unpublished, so every choice below is ours and a parameter (docs/scorers.md, "AvoKV-E (our
    reconstruction)").

    1. Eligibility: entries with age ``t - i > w_delay`` are candidates ``C_t``; younger ones are kept.
    2. Read pressure ``p``: mass the window queries ``[t - w_obs, t)`` put on ``i`` over the mass they put on
       ``C_t`` (exact fp32 softmax over all visible keys), per query head, mean over the GQA group.
    3. Key redundancy ``r``: mean cosine of ``k_i`` to the other candidate keys of its KV head.
    4. Value payload ``b``: ``‖v_i‖₂`` (``payload`` = ``range``: VaSE's value range; ``wo_l2``: ‖W_O v‖₂,
       group mean, needs the model).
    5. ``S = λ_p·N(p) − λ_r·N(r) + λ_b·N(b)`` with ``N`` the percentile rank over ``C_t`` (:func:`avokv_score`).

    Parameters
    ----------
    w_obs : observation window W_obs (ours: 32).
    w_delay : delay buffer W_delay, ``>= w_obs`` (ours: 128, one compression interval).
    lambda_p, lambda_r, lambda_b : weights of read pressure, redundancy, payload (ours: 1, 1, 1).
    payload : ``l2`` (ours), ``range``, ``l1``, ``var`` or ``wo_l2``.
    normalization : ``rank`` (percentile rank) or ``zscore``.
    """

    protects: ClassVar = ("w_delay", None)  # never evicted: the delay buffer: entries of age ``<= w_delay``
    window_field: ClassVar[str | None] = "w_obs"
    w_obs: int = W_OBS
    w_delay: int = W_DELAY
    lambda_p: float = 1.0
    lambda_r: float = 1.0
    lambda_b: float = 1.0
    payload: str = "l2"
    normalization: str = "rank"

    def __post_init__(self):
        check_positive(f"{self.name}.w_obs", self.w_obs)
        check_positive(f"{self.name}.w_delay", self.w_delay, self.w_obs)
        check_choice(self.payload, PAYLOADS, f"{self.name}.payload")
        check_choice(self.normalization, NORMALIZATIONS, f"{self.name}.normalization")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        eligible = ctx.age > self.w_delay
        key = (self.w_obs, self.w_delay)
        p = ctx.cached(
            ("read_pressure", *key), lambda: read_pressure(ctx.window_attention(self.w_obs), eligible, ctx.num_kv_heads)
        )
        r = ctx.cached(("redundancy", self.w_delay), lambda: mean_cosine_redundancy(ctx.k, eligible))
        b = ctx.payload(self.payload)
        return avokv_score(p, r, b, eligible, self.lambda_p, self.lambda_r, self.lambda_b, self.normalization)
