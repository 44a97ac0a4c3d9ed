"""Exact attention recomputed from recorded post-RoPE queries and keys.

Attention is never stored in a Trace: it is O(T^2). These helpers recompute exact
fp32 softmax rows from ``q`` and ``k``, chunked over queries so memory stays bounded.
"""

from __future__ import annotations

import torch


def group_size(num_heads: int, num_kv_heads: int) -> int:
    """GQA group size g: query head ``h`` reads KV head ``h // g`` (transformers' ``repeat_kv`` order)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return num_heads // num_kv_heads


def attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    key_limit: int | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """Exact causal attention probabilities of selected queries over all their visible keys.

    q [H, W, d] (queries at absolute ``query_positions [W]``), k [Hkv, T, d].
    Query at position ``tau`` sees keys ``j <= tau``. ``key_limit`` truncates the returned
    columns to ``[0, key_limit)`` *after* the softmax (the normalizer still covers every
    visible key). Returns fp32 [H, W, key_limit or T].
    """
    H, W, _ = q.shape
    Hkv, T, _ = k.shape
    g = group_size(H, Hkv)
    cols = T if key_limit is None else key_limit
    out = torch.empty(H, W, cols, dtype=torch.float32)
    kf = k.float()
    key_pos = torch.arange(T)
    for s in range(0, W, chunk):
        qc = q[:, s : s + chunk].float()  # [H, c, d]
        pos = query_positions[s : s + chunk]
        # GQA without repeat_kv: view queries as [Hkv, g*c, d]
        qg = qc.reshape(Hkv, g * qc.shape[1], -1)
        logits = (qg @ kf.transpose(1, 2)).reshape(H, qc.shape[1], T) * scale
        logits.masked_fill_(key_pos[None, None, :] > pos[None, :, None], float("-inf"))
        out[:, s : s + chunk] = torch.softmax(logits, dim=-1)[..., :cols]
    return out
