"""LongFlow: the newest query's attention-weighted values, ``Σ_d |a_j v_jd|``, an intermediate of its attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.registry import register_scorer


@register_scorer("longflow")
@dataclass
class LongFlow(Scorer):
    """LongFlow (arXiv 2603.11504; yisunlp/LongFLow ``triton_kernel/attention.py`` ``evict_fwd_kernel``, called by
    ``models/ours.py`` ``OursAttention`` at every decode step).

    While the newest query (position ``t - 1``) computes its attention output, the kernel also sums the terms of
    that output: ``s_j = 1/(H·d) · Σ_h Σ_d |a_hj v_jd| = 1/(H·d) · Σ_h a_hj ‖v_j‖₁`` over **all** query heads
    (``v_j`` read by head ``h``'s KV head), exact fp32 softmax over the whole cache, the new entry included. One
    score per layer, repeated to every KV head: LongFlow evicts the same slot of every head (the argmin, written over
    by the next token). No sinks and no recent window, as the official code. Its prefill compression (SnapKV over
    the prompt) is out of scope. Deviation: fp32 (LongFlow casts the probabilities to bf16 before the product). No
    parameters; it reads the newest query.
    """

    @property
    def query_window(self) -> int:
        return 1

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        last = ctx.window_attention(1)[:, -1]  # [H, t]
        g = ctx.num_heads // ctx.num_kv_heads
        flow = last.reshape(ctx.num_kv_heads, g, ctx.t).sum(dim=1) * ctx.payload("l1")  # Σ_h a_hj ‖v_j‖₁ per KV head
        d = ctx.v.shape[2]
        return (flow.sum(dim=0) / (ctx.num_heads * d)).expand(ctx.num_kv_heads, -1).clone()
