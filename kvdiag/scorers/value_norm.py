"""Value norm: VaSE's value-range payload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import check_choice, check_positive
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import PAYLOADS
from kvdiag.scorers.registry import register_scorer


@register_scorer("value_norm")
@dataclass
class ValueNorm(Scorer):
    """Value payload alone: VaSE's ``m_j = max_d v_j − min_d v_j`` (Chang et al. 2026; terarachang/VaSE
    ``EvictLayer._run_eviction``, mode ``range_sink_sample_attn``), with the first ``n_sink`` tokens kept (VaSE
    sets their m to +∞). This is VaSE's protection signal only: its attention sampling and residual window are
    not part of this score. ``kind`` switches to VaSE's ``var``/``l2`` variants, ‖v‖₁, or ‖W_O v‖₂ (needs the model).

    Parameters
    ----------
    kind : ``range`` (VaSE default), ``var``, ``l2``, ``l1`` or ``wo_l2``.
    n_sink : first tokens kept (VaSE 4).
    """

    protects: ClassVar = (None, "n_sink")  # never evicted: the ``n_sink`` first entries
    kind: str = "range"
    n_sink: int = 4

    def __post_init__(self):
        check_choice(self.kind, PAYLOADS, f"{self.name}.kind")
        check_positive(f"{self.name}.n_sink", self.n_sink, 0)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.payload(self.kind)
