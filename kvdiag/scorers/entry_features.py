"""Per-entry features for ``kvdiag fit``: the raw quantities the hand-made rules combine, one [Hkv, t] each.

Each is computed from a :class:`ScoreContext` like a scorer (no protected entries, no normalization), so the
same code serves training (``kvdiag fit``) and the fitted rule (the ``fitted`` scorer). ``LIVE`` features need
no past queries beyond the observation window, so a model fitted on them also runs in ``kvdiag replay``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvdiag.features import group_reduce, mean_cosine_redundancy
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.registry import Scorer, get_scorer


def _per_head(ctx: ScoreContext, row: torch.Tensor) -> torch.Tensor:
    return row[None].expand(ctx.num_kv_heads, -1)


FEATURES: dict[str, Callable[[ScoreContext], torch.Tensor]] = {
    # attention the last 32 queries put on the entry (mean over queries and the GQA group)
    "window_attention": lambda ctx: get_scorer("attention", window=32).scores(ctx),
    # attention the newest query puts on it (TOVA)
    "newest_attention": lambda ctx: get_scorer("tova").scores(ctx),
    # attention received from every past query (H2O without its recent window)
    "cumulative_attention": lambda ctx: get_scorer("h2o").scores(ctx),
    # LazyEviction's recurrence score without its protected window
    "recurrence": lambda ctx: get_scorer("lazyeviction", window=0).scores(ctx),
    "key_norm": lambda ctx: ctx.k.norm(dim=-1),
    "value_norm": lambda ctx: ctx.payload("l2"),
    # mean cosine of the key to every other cached key of its head (R-KV / AvoKV-E redundancy)
    "redundancy": lambda ctx: mean_cosine_redundancy(ctx.k, torch.ones(ctx.t, dtype=torch.bool)),
    "log_age": lambda ctx: _per_head(ctx, torch.log(ctx.age.float())),
    "is_prompt": lambda ctx: _per_head(ctx, (ctx.positions < ctx.prompt_len).float()),
}
LIVE = ("window_attention", "newest_attention", "key_norm", "value_norm", "redundancy", "log_age", "is_prompt")


@dataclass
class EntryFeature(Scorer):
    """One feature of :data:`FEATURES` as a scorer-shaped extractor (not registered: not an eviction rule)."""

    feature: str = "window_attention"

    def scores(self, ctx: ScoreContext) -> torch.Tensor:
        return FEATURES[self.feature](ctx).float()


def entry_features(ctx: ScoreContext, names: list[str]) -> torch.Tensor:
    """[F, Hkv, t] the features ``names`` of every cached entry."""
    return torch.stack([FEATURES[name](ctx).float() for name in names])


__all__ = ["FEATURES", "LIVE", "EntryFeature", "entry_features", "group_reduce"]
