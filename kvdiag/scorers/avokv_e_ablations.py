"""The four AvoKV-E ablations of the paper's Table 4, each a one-field change of :class:`AvoKVE`."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.scorers.avokv_e import AvoKVE
from kvdiag.scorers.registry import register_scorer


@register_scorer("avokv_e_no_payload")
@dataclass
class AvoKVENoPayload(AvoKVE):
    """AvoKV-E − payload (Table 4): ``λ_b = 0``."""

    lambda_b: float = 0.0


@register_scorer("avokv_e_no_delay")
@dataclass
class AvoKVENoDelay(AvoKVE):
    """AvoKV-E − delay (Table 4): ``W_delay = W_obs`` (``w_delay`` None follows ``w_obs``)."""

    w_delay: int | None = None

    def __post_init__(self):
        if self.w_delay is None:
            self.w_delay = self.w_obs
        super().__post_init__()


@register_scorer("avokv_e_raw")
@dataclass
class AvoKVERaw(AvoKVE):
    """AvoKV-E − rank norm. (Table 4): raw features z-scored over the candidates instead of percentile-ranked."""

    normalization: str = "zscore"


@register_scorer("avokv_e_no_redundancy")
@dataclass
class AvoKVENoRedundancy(AvoKVE):
    """AvoKV-E − redundancy (Table 4): ``λ_r = 0``."""

    lambda_r: float = 0.0
