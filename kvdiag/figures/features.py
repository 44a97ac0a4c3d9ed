"""Token-level features of the figures: read pressure and value payload per labeled candidate, and the read
strengths of every future query on the labeled entries.

Core functions take tensors of one (prompt, layer); the ``trace_*`` functions loop over a Trace's prompts and
layers (each layer file is read once per prompt and column block) and average over layers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl
import torch

from kvdiag import features
from kvdiag.adapters import LayerAttention
from kvdiag.attention import attention_rows


def layer_pressure_payload(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: LayerAttention | float, positions: dict[int, torch.Tensor],
    w_obs: int, w_delay: int, payload: str,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Read pressure and value payload of one layer, KV-head means.

    q [H, T, d], k/v [Hkv, T, d] (fp32); ``positions[t]`` LongTensor [n_t] of candidates at checkpoint ``t``.
    ``p``: ``features.read_pressure`` of the window ``[t - w_obs, t)`` normalized over the entries of age
    ``> w_delay`` (NaN when there is none); ``b``: ``features.value_payload(v, payload)``.
    Returns ``{t: (p [n_t], b [n_t])}``.
    """
    b_all = features.value_payload(v, payload).mean(dim=0)  # [T]: a payload does not depend on t
    out = {}
    for t, pos in positions.items():
        eligible = torch.arange(t) < t - w_delay  # age t - i > w_delay
        if not bool(eligible.any()):
            p = torch.full((len(pos),), float("nan"))
        else:
            attn = features.window_attention(q[:, :t], k[:, :t], scale, w_obs)
            p = features.read_pressure(attn, eligible, k.shape[0]).mean(dim=0)[pos]
        out[t] = (p, b_all[pos])
    return out


def trace_pressure_payload(trace, keys: pl.DataFrame, w_obs: int, w_delay: int, payload: str,
                           advance: Callable[[], None] | None = None) -> pl.DataFrame:
    """``keys`` (prompt_id, checkpoint, position) with ``read_pressure`` and ``value_payload``: the mean over
    layers of :func:`layer_pressure_payload` (itself a mean over KV heads)."""
    frames = []
    for pid, grp in keys.group_by("prompt_id", maintain_order=True):
        pid = pid[0]
        grp = grp.sort("checkpoint", "position")
        positions = {t: torch.tensor(g["position"].to_numpy()) for (t,), g in grp.group_by("checkpoint", maintain_order=True)}
        p_sum = {t: torch.zeros(len(pos), dtype=torch.float64) for t, pos in positions.items()}
        b_sum = {t: torch.zeros(len(pos), dtype=torch.float64) for t, pos in positions.items()}
        for layer in range(trace.num_layers):
            qkv = trace.layer(pid, layer)
            res = layer_pressure_payload(qkv.q.float(), qkv.k.float(), qkv.v.float(), trace.layer_attention(layer), positions,
                                         w_obs, w_delay, payload)
            for t, (p, b) in res.items():
                p_sum[t] += p.double()
                b_sum[t] += b.double()
            if advance:
                advance()
        L = trace.num_layers
        frames.append(pl.DataFrame({
            "prompt_id": pid,
            "checkpoint": np.concatenate([np.full(len(positions[t]), t) for t in positions]),
            "position": np.concatenate([positions[t].numpy() for t in positions]),
            "read_pressure": np.concatenate([(p_sum[t] / L).numpy() for t in positions]),
            "value_payload": np.concatenate([(b_sum[t] / L).numpy() for t in positions]),
        }, schema={"prompt_id": pl.String, "checkpoint": pl.Int64, "position": pl.Int64,
                   "read_pressure": pl.Float64, "value_payload": pl.Float64}))
    return keys.join(pl.concat(frames), on=["prompt_id", "checkpoint", "position"], how="left", maintain_order="left") if frames else keys


def layer_read_strength(
    q: torch.Tensor, k: torch.Tensor, scale: LayerAttention | float, positions: torch.Tensor, acc: torch.Tensor, reduce: str,
    num_layers: int, chunk_elements: int,
) -> None:
    """Add one layer's read strengths of every query on the entries ``positions`` to ``acc`` (in place).

    q [H, T, d], k [Hkv, T, d] (fp32); positions LongTensor [n]; acc fp32 [T, n], row ``tau`` = query ``tau``.
    ``mean``: ``acc += mean over query heads of a[h, tau, i] / num_layers`` (after every layer: the mean over
    layers and query heads); ``max``: ``acc = max(acc, max over query heads)``. Only queries ``tau > min(i)``
    are computed, in chunks of at most ``chunk_elements`` probabilities; exact fp32 softmax over keys ``<= tau``.
    """
    H, T, _ = q.shape
    start = int(positions.min()) + 1
    s = start
    while s < T:
        c = max(1, min(T - s, chunk_elements // (H * T)))
        e = s + c
        probs = attention_rows(q[:, s:e], k[:, :e], torch.arange(s, e), scale, chunk=c)  # [H, c, e]
        seen = positions < e  # later entries: no query of this chunk sees them
        cols = probs[:, :, positions[seen]]
        if reduce == "mean":
            acc[s:e, seen] += cols.mean(dim=0) / num_layers
        else:
            acc[s:e, seen] = torch.maximum(acc[s:e, seen], cols.amax(dim=0))
        s = e


def first_reads(strength: torch.Tensor, positions: torch.Tensor, w_obs: int, strong_read_mult: float,
                block: int = 1024) -> dict[str, np.ndarray]:
    """Summaries of read strengths ``strength [T, n]`` (row = query position) of the entries ``positions [n]``.

    In units of uniform attention ``u(tau, i) = (tau + 1) · strength[tau, i]`` (query ``tau`` sees ``tau + 1``
    keys); a read is strong when ``u >= strong_read_mult``.

    - ``window_complete`` [n] bool: the first observation window ``[i + 1, i + 1 + w_obs)`` lies in the trace;
    - ``first_window_peak`` [n]: max of ``u`` over that window (NaN when incomplete);
    - ``first_strong_read`` [n] int: the first query ``tau >= i + 1 + w_obs`` with a strong read, -1 if none;
    - ``future_queries`` [n] int: queries after the first window, ``T - (i + 1 + w_obs)`` (>= 0).

    Columns are taken ``block`` at a time so the temporaries stay ``O(T · block)``.
    """
    T, n = strength.shape
    tau = torch.arange(T)[:, None]
    peak = torch.full((n,), float("nan"), dtype=torch.float64)
    first = torch.full((n,), -1, dtype=torch.long)
    for c0 in range(0, n, block):
        pos = positions[c0 : c0 + block]
        u = strength[:, c0 : c0 + block].double() * (tau + 1)
        win_end = pos[None, :] + 1 + w_obs
        in_window = (tau > pos[None, :]) & (tau < win_end)
        peak[c0 : c0 + block] = torch.where(in_window, u, float("-inf")).amax(dim=0)
        strong = (u >= strong_read_mult) & (tau >= win_end)
        first[c0 : c0 + block] = torch.where(strong.any(dim=0), strong.int().argmax(dim=0), -1)
    complete = (positions + 1 + w_obs) <= T
    return {
        "window_complete": complete.numpy(),
        "first_window_peak": torch.where(complete, peak, float("nan")).numpy(),
        "first_strong_read": first.numpy().astype(np.int64),
        "future_queries": (T - (positions + 1 + w_obs)).clamp_min(0).numpy().astype(np.int64),
    }


def trace_first_reads(trace, entries: pl.DataFrame, w_obs: int, strong_read_mult: float, reduce: str,
                      chunk_elements: int, strength_elements: int, advance: Callable[[], None] | None = None) -> pl.DataFrame:
    """``entries`` (prompt_id, position; unique) with :func:`first_reads`'s columns and ``prompt_len``, ``length``.

    Per prompt, the entries are taken in column blocks of ``max(1, strength_elements // T)`` so the fp32
    accumulator ``[T, block]`` stays bounded (plus one attention chunk of ``chunk_elements``); each block reads
    every layer and recomputes its attention once, so a larger ``strength_elements`` trades memory for time.
    """
    frames = []
    for (pid,), grp in entries.group_by("prompt_id", maintain_order=True):
        T, P = trace.length(pid), trace.prompt_len(pid)
        positions = torch.as_tensor(np.sort(grp["position"].to_numpy()))
        block = max(1, strength_elements // T)
        parts: list[dict[str, np.ndarray]] = []
        for b0 in range(0, len(positions), block):
            pos = positions[b0 : b0 + block]
            acc = torch.zeros(T, len(pos))
            for layer in range(trace.num_layers):
                qkv = trace.layer(pid, layer)
                layer_read_strength(qkv.q.float(), qkv.k.float(), trace.layer_attention(layer), pos, acc, reduce, trace.num_layers, chunk_elements)
                if advance:
                    advance()
            parts.append(first_reads(acc, pos, w_obs, strong_read_mult))
        cols = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        frames.append(pl.DataFrame({"prompt_id": pid, "position": positions.numpy(), "prompt_len": P, "length": T, **cols},
                                   schema_overrides={"prompt_id": pl.String, "position": pl.Int64, "prompt_len": pl.Int64,
                                                     "length": pl.Int64, "first_window_peak": pl.Float64}))
    return pl.concat(frames)
