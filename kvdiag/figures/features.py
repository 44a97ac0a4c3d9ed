"""Token-level features of the figures computed from the Trace: read pressure and value payload per labeled
candidate (when the scores' features file cannot serve them, ``kvdiag.scorers.token_features``), and the read strengths
of every future query on the labeled entries (future queries: no scorer sees them).

Core functions take tensors of one (prompt, layer); the ``trace_*`` functions loop over a Trace's prompts and
layers (each layer file is read once per prompt and column block) and average over layers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl
import torch

from kvdiag.model.adapters import LayerAttention
from kvdiag.model.attention import attention_rows
from kvdiag.scorers.token_features import PromptSums, TokenFeatureParams


def trace_pressure_payload(trace, keys: pl.DataFrame, params: TokenFeatureParams,
                           advance: Callable[[], None] | None = None) -> pl.DataFrame:
    """``keys`` (prompt_id, checkpoint, position) with ``read_pressure`` and ``value_payload`` computed from the
    Trace (``kvdiag.scorers.token_features``: what ``kvdiag score`` writes beside the scores)."""
    frames = []
    for pid, grp in keys.group_by("prompt_id", maintain_order=True):
        pid = pid[0]
        grp = grp.sort("checkpoint", "position")
        positions = {
            t: torch.tensor(g["position"].to_numpy()) for (t,), g in grp.group_by("checkpoint", maintain_order=True)
        }
        sums = PromptSums(params, pid, positions, trace.num_layers)
        for layer in range(trace.num_layers):
            qkv = trace.layer(pid, layer)
            sums.add_layer(qkv.q.float(), qkv.k.float(), qkv.v.float(), trace.layer_attention(layer))
            if advance:
                advance()
        frames.append(sums.finish())
    return (
        keys.join(pl.concat(frames), on=["prompt_id", "checkpoint", "position"], how="left", maintain_order="left")
        if frames
        else keys
    )


def layer_read_strength(
    q: torch.Tensor, k: torch.Tensor, scale: LayerAttention | float, positions: torch.Tensor, acc: torch.Tensor,
    reduce: str, num_layers: int, chunk_elements: int,
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
        "window_complete": complete.numpy(), "first_window_peak": torch.where(complete, peak, float("nan")).numpy(),
        "first_strong_read": first.numpy().astype(np.int64),
        "future_queries": (T - (positions + 1 + w_obs)).clamp_min(0).numpy().astype(np.int64),
    }


def trace_first_reads(
    trace, entries: pl.DataFrame, w_obs: int, strong_read_mult: float, reduce: str, chunk_elements: int,
    strength_elements: int, advance: Callable[[], None] | None = None,
) -> pl.DataFrame:
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
                layer_read_strength(
                    qkv.q.float(), qkv.k.float(), trace.layer_attention(layer), pos, acc, reduce, trace.num_layers,
                    chunk_elements,
                )
                if advance:
                    advance()
            parts.append(first_reads(acc, pos, w_obs, strong_read_mult))
        cols = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        frames.append(
            pl.DataFrame(
                {"prompt_id": pid, "position": positions.numpy(), "prompt_len": P, "length": T, **cols},
                schema_overrides={
                    "prompt_id": pl.String, "position": pl.Int64, "prompt_len": pl.Int64, "length": pl.Int64,
                    "first_window_peak": pl.Float64,
                },
            )
        )
    return pl.concat(frames)
