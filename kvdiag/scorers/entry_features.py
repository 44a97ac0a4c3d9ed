"""Per-entry features for ``kvdiag fit``: the raw quantities the hand-made rules combine, one [Hkv, t] each.

Each is computed from a :class:`ScoreContext` like a scorer's raw score (no protected entries, no normalization),
so the same code serves training (``kvdiag fit``) and the fitted rule (the ``fitted`` scorer). Each declares what it
reads: features of every past query (``history``) are not in a live cache, so a model fitted on the others runs in
``kvdiag replay`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvdiag.scorers.attention import AttentionScorer
from kvdiag.scorers.avokv_e import AvoKVE
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.cake import CAKE
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import mean_cosine_redundancy
from kvdiag.scorers.h2o import H2O
from kvdiag.scorers.lazyeviction import LazyEviction
from kvdiag.scorers.names import CELL_FEATURES
from kvdiag.scorers.normalization import percentile_rank
from kvdiag.scorers.obcache import OBCache
from kvdiag.scorers.rkv import RKV
from kvdiag.scorers.snapkv import SnapKV
from kvdiag.scorers.tova import TOVA
from kvdiag.scorers.vase import VaSE


@dataclass(frozen=True)
class Feature:
    """One per-entry feature: ``compute(ctx) -> [Hkv, t]``; ``history``: reads every past query; ``window``: the
    newest queries it reads."""

    compute: Callable[[ScoreContext], torch.Tensor]
    history: bool = False
    window: int = 0


def _per_head(ctx: ScoreContext, row: torch.Tensor) -> torch.Tensor:
    return row[None].expand(ctx.num_kv_heads, -1)


def _rule_rank(rule: Scorer) -> Feature:
    """The percentile rank, within its (layer, KV head) cell, of ``rule``'s raw score (its default parameters, no
    protected entries): the rules' scores on one scale, as the rules are normalised per cell."""
    return Feature(lambda ctx: percentile_rank(rule.score(ctx)), history=rule.needs_history, window=rule.query_window)


# the zoo rules whose per-cell rank is a feature: every live rule (no history, no o_proj) that led some study
RANKED_RULES = {"snapkv": SnapKV(), "cake": CAKE(), "tova": TOVA(), "avokv_e": AvoKVE(), "vase": VaSE(), "rkv": RKV(),
                "obcache": OBCache()}


FEATURES: dict[str, Feature] = {
    # attention the last 32 queries put on the entry (mean over queries and the GQA group)
    "window_attention": Feature(lambda ctx: AttentionScorer(window=32).score(ctx), window=32),
    # attention the newest query puts on it (TOVA)
    "newest_attention": Feature(lambda ctx: TOVA().score(ctx), window=1),
    # attention received from every past query (H2O without its recent window)
    "cumulative_attention": Feature(lambda ctx: H2O().score(ctx), history=True),
    # LazyEviction's recurrence score without its protected window
    "recurrence": Feature(lambda ctx: LazyEviction(window=0).score(ctx), history=True),
    "key_norm": Feature(lambda ctx: ctx.k.norm(dim=-1)),
    "value_norm": Feature(lambda ctx: ctx.payload("l2")),
    # mean cosine of the key to every other cached key of its head (R-KV / AvoKV-E redundancy)
    "redundancy": Feature(lambda ctx: mean_cosine_redundancy(ctx.k, torch.ones(ctx.t, dtype=torch.bool))),
    "log_age": Feature(lambda ctx: _per_head(ctx, torch.log(ctx.age.float()))),
    "is_prompt": Feature(lambda ctx: _per_head(ctx, (ctx.positions < ctx.prompt_len).float())),
    # log(1 + absolute position): tells the first entries (the attention sinks) from the rest of the prompt
    "log_position": Feature(lambda ctx: _per_head(ctx, torch.log1p(ctx.positions.float()))),
    # where the entry lies in the cache, 0 (first) to 1 (newest)
    "relative_position": Feature(lambda ctx: _per_head(ctx, ctx.positions.float() / max(ctx.t - 1, 1))),
    # the cell: constant within it, so only a model fitted on cell rows (kvdiag fit --per-cell) can use them
    "cell_layer": Feature(lambda ctx: torch.full((ctx.num_kv_heads, ctx.t), float(ctx.layer))),
    "cell_kv_head": Feature(lambda ctx: torch.arange(ctx.num_kv_heads, dtype=torch.float32)[:, None].expand(-1, ctx.t)),
    **{f"rank_{name}": _rule_rank(rule) for name, rule in RANKED_RULES.items()},
}
LIVE = tuple(name for name, feature in FEATURES.items() if not feature.history)


@dataclass
class EntryFeature(Scorer):
    """One feature of :data:`FEATURES` as a scorer-shaped extractor (not registered: not an eviction rule)."""

    feature: str = "window_attention"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return FEATURES[self.feature].compute(ctx).float()


def entry_features(ctx: ScoreContext, names: list[str]) -> torch.Tensor:
    """[F, Hkv, t] the features ``names`` of every cached entry."""
    return torch.stack([FEATURES[name].compute(ctx).float() for name in names])


__all__ = ["CELL_FEATURES", "FEATURES", "LIVE", "RANKED_RULES", "EntryFeature", "Feature", "entry_features"]
