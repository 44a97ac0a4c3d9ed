"""``oracle_search``: the best evicted set kvdiag can find in the rules' own action space, judged by exact labels.

At one (checkpoint ``t``, budget) it takes the best (lowest exact joint ``kl_mean``) of every candidate set (every
rule's, ``fast``, ``oracle_single``, ``future_attention``, ...) and, per-head, the reconstruction set
(:mod:`kvdiag.decisions.reconstruction`: per cell, the set whose attention outputs over the read steps stay closest
to the full cache's; one more exact row), starts from the lower of the two, and improves it by straight-through
descent on a keep score per entry. The scores start at ``+GAP`` (kept) and ``-GAP`` (evicted); each step labels the
current set with the soft-mask forward (attention weights ``m_i exp(s_i) / sum_j m_j exp(s_j)`` with ``m`` the 0/1
keep mask: exact there, the same KL as the set's row) and takes the gradient ``g = d KL / d m`` of that forward's
backward; the scores move by ``-LR`` times a momentum (``MOMENTUM``) of ``g / max |g|``, and the next set evicts, in
each cell, as many entries as the start did: the lowest-scoring. The best set the steps labeled is labeled once more
through the engine (``OracleEngine.label_sets``) and is the result only if that exact label is lower than the
descent's start's (by more than ``1e-6`` relative and ``1e-9`` nats, so rounding is never taken for progress; the
reconstruction set likewise against the best candidate): the result is never worse than any candidate.

Why a descent and not swaps: the search it replaces labeled batches of gradient-proposed swaps exactly and accepted
the best row of each (a gradient and 16 rows, about 8 s per accepted move). On SmolLM2 at t = 640, H = 128, keep
0.25 (from ``future_attention``, 0.0660 nats), the swaps were at 0.0100 after 120 s and 0.00204 after 1,920 s; the
descent, one gradient per step (about 1 s, every step a move), at 0.00224 after 180 s, 0.00183 after 300 s and
0.00133 after 600 s (docs/benchmarks.md). Momentum carries a gradient whose sign holds over steps: an entry's score
crosses its cell's boundary only after several steps push it the same way (2 to 27 entries moved per step in that
run).

The prediction is linear in the mask, so it fails for an entry of large attention weight (position 0 above all: a
drop scales the rest by 1 / (1 - w)): a kept entry whose weight (``reach``, from the gradient's forward) exceeds
``REACH`` gets no push toward eviction from its own gradient. Only entries a cell's queries can see (``visible``: a
sliding layer's window) move; the rest keep the start's status, so every cell keeps its number of evicted entries.

Effort: ``rows`` sets labeled (the reconstruction set's row is one, a step's forward one, the final exact row
another) and ``seconds`` (counted from the call, the reconstruction included; no new step after it); it stops earlier
once converged: when the steps since it had spent a quarter of them (4x more effort) took less than ``CONVERGED``
(1 %) off the best label it had then (checked after each step, from ``WARMUP`` steps on: the first steps only move
scores toward the boundary; and only once the search found a set below the best candidate, so that a search that
found nothing never counts as converged).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvdiag.decisions.reconstruction import reconstruction_set
from kvdiag.decisions.sets import mask_set, set_mask
from kvdiag.model.adapters import LayerAttention, check_kwargs
from kvdiag.model.attention import attention_context

SOFT_MASK_ATTN = "kvdiag_soft_mask"
ACCEPT_REL, ACCEPT_ABS = 1e-6, 1e-9  # the result must be lower than the start by more than this (rounding is not)
CONVERGED = 0.01  # 4x more steps took less than this share off the best label: converged
WARMUP = 64  # steps before convergence is judged: from +-GAP the first swap takes about 10 steps at LR 0.1
# the descent's start scores, step and momentum: on the docstring's checkpoint LR 0.05 was at 0.0104 nats after 60 s
# where LR 0.1 was at 0.0058 after 66 s; held out on two MATH-500 checkpoints (docs/benchmarks.md) LR 0.1 gave the
# lowest label at 2 of 4 (checkpoint, budget) and 0.2 at the other 2 (0.05 at none), neither far from the other
GAP, LR, MOMENTUM = 1.0, 0.1, 0.9
# A kept entry of attention weight (``reach``) above this gets no push toward eviction from its own gradient: g is
# linear in the mask, but a drop scales the rest by 1 / (1 - w), so above it the prediction fails. SmolLM2, t = 640,
# H = 128, keep 0.25, after 60 s of search: of the 32 best-predicted single swaps 6 lowered the label (9 of the best
# 12 moved position 0); of the 32 best among entries of reach <= 0.5, 32.
REACH = 0.5


@dataclass
class _Masked:
    """One soft-mask forward: prefix[l] = (k, v) [Hkv, t, d], keep[l] [Hkv, t] (float, differentiable); it fills
    reach[l] [Hkv, t] (see :func:`mask_gradient`)."""

    prefix: list[tuple[torch.Tensor, torch.Tensor]]
    keep: list[torch.Tensor]
    attention: list[LayerAttention]
    start: int
    reach: dict[int, torch.Tensor] = field(default_factory=dict)


_MASKED: ContextVar[_Masked | None] = ContextVar("kvdiag_soft_mask", default=None)


def _soft_mask_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, Hq, W, d], key/value [1, Hkv, W, d] (the horizon tokens) over the shared prefix whose entries are
    weighted by the keep mask, dense and differentiable, with the layer's window, softcap and sinks -> [1, W, Hq, d]."""
    rec = _MASKED.get()
    layer = module.layer_idx
    spec = rec.attention[layer]
    check_kwargs(module, spec, kwargs, "decisions oracle_search")
    pk, pv = rec.prefix[layer]
    hq, w = query.shape[1], query.shape[2]
    g = hq // pk.shape[0]
    k = torch.cat([pk[None], key], 2).repeat_interleave(g, 1).float()  # [1, Hq, t + W, d]
    v = torch.cat([pv[None], value], 2).repeat_interleave(g, 1).float()
    qpos = torch.arange(rec.start, rec.start + w, device=query.device)
    kpos = torch.arange(rec.start + w, device=query.device)
    logits = spec.logits(query.float() @ k.transpose(-1, -2)).masked_fill(spec.hidden(qpos, kpos), float("-inf"))
    top = logits.amax(-1, keepdim=True).detach()
    if spec.sinks is not None:
        sink = spec.sinks.to(query.device, torch.float32).view(1, -1, 1, 1)
        top = torch.maximum(top, sink)
    weights = (logits - top).exp()
    keep = torch.cat([rec.keep[layer].repeat_interleave(g, 0)[None, :, None, :].expand(1, hq, w, -1),
                      torch.ones(1, hq, w, w, device=query.device)], -1)
    kept = weights * keep
    z = kept.sum(-1, keepdim=True)
    if spec.sinks is not None:
        z = z + (sink - top).exp()
    hkv, t = pk.shape[0], pk.shape[1]
    rec.reach[layer] = (weights[0, :, :, :t] / z[0]).detach().view(hkv, g, w, t).amax((1, 2))  # e^s / Z, evicted too
    out = (kept / z) @ v
    return out.transpose(1, 2).to(query.dtype), None


AttentionInterface.register(SOFT_MASK_ATTN, _soft_mask_attention)
AttentionMaskInterface.register(SOFT_MASK_ATTN, lambda *args, **kwargs: None)


def mask_gradient(engine, t: int, evicted: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(g [L, Hkv, t] = d KL / d m at the keep mask ``m = ~evicted [L, Hkv, t]``, the KL there, reach [L, Hkv, t]):
    KL(P_full || P_m) averaged over the horizon steps, summed over the vocabulary (fp32), one forward and one backward
    of the H recorded tokens over the prefix. ``reach``: each entry's largest attention weight over the horizon
    queries of its KV head's query heads, ``e^s / Z`` with ``Z`` the normaliser of the kept entries (an evicted
    entry's is what restoring it alone would give it, before renormalising: it can exceed 1)."""
    prefix, logp_full = engine.golden(t)
    model, ids, H = engine.model, engine.ids, engine.steps(t)  # N, or T - t (--horizon rest)
    keep = [(~evicted[l]).float().to(ids.device).requires_grad_(True) for l in range(engine.num_layers)]
    rec = _Masked(prefix, keep, engine.attention.layers, t)
    pos = torch.arange(t, t + H, device=ids.device)[None]
    with torch.enable_grad(), attention_context(model, SOFT_MASK_ATTN, _MASKED, rec):
        logq = torch.log_softmax(model(ids[None, t : t + H], position_ids=pos, use_cache=False).logits[0].float(), -1)
        kl = (logp_full.exp() * (logp_full - logq)).sum(-1).mean()
        grads = torch.autograd.grad(kl, keep)
    reach = torch.stack([rec.reach[l].cpu().double() for l in range(engine.num_layers)])
    return torch.stack([g.detach().cpu().double() for g in grads]), float(kl.detach()), reach


def visible_entries(layers: list[LayerAttention], t: int) -> torch.Tensor:
    """bool [L, t]: the entries of [0, t) that some horizon query of each layer sees (``layers``: each layer's
    attention, the model's or a Trace's record; a sliding layer's window: the query at ``t`` sees keys
    ``> t - window``, later queries fewer)."""
    return torch.stack([torch.arange(t) >= layer.first_visible(t) for layer in layers])


@dataclass
class Candidate:
    """A labeled set: its name, its eviction mask [L, Hkv, t] and its exact joint label (the engine's row fields:
    kl [H], js [H], nll_delta [H'], flips [])."""

    name: str
    mask: torch.Tensor
    label: dict


@dataclass
class Searched:
    """What ``search`` returns: the best set found (``mask``; ``label`` its exact row), where it started, the
    improvement over the start (nats of ``kl_mean``), the set rows labeled and the seconds."""

    mask: torch.Tensor
    label: dict
    start: str
    start_kl: float
    rows: int
    seconds: float
    converged: bool = False  # 4x more steps gained under CONVERGED (it stopped there, unless told to go on)
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (steps, seconds, best label) per step
    reconstruction: float | None = None  # the reconstruction start's exact label (None: not built)

    @property
    def improvement(self) -> float:
        return self.start_kl - float(self.label["kl"].double().mean())


def after(history: list[tuple[int, float, float]], rows: float) -> tuple[int, float, float]:
    """The entry of a search's ``history`` (rows, seconds, best label; rows rising, the label never rising) that was
    current after ``rows`` rows: the last at or below it."""
    return max((h for h in history if h[0] <= rows), key=lambda h: h[0])


def search(engine, t: int, candidates: list[Candidate], per_token: bool, rows: int, seconds: float,
           visible: torch.Tensor | None = None, stop: bool = True) -> Searched:
    """``oracle_search`` at checkpoint ``t`` and one budget (module docstring): ``candidates`` labeled sets of the
    same budget (per-token: token sets, the same mask in every cell); ``rows``/``seconds`` its effort; ``visible``
    [L, t] the entries each layer can see (default: :func:`visible_entries`); ``stop``: stop once converged (False:
    spend the whole effort, what ``kvdiag bench decisions`` checks convergence with). ``history``: (sets labeled,
    seconds, the best label so far) after each step, the labels the soft-mask forward's (the result's is the
    engine's: the same KL through another attention path)."""
    began = time.perf_counter()
    start = min(candidates, key=lambda c: (float(c.label["kl"].double().mean()), c.name))
    start_kl = float(start.label["kl"].double().mean())
    visible = visible_entries(engine.attention.layers, t) if visible is None else visible
    L, Hkv = start.mask.shape[:2]
    # the descent's cells: every (layer, KV head), or one for a token set (its gradient summed over the cells)
    cur = start.mask[:1, :1].clone() if per_token else start.mask.clone()  # evicted [L | 1, Hkv | 1, t]
    movable = visible.any(0)[None, None] if per_token else visible[:, None].expand_as(cur)
    margin = max(ACCEPT_ABS, ACCEPT_REL * start_kl)  # below the start by more than rounding
    history = [(0, 0.0, start_kl)]
    # base: the set the descent starts from, with its exact label; reconstruction: that start's label when built
    steps, base, reconstruction = 0, (start.mask, start.label, start_kl), None
    if not per_token and rows > 1 and bool((cur & movable).any()):  # the reconstruction start: one exact row
        rec = reconstruction_set(engine, t, cur, movable)
        if not torch.equal(rec.sum(-1), cur.sum(-1)):  # another budget would be no candidate: never take it
            raise RuntimeError("oracle_search: the reconstruction set evicts another number of entries than its start")
        if not torch.equal(rec, cur):
            res, _ = engine.label_sets(t, [mask_set(rec)])
            steps, rec_kl = 1, float(res["kl"].double().mean())
            reconstruction = rec_kl
            history.append((1, round(time.perf_counter() - began, 3), min(start_kl, rec_kl)))
            if rec_kl < start_kl - margin:
                cur, base = rec.clone(), (rec, {key: val[0] for key, val in res.items()}, rec_kl)
    score = torch.where(cur, -GAP, GAP).double()
    velocity = torch.zeros_like(score)
    count = cur.sum(-1, keepdim=True)
    best, best_kl = cur, float("inf")
    # found: a set below the best candidate (from the start when the reconstruction set is the descent's start)
    converged, first, found = False, None, base[0] is not start.mask
    while steps < rows - 1 and not (converged and stop) and not (seconds and time.perf_counter() - began >= seconds):
        g, kl, reach = mask_gradient(engine, t, cur.expand(L, Hkv, -1) if per_token else cur)
        steps += 1
        if per_token:
            g, reach = g.sum((0, 1))[None, None], reach.amax((0, 1))[None, None]
        if kl < best_kl:
            best, best_kl = cur, kl
        first = kl if first is None else first  # the descent's start's own label through this forward's path
        found = found or best_kl < first - margin
        history.append((steps, round(time.perf_counter() - began, 3), min(history[-1][2], kl)))
        # judged once the search found a set below the best candidate (the reconstruction start, or a step below
        # the descent's start: both labels through this forward, as the engine's start_kl is another attention path,
        # a rounding apart): a search that has found nothing has not converged
        converged = converged or (steps >= WARMUP and found and _gain(history, steps) < CONVERGED)
        g = torch.where(movable & ~(~cur & (reach > REACH)), g, 0.0)
        velocity = MOMENTUM * velocity + g / g.abs().max().clamp_min(1e-300)
        score = score - LR * velocity
        cur = _lowest(score, cur, movable, count)
    mask, label, base_kl = base
    used = steps
    if not torch.equal(best.expand_as(mask), mask):  # a step found a lower set: label it exactly
        full = best.expand(L, Hkv, -1).clone() if per_token else best
        res, _ = engine.label_sets(t, [full[0, 0].nonzero()[:, 0] if per_token else mask_set(full)])
        used += 1
        kl = float(res["kl"].double().mean())
        if kl < base_kl - margin:
            label, mask = {key: val[0] for key, val in res.items()}, full
    return Searched(mask, label, start.name, start_kl, used, round(time.perf_counter() - began, 3), converged,
                    history, reconstruction)


def gain(then: float, now: float) -> float:
    """The share of the label ``then`` that more effort took off to ``now`` (the convergence rule's figure; 0 when
    ``then`` is already 0: nothing left to take off)."""
    return (then - now) / then if then > 0 else 0.0


def _gain(history: list[tuple[int, float, float]], steps: int) -> float:
    """The share of the best label after a quarter of ``steps`` that the steps since took off."""
    return gain(after(history, steps / 4)[2], history[-1][2])


def _lowest(score: torch.Tensor, cur: torch.Tensor, movable: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The set evicting, per cell, its ``count`` [C.., 1] lowest-``score`` entries [C.., t], entries not ``movable``
    keeping their status in ``cur`` (ties: the lower position first)."""
    fixed = torch.where(cur, float("-inf"), float("inf")).to(score.dtype)
    order = torch.where(movable, score, fixed).argsort(dim=-1, stable=True)
    out = torch.zeros_like(cur)
    return out.scatter_(-1, order, torch.arange(cur.shape[-1]).expand_as(order) < count)


def candidate(name: str, evict: torch.Tensor, label: dict, num_layers: int, num_kv_heads: int, t: int) -> Candidate:
    """A :class:`Candidate` from a labeled set ``evict`` ([E] or [L, Hkv, E])."""
    return Candidate(name, set_mask(evict, num_layers, num_kv_heads, t), label)
