"""Torch reference implementations of the eviction kernels (the CPU path of the oracle and the replay).

Every function computes in fp32 and returns the dtype documented on it. Shapes:
``N`` candidate rows, ``H`` query heads, ``Hkv`` KV heads, ``g = H // Hkv`` (query head ``h`` reads KV
head ``h // g``), ``P`` shared-prefix length, ``W`` queries per row, ``S >= W`` suffix length per row,
``E`` exclusions per row, ``d`` head dim.
"""

from __future__ import annotations

import torch

# Shared-prefix attention processes candidate rows in chunks whose prefix logits
# [Hkv, rows, g*W, P] (fp32) take about this many bytes: small enough to stay in cache on
# CPU (faster than one huge buffer, measured 1.5-3x at P=512..2048) and to bound memory.
LOGITS_CHUNK_BYTES = 4 << 20
# Exclusions per row up to this many are scattered into the logits (single entries: cheaper than a pass over them);
# larger sets are one boolean mask per (row, KV head) applied in one pass. Both give -inf exactly where excluded.
SCATTER_MAX_E = 8


def compact_kv(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical eviction: per-head gather of kept cache entries.

    keys, values [Hkv, T, d]; keep [Hkv, B] (int) positions kept per head. Returns ``(keys [Hkv, B, d],
    values [Hkv, B, d])`` with entry ``b`` of head ``h`` = entry ``keep[h, b]``: pass ascending ``keep``
    (e.g. ``topk(...).indices.sort().values``) to preserve the cache's temporal order.
    """
    Hkv, T, d = keys.shape
    # one row-wise index_select over [Hkv * T, d] copies whole rows (faster than an element-wise gather)
    flat = (keep.long() + torch.arange(Hkv, device=keep.device)[:, None] * T).flatten()
    return (
        keys.reshape(Hkv * T, d).index_select(0, flat).view(Hkv, -1, d),
        values.reshape(Hkv * T, d).index_select(0, flat).view(Hkv, -1, d),
    )


def shared_prefix_attention(
    q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor,
    exclude: torch.Tensor, scale: float, chunk: int | None = None, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of N rows over one shared prefix (never copied per row) plus each row's causal suffix.

    q [N, H, W, d]: the row's queries, at suffix positions ``S - W .. S - 1``.
    prefix_k, prefix_v [Hkv, P, d]: shared by all rows; every query sees every non-excluded entry.
    suffix_k, suffix_v [N, Hkv, S, d]: the row's own keys; query ``w`` sees suffix keys ``j <= S - W + w``.
    exclude [N, Hkv, E] (int): prefix positions row ``n`` does not see at KV head ``h``; ``-1`` = none;
    repeats allowed (see ``kvdiag.kernels.normalize_exclude`` for the [N, E] form).
    chunk: candidate rows per chunk (default: prefix logits of about ``LOGITS_CHUNK_BYTES``).
    window / softcap / sinks: the layer's semantics (``kvdiag.model.adapters.LayerAttention``). Positions are
    absolute: prefix entry ``j`` at ``j``, suffix entry ``j`` at ``P + j``, query ``w`` at ``P + S - W + w``;
    with a window the query at ``tau`` sees keys ``> tau - window``. ``softcap`` c: logits ``c tanh(l / c)``;
    ``sinks`` fp32 [H]: one extra logit per query head in the denominator.
    Returns [N, H, W, d] in q's dtype. Masking entry ``i`` here equals deleting it from the cache.

    Prefix logits are one bmm per KV head, ``[Hkv, chunk*g*W, d] @ [Hkv, d, P]``; the softmax over
    prefix and suffix is joint (shared row max and normalizer) in fp32.
    """
    N, H, W, d = q.shape
    Hkv, P, _ = prefix_k.shape
    S = suffix_k.shape[2]
    g = H // Hkv
    rows = g * W
    if chunk is None:
        chunk = max(1, LOGITS_CHUNK_BYTES // (4 * Hkv * rows * max(P, 1)))
    pk_t = prefix_k.float().transpose(1, 2)  # [Hkv, d, P]
    pv = prefix_v.float()
    # query w sits at suffix position S - W + w and sees suffix keys j <= S - W + w
    w_of_row = torch.arange(rows, device=q.device) % W
    last = S - W + w_of_row  # [g*W] the query's suffix position
    suf_j = torch.arange(S, device=q.device)[None, :]
    hidden = suf_j > last[:, None]  # [g*W, S]
    pre_hidden = None
    if window is not None:  # absolute query position P + last sees keys > P + last - window
        hidden |= suf_j <= (last - window)[:, None]
        pre_hidden = torch.arange(P, device=q.device)[None, :] <= (P + last - window)[:, None]  # [g*W, P]
        if not pre_hidden.any():
            pre_hidden = None
    sink = None
    if sinks is not None:  # [Hkv, 1, rows, 1]: row r of KV head kv is query head kv*g + r // W
        sink = sinks.to(q.device, torch.float32).view(Hkv, g, 1).expand(Hkv, g, W).reshape(Hkv, 1, rows, 1)
    out = torch.empty(N, Hkv, rows, d, dtype=q.dtype, device=q.device)
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        c = n1 - n0
        qc = q[n0:n1].float().reshape(c, Hkv, rows, d) * scale  # query head h = kv*g + r // W
        suf = qc @ suffix_k[n0:n1].float().transpose(-1, -2)  # [c, Hkv, rows, S]
        if softcap is not None:
            suf = suf.div_(softcap).tanh_().mul_(softcap)
        suf.masked_fill_(hidden, float("-inf"))
        suf = suf.transpose(0, 1)  # [Hkv, c, rows, S]
        pre = torch.bmm(qc.transpose(0, 1).reshape(Hkv, c * rows, d), pk_t).view(Hkv, c, rows, P)
        if softcap is not None:
            pre = pre.div_(softcap).tanh_().mul_(softcap)
        if pre_hidden is not None:
            pre.masked_fill_(pre_hidden, float("-inf"))
        ex = exclude[n0:n1].transpose(0, 1)  # [Hkv, c, E]
        if ex.shape[-1] and P and ex.shape[-1] <= SCATTER_MAX_E:
            # adding -inf hides an entry; -1 adds 0 to column 0, a no-op
            idx = ex.clamp(min=0)[:, :, None, :].expand(-1, -1, rows, -1)
            add = torch.where(ex < 0, 0.0, float("-inf"))[:, :, None, :].expand(-1, -1, rows, -1)
            pre.scatter_add_(-1, idx, add)
        elif ex.shape[-1] and P:  # a set: one mask per (row, KV head), -1 lands in a spare column P
            gone = torch.zeros(Hkv, c, P + 1, dtype=torch.bool, device=q.device)
            gone.scatter_(-1, torch.where(ex < 0, P, ex), True)
            pre.masked_fill_(gone[:, :, None, :P], float("-inf"))
        m = suf.amax(-1, keepdim=True)  # finite: every query sees at least its own suffix key
        if P:
            m = torch.maximum(m, pre.amax(-1, keepdim=True))
        if sink is not None:
            m = torch.maximum(m, sink)
        pre.sub_(m).exp_()
        suf.sub_(m).exp_()
        z = pre.sum(-1, keepdim=True) + suf.sum(-1, keepdim=True)
        if sink is not None:
            z += (sink - m).exp()
        o = torch.bmm(pre.view(Hkv, c * rows, P), pv).view(Hkv, c, rows, d)
        o += suf @ suffix_v[n0:n1].float().transpose(0, 1)
        out[n0:n1] = (o / z).transpose(0, 1)
    return out.view(N, H, W, d)

