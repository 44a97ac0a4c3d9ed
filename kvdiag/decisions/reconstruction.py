"""``oracle_search``'s reconstruction start: per (layer, KV head), the set whose attention outputs over the queries
the search reads stay closest to the full cache's.

Each cell (layer ``l``, KV head ``h``) starts with every entry it may move kept and evicts, ``CHUNK`` at a time, the
entries whose eviction least raises

    E(m) = sum over the cell's query heads j and the read steps s of || W_j (o_js(m) - o_js) ||^2

``o_js(m) = (sum_i m_i p_jsi v_i + n_js) / (sum_i m_i p_jsi + r_js)``: head j's attention output at step s under the
keep mask ``m`` of the prefix ``[0, t)``, with ``p`` the full cache's attention weights of the read steps' queries,
``n``/``r`` the output share and weight of the read steps' own keys and of any sinks (always kept), and ``W_j`` the
head's block of the output projection (so a head whose output the model amplifies counts more). Values are mapped
once through ``C_j`` (``W_j^T W_j = C_j C_j^T``, so ``||W_j x|| = ||x C_j||``), and each candidate's error is
closed-form from one batched GEMM per round: with ``e`` a query's current error and ``D`` its normaliser, evicting
``i`` gives ``(D^2 |e|^2 - 2 D p_i <e, v_i - o> + p_i^2 |v_i - o|^2) / (D - p_i)^2``.

Why it is only a start: it judges each layer on the full cache's queries and inputs, so it ignores how one layer's
error moves the next layer's; its exact label decides whether the descent starts there. SmolLM2, t = 640, H = 128,
keep 0.25 (docs/benchmarks.md): 0.0091 nats where ``future_attention`` (the best candidate) is at 0.0660; the descent
from it is at 0.00198 after 100 steps, from ``future_attention`` at 0.00396. One entry at a time (CHUNK = 1) gave
0.0077 at 4x the time; 1/16 of what is left at a time, 0.0138; without ``C_j`` (raw value space), 0.0108. Each
layer judged instead on the inputs the sets of the layers below it give (one soft-mask forward per layer, matching the
full cache's outputs) was worse, 0.0112.
"""

from __future__ import annotations

import weakref

import torch

from kvdiag.model.adapters import attention_modules, output_projection
from kvdiag.model.attention import attention_rows

CHUNK = 4  # entries a cell evicts per round: each round rescoring every entry after the last round's evictions

_RECORDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> (t, its layers' q/k/v)


class _Layer:
    """One layer's terms at checkpoint ``t`` over ``S`` read steps, query heads ``Hq`` (``g`` per KV head):
    p [Hq, S, t] the prefix's attention weights; vc [Hq, t, d] the prefix's values through each head's ``C_j``;
    o [Hq, S, d] the full cache's outputs in that space; n [Hq, S, d] and r [Hq, S] the read steps' keys' share."""

    def __init__(self, q, k, v, attention, wo, t: int, steps: int):
        hq, hkv, d = q.shape[0], k.shape[0], v.shape[-1]
        pos = torch.arange(t, t + steps)
        probs = attention_rows(q[:, pos], k, pos, attention).double()  # [Hq, S, t + S]
        blocks = wo.detach().double().cpu().view(wo.shape[0], hq, d).transpose(0, 1)  # [Hq, hidden, d]
        gram = blocks.transpose(1, 2) @ blocks + 1e-12 * torch.eye(d, dtype=torch.float64)
        vc = v.double().repeat_interleave(hq // hkv, 0) @ torch.linalg.cholesky(gram)  # [Hq, t + S, d]
        self.p, self.vc = probs[..., :t], vc[:, :t]
        self.n = probs[..., t:] @ vc[:, t:]
        self.r = 1.0 - self.p.sum(-1)  # the read steps' keys and any sinks: never evicted
        self.o = probs @ vc
        self.vv = (self.vc * self.vc).sum(-1)  # [Hq, t]
        self.vo = self.o @ self.vc.transpose(1, 2)  # [Hq, S, t]
        self.oo = (self.o * self.o).sum(-1, keepdim=True)  # [Hq, S, 1]

    def cost(self, keep: torch.Tensor, movable: torch.Tensor) -> torch.Tensor:
        """[Hkv, t]: E(m) after evicting each entry alone from ``keep`` (float [Hkv, t], 1 kept), summed over the
        cell's query heads and the read steps; ``inf`` where the entry is evicted already or not ``movable``."""
        hkv, t = keep.shape
        g = self.p.shape[0] // hkv
        pm = self.p * keep.repeat_interleave(g, 0)[:, None, :]  # [Hq, S, t]
        den = (pm.sum(-1) + self.r)[..., None]  # [Hq, S, 1]
        err = (pm @ self.vc + self.n) / den - self.o  # [Hq, S, d]
        ee = (err * err).sum(-1, keepdim=True)
        ev = err @ self.vc.transpose(1, 2) - (err * self.o).sum(-1, keepdim=True)  # <e, v_i - o> [Hq, S, t]
        vmo = self.vv[:, None, :] - 2 * self.vo + self.oo  # |v_i - o|^2
        new = (den * den * ee - 2 * den * self.p * ev + self.p * self.p * vmo) / (den - self.p).clamp_min(1e-300)**2
        cost = new.view(hkv, g, *new.shape[1:]).sum((1, 2))
        return cost.masked_fill(~(movable & (keep > 0)), float("inf"))

    def evict(self, keep: torch.Tensor, movable: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """keep float [Hkv, t] (1 kept); evicts ``count [Hkv]`` more of the ``movable [Hkv, t]`` kept entries,
        ``CHUNK`` a round, the cheapest (:meth:`cost`) first; returns the new keep."""
        keep, left = keep.clone(), count.clone()
        while bool((left > 0).any()):
            n = left.clamp(max=CHUNK)
            order = self.cost(keep, movable).argsort(dim=-1, stable=True)[:, :CHUNK]  # ties: the older entry first
            take = torch.arange(order.shape[-1])[None] < n[:, None]
            keep.scatter_(-1, order, torch.where(take, 0.0, keep.gather(-1, order)))
            left -= n
        return keep


def _recorded(engine, t: int) -> list[dict[str, torch.Tensor]]:
    """Each layer's q/k/v (:func:`~kvdiag.trace.reader.rebuild_layers`) of the tokens up to ``engine``'s last read step
    after ``t``, the full cache's, one prefill kept per engine (decisions searches every budget of a checkpoint)."""
    from kvdiag.trace.reader import rebuild_layers

    held = _RECORDED.get(engine)
    if held is None or held[0] != t:
        held = _RECORDED[engine] = (t, rebuild_layers(engine.lm, engine.ids[: t + engine.steps(t)], torch.float32))
    return held[1]


@torch.no_grad()
def reconstruction_set(engine, t: int, start: torch.Tensor, movable: torch.Tensor) -> torch.Tensor:
    """bool [L, Hkv, t]: the set evicting, in each cell, as many of its ``movable [L, Hkv, t]`` entries as ``start
    [L, Hkv, t]`` does (the rest keep ``start``'s status), chosen by the module docstring's greedy rounds on the
    queries of ``engine``'s read steps after ``t``."""
    out, steps = start.clone(), engine.steps(t)
    mods = attention_modules(engine.lm.model)
    for l, x in enumerate(_recorded(engine, t)):  # one layer's terms at a time: [Hq, S, t] float64 each
        layer = _Layer(x["q"], x["k"], x["v"], engine.attention.layers[l], output_projection(mods[l]).weight, t, steps)
        keep = (movable[l] | ~start[l]).double()  # movable entries all kept; the rest as the start has them
        keep = layer.evict(keep, movable[l], (start[l] & movable[l]).sum(-1))
        out[l] = torch.where(movable[l], keep == 0, start[l])
    return out
