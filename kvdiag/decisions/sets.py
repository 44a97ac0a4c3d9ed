"""The evicted set of every decision at one checkpoint ``t``: a rule's (from its per-(layer, KV head) scores, through
``kvdiag.core.selection`` as in replay) and the references' (exact single labels, the greedy joint oracle, Fisher
labels,
random).

A set is ``[E]`` positions (a token set: the same entries from every layer and KV head) or ``[L, Hkv, E]`` (a per-head
set: each layer and KV head its own E entries); ``kvdiag.label.OracleEngine.label_sets`` labels either exactly.
"""

from __future__ import annotations

import math
import time
import zlib

import numpy as np
import torch

from kvdiag.core.selection import Selection, evicted_slots, select_keep, top_slots


def rule_set(scores: torch.Tensor, kept: int, selection: Selection | str, protected: torch.Tensor | None = None,
             generator: torch.Generator | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
    """The entries a rule evicts keeping ``kept`` of each (layer, KV head): scores [L, Hkv, t] (higher = keep) ->
    [E] for ``per-token`` selection, [L, Hkv, E] for ``per-head`` and ``stochastic`` (E = t - kept; ``protected [t]``
    and ``generator``: the stochastic draw's); ties keep the newer entry. ``visible [L, t]`` (per-head only): a
    sliding layer's budget counts only the entries its queries can still see (:func:`window_set`)."""
    L, _, t = scores.shape
    selection = Selection.parse(selection)
    if visible is not None and not selection.per_token and not selection.stochastic:
        return window_set(scores, kept, visible)
    keep = select_keep(list(scores), kept, selection, protected, generator)
    evicted = evicted_slots(keep, t)
    return evicted[0, 0] if selection.per_token else evicted


def window_set(values: torch.Tensor, kept: int, visible: torch.Tensor) -> torch.Tensor:
    """[L, Hkv, E] (``-1`` padded): per (layer, KV head), the entries it can see (``visible [L, t]``) beyond the
    ``kept`` largest of them in ``values [L, Hkv, t]``; ties keep the newer entry. An entry outside a sliding
    layer's window is neither kept nor evicted: a real cache of that layer no longer holds it (its label is the
    same either way), so it does not spend the budget."""
    masked = values.double().masked_fill(~visible[:, None, :], float("-inf"))
    keep = torch.zeros(values.shape, dtype=torch.bool).scatter_(-1, top_slots(masked, kept), True)
    return mask_set(~keep & visible[:, None, :])


def label_set(values: torch.Tensor, kept: int) -> torch.Tensor:
    """[E] the entries evicted keeping the ``kept`` largest of ``values [t]`` (damage: keep what hurts); ties keep
    the newer entry."""
    t = values.shape[-1]
    return evicted_slots(top_slots(values, kept)[None, None], t)[0, 0]


def head_label_set(values: torch.Tensor, kept: int, visible: torch.Tensor | None = None) -> torch.Tensor:
    """[L, Hkv, E]: per (layer, KV head), the entries evicted keeping its ``kept`` largest ``values [L, Hkv, t]``
    (``visible [L, t]``: within a sliding layer's window, :func:`window_set`)."""
    if visible is not None:
        return window_set(values, kept, visible)
    return evicted_slots(top_slots(values, kept), values.shape[-1])


def random_set(t: int, kept: int, selection: Selection, num_layers: int, num_kv_heads: int, seed: int,
               key: str, visible: torch.Tensor | None = None) -> torch.Tensor:
    """A seeded uniform random set (per head: one draw per layer and KV head; ``visible [L, t]``: uniform among the
    entries a sliding layer still sees, :func:`window_set`), the same for every run of the same ``(seed, key, t)``,
    whatever else is computed."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}:{t}".encode()))
    if selection.per_token:
        return torch.randperm(t, generator=gen)[: t - kept].sort().values
    if visible is not None:
        return window_set(torch.rand(num_layers, num_kv_heads, t, generator=gen, dtype=torch.float64), kept, visible)
    draws = torch.stack([torch.randperm(t, generator=gen)[: t - kept] for _ in range(num_layers * num_kv_heads)])
    return draws.sort(-1).values.view(num_layers, num_kv_heads, t - kept)


def protected_count(rule, t: int) -> int:
    """How many of the entries [0, t) of a full cache at checkpoint ``t`` the rule declares protected
    (``Scorer.protected``); 0 for a column without a known rule."""
    if rule is None:
        return 0
    return int(rule.protected(t - torch.arange(t), torch.arange(t)).sum())


def greedy_sets(engine, t: int, kept: list[int], chunk: float, progress=None) -> tuple[dict[int, torch.Tensor], dict]:
    """``oracle_greedy``: from the full cache, evict ``ceil(chunk * t)`` entries at a time, each time the survivors
    whose eviction *on top of the set already evicted* does the least joint damage (exact set rows; ties evict the
    older entry), until each budget of ``kept`` is reached (one path serves every budget). An approximation of the
    best set: exact in what it labels, greedy in how it searches. Returns {kept: [E] evicted positions} and its cost
    (rows labeled, seconds)."""
    start = time.perf_counter()
    step = max(1, math.ceil(chunk * t))
    evicted: list[int] = []
    survivors = list(range(t))
    out, rows = {}, 0
    for target in sorted(set(kept), reverse=True):
        while len(evicted) < t - target:
            base = torch.tensor(evicted, dtype=torch.long)
            sets = [torch.cat([base, torch.tensor([i])]) for i in survivors]
            kl = engine.label_sets(t, sets, progress)[0]["kl"].double().mean(1)
            rows += len(sets)
            n = min(step, t - target - len(evicted))
            # least damage first; among equals the older entry goes first (the newer is kept, as everywhere)
            order = sorted(range(len(survivors)), key=lambda j: (float(kl[j]), survivors[j]))[:n]
            chosen = {survivors[j] for j in order}
            evicted += sorted(chosen)
            survivors = [i for i in survivors if i not in chosen]
        out[target] = torch.tensor(sorted(evicted), dtype=torch.long)
    return out, {"rows": rows, "seconds": round(time.perf_counter() - start, 3), "chunk": step}


# --------------------------------------------------------------------------- stored sets


def set_mask(evict: torch.Tensor, num_layers: int, num_kv_heads: int, t: int) -> torch.Tensor:
    """bool [L, Hkv, t]: True where a set evicts; ``evict`` is [E] (a token set) or [L, Hkv, E] (``-1`` = none)."""
    evict = torch.as_tensor(evict, dtype=torch.long)
    if evict.dim() == 1:
        evict = evict.expand(num_layers, num_kv_heads, -1)
    mask = torch.zeros(num_layers, num_kv_heads, t + 1, dtype=torch.bool)  # slot t takes the -1 padding
    mask.scatter_(-1, torch.where(evict < 0, t, evict), True)
    return mask[..., :t]


def mask_set(mask: torch.Tensor) -> torch.Tensor:
    """The per-head set of ``mask [L, Hkv, t]``: [L, Hkv, E] ascending positions, padded with ``-1`` where a cell
    evicts fewer than the largest cell (E)."""
    counts = mask.sum(-1)
    width = int(counts.max()) if mask.numel() else 0
    t = mask.shape[-1]
    # evicted positions first, in order: sort the key (not evicted, position)
    order = torch.sort((~mask).long() * t + torch.arange(t), dim=-1).values[..., :width]
    return torch.where(torch.arange(width) < counts[..., None], order, -1)


def pack_set(evict: torch.Tensor, num_layers: int, num_kv_heads: int, t: int) -> bytes:
    """A set as the bits of its [L, Hkv, t] mask (C order, ``numpy.packbits``): t/8 bytes per cell, whatever the
    budget (a per-head set of SmolLM2 at t = 650: 7 KiB)."""
    return np.packbits(set_mask(evict, num_layers, num_kv_heads, t).numpy().reshape(-1)).tobytes()


def unpack_set(blob: bytes, num_layers: int, num_kv_heads: int, t: int) -> torch.Tensor:
    """bool [L, Hkv, t] from :func:`pack_set`'s bytes (a decision row's ``evicted_mask``)."""
    n = num_layers * num_kv_heads * t
    bits = np.unpackbits(np.frombuffer(blob, dtype=np.uint8), count=n)
    return torch.from_numpy(bits.astype(bool)).view(num_layers, num_kv_heads, t)
