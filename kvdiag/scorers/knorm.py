"""KNorm: keep low-norm keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.registry import register_scorer


@register_scorer("knorm")
@dataclass
class KNorm(Scorer):
    """KNorm (Devoto et al. 2024; kvpress ``KnormPress``): ``-‖k_i‖₂`` — low-norm keys draw attention, keep them.

    Post-RoPE keys as recorded (kvpress scores the cached, post-RoPE keys too; RoPE preserves the norm). No
    parameters, no protected entries.
    """

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return -ctx.k.norm(dim=-1)
