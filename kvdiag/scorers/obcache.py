"""OBCache: closed-form Optimal-Brain-Damage saliency of pruning an entry's value, key, or both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.core.errors import check_choice
from kvdiag.scorers.base import QueryWindowScorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import avg_pool, group_reduce, max_pool
from kvdiag.scorers.registry import register_scorer

TARGETS = ("value", "key", "kv")
POOLINGS = ("none", "maxpool", "avgpool")
POOL_KERNEL = 7  # hard-coded in OBCache's evict()


def obcache_saliency(q_window: torch.Tensor, k: torch.Tensor, v: torch.Tensor, probs: torch.Tensor, attn,
                     target: str) -> torch.Tensor:
    """Per query head, the OBD saliency of every entry summed over the window queries -> [H, t].

    q_window [H, w, d]; k, v [Hkv, t, d]; probs [H, w, t]: the window's attention rows ``a_τj`` (0 where hidden);
    ``attn``: the layer's LayerAttention (the logits ``z_τj`` it pruned to 0). With ``o_τ = Σ_j a_τj v_j``:
    ``value`` ``a²‖v_j‖²``; ``key`` ``a² z² ‖v_j − o_τ‖²``; ``kv`` ``a² ‖v_j + z (v_j − o_τ)‖²``.
    """
    H, w, d = q_window.shape
    Hkv, t, _ = k.shape
    g = H // Hkv
    v_sq = (v * v).sum(dim=-1).repeat_interleave(g, dim=0)[:, None, :]  # [H, 1, t]
    a_sq = probs * probs
    if target == "value":
        return (a_sq * v_sq).sum(dim=1)
    z = attn.logits((q_window.reshape(Hkv, g * w, d) @ k.transpose(1, 2)).reshape(H, w, t))
    o = (probs.reshape(Hkv, g * w, t) @ v).reshape(H, w, d)  # the window's attention outputs
    vo = (o.reshape(Hkv, g * w, d) @ v.transpose(1, 2)).reshape(H, w, t)  # v_j · o_τ
    o_sq = (o * o).sum(dim=-1, keepdim=True)  # [H, w, 1]
    key = a_sq * z * z * (v_sq + o_sq - 2.0 * vo)
    if target == "key":
        return key.sum(dim=1)
    return (a_sq * v_sq + key + 2.0 * a_sq * z * (v_sq - vo)).sum(dim=1)


@register_scorer("obcache")
@dataclass
class OBCache(QueryWindowScorer):
    """OBCache (Gu, Liang, Zhao, Diao; arXiv 2510.07651 "Optimal Brain KV Cache Pruning"): the squared change of
    the window's attention outputs when an entry is pruned, in closed form (Optimal Brain Damage).

    For a window query ``τ`` of query head ``h`` with logits ``z_τj`` (scaled, soft-capped), attention ``a_τj`` and
    output ``o_τ = Σ_j a_τj v_j``, pruning entry ``j`` changes ``o_τ`` by (to first order, exactly for the value):

    - ``value`` (``v_j → 0``): ``Δo = −a v_j``, saliency ``a²‖v_j‖²``;
    - ``key`` (``k_j → 0``, so ``z_τj → 0``; ``∂o/∂z_j = a (v_j − o)``): saliency ``a² z² ‖v_j − o_τ‖²``;
    - ``kv`` (both): ``‖a v_j + a z (v_j − o_τ)‖² = a²‖v_j‖² + a²z²‖v_j − o_τ‖² + 2 a² z (‖v_j‖² − v_j·o_τ)``.

    ``S_j = Σ_τ`` over the last ``window`` queries (exact fp32 softmax over their causal rows), optionally max- or
    average-pooled (kernel 7) on the candidates ``j < t − W`` per query head, then the mean over the GQA group;
    the window itself is kept. Higher saliency = more output damage = keep.

    Source: the paper names the three closed-form scores (isolated values, isolated keys, joint key–value pairs);
    the formulas above follow ``KVScoreTracker.v_update``/``k_update`` of MalachiAjayi/kv-cache-pruner (a
    third-party renamed copy of DreamSoul-AI/OBCache, whose repository could not be fetched): squared 2-norms
    (``p = 2``), summed over the window queries; the test checks each against a finite-difference removal.
    Deviations: OBCache's window is a budget share (5% of the cache) and its decode phase accumulates the saliency
    over every past query (H2O-style); here the window is fixed and read at the checkpoint (its prefill setting:
    ``kvcV``/``kvcK``/``kvcVK``, ``+maxpool``/``+avgpool``); per query head, then the group mean; fp32. Its
    ``p = 1`` value variant (``Σ_τ a·‖v_j‖₁``) ranks the prefix as ``vatp base=window n_sink=0``.

    Parameters
    ----------
    window : W, the window queries and the protected recent entries (ours: 32; OBCache: 5% of the budget).
    target : ``kv`` (joint, with the cross term; ours), ``value`` or ``key``.
    pooling : ``none`` (OBCache's H2O/TOVA-style variants), ``maxpool`` (its SnapKV variant) or ``avgpool``.
    """

    window: int = 32
    target: str = "kv"
    pooling: str = "none"

    def __post_init__(self):
        super().__post_init__()
        check_choice(self.target, TARGETS, f"{self.name}.target")
        check_choice(self.pooling, POOLINGS, f"{self.name}.pooling")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        probs = ctx.window_attention(self.window)  # [H, w, t]
        q_window = ctx.window_queries(probs.shape[1])
        saliency = obcache_saliency(q_window, ctx.k, ctx.v, probs, ctx.attn, self.target)  # [H, t]
        prefix = int((~ctx.recent(probs.shape[1])).sum())  # entries are in position order: the window comes last
        out = torch.zeros(ctx.num_kv_heads, ctx.t)
        if prefix > 0:
            pooled = saliency[:, :prefix]
            if self.pooling != "none":
                pooled = (max_pool if self.pooling == "maxpool" else avg_pool)(pooled, POOL_KERNEL)
            out[:, :prefix] = group_reduce(pooled, ctx.num_kv_heads)
        return out
