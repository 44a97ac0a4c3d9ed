"""Normalizations of scores: the percentile rank ``N_t`` and z-scores, the protected entries' "kept" score, and
the aggregations of per-(layer, KV head) scores to token / layer / head rows.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import rankdata

from kvdiag.core.errors import UserError


def percentile_rank(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The rank normalization ``N_t``: ``(rank - 1) / (n - 1)`` along the last axis, average ranks for ties.

    x [..., t]; mask [t] bool selects the set that is ranked (others get NaN). Values lie in [0, 1];
    a set of one entry gets 0.5 (the middle of [0, 1]).
    """
    mask = torch.ones(x.shape[-1], dtype=torch.bool) if mask is None else mask
    out = torch.full(x.shape, float("nan"))
    n = int(mask.sum())
    if n == 0:
        return out
    if n == 1:
        out[..., mask] = 0.5
        return out
    ranks = rankdata(x[..., mask].double().numpy(), method="average", axis=-1)
    out[..., mask] = torch.from_numpy(((ranks - 1.0) / (n - 1)).astype(np.float32))
    return out


def zscore(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries of the last axis (population std; 0 where std is 0)."""
    if not bool(mask.any()):
        return torch.full_like(x, float("nan"))
    sel = x[..., mask]
    mean = sel.mean(dim=-1, keepdim=True)
    std = sel.std(dim=-1, unbiased=False, keepdim=True)
    out = (x - mean) / torch.where(std > 0, std, torch.ones_like(std))
    return torch.where(mask, out, torch.full_like(out, float("nan")))


def protect(scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """Give the ``protected [t]`` entries of ``scores [Hkv, t]`` the "kept" score of their row.

    The kept score is ``m + 1 + |m|`` with ``m`` the row's highest unprotected score: finite (ranking metrics
    and percentile ranks stay defined) and strictly above every unprotected entry, also in fp32. All protected
    entries of a row tie. With nothing unprotected, ``m = 0``.
    """
    if not bool(protected.any()):
        return scores
    free = ~protected
    top = scores[:, free].amax(dim=1, keepdim=True) if bool(free.any()) else torch.zeros(scores.shape[0], 1)
    return torch.where(protected, top + 1.0 + top.abs(), scores)


def recent(t: int, window: int) -> torch.Tensor:
    """[t] bool: the last ``window`` positions of the cache."""
    return torch.arange(t) >= t - window


# --------------------------------------------------------------------------- aggregation over layers and heads

AGGREGATIONS = {
    "mean_rank": "each (layer, KV head)'s scores are percentile-ranked over the cache [0, t) (N_t); token rows take "
    "the mean over layers and KV heads, layer rows the mean over that layer's KV heads, head rows the rank itself",
    "mean_raw": "raw scores; token rows take the mean over layers and KV heads, layer rows the mean over that "
                "layer's KV heads, head rows the score itself",
}


def aggregation_values(scores: torch.Tensor, aggregation: str) -> torch.Tensor:
    """[Hkv, t] -> the per-(layer, head) values that ``aggregation`` averages (ranks or raw scores), fp64."""
    if aggregation == "mean_rank":
        return percentile_rank(scores).double()
    if aggregation == "mean_raw":
        return scores.double()
    raise UserError(f"aggregation {aggregation!r} is unknown: use one of {', '.join(AGGREGATIONS)}")
