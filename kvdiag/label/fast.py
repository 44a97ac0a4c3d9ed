"""Approximate labels for every cached entry of a checkpoint at once (``kvdiag label --method NAME``).

``fisher`` (``--method fast``): a second-order estimate of the exact label's ``kl_mean``. The KL of the
evicted predictions has no first-order term at the full model; its second-order term is
``KL_tau ~ 1/2 dz^T F_tau dz`` with ``F_tau = E_{y ~ P_full(.|tau)} [grad log p(y) grad log p(y)^T]``.

1. Exact per layer: evicting key ``i`` from layer ``l`` changes each query head's attention output (before
   ``o_proj``) in closed form, ``o' = (o - p_i v_i) / (1 - p_i)``, i.e. ``do = p_i (o - v_i) / (1 - p_i)``,
   with ``p`` the layer's own probabilities (window, softcap and sinks included: a sink keeps its logit,
   so the rank-one update holds with the sink mass in ``1 - p_i``).
2. Linear propagation: ``K`` samples ``y_{k,tau} ~ P_full(.|tau)`` at every horizon step; one backward pass
   of ``s_k = sum_tau log p(y_{k,tau}|tau)`` gives ``g_k = ds_k/do`` at every layer, query and head, and
   ``a_k = sum g_k . do`` is the linearized change of ``s_k``. Scores have zero mean under ``P_full`` and the
   steps are sampled independently, so ``E[a_k^2] = sum_tau 2 KL_tau`` (second order) and
   ``kl_mean ~ mean_k a_k^2 / (2 H)``.
3. One more row with the realized tokens gives a linear estimate of ``nll_delta``.

One forward of the H tokens over the shared prefix and K + 1 backward passes (batched over the cotangents)
label every entry [0, t) of every layer and KV head at once, whatever their number.

Long horizons run in chunks of C steps (``chunk``), so the graph, the logits and the cotangents [K + 1, C, V] are
one chunk's: a forward without a graph records each chunk's keys and values; then the chunks are differentiated last
first, each over the prefix and the earlier chunks' keys and values (leaves), with the cotangents its own keys and
values received from the later chunks, so every g_k holds all its paths (reverse-mode through the horizon in chunks:
equal to the one-forward gradient up to rounding). What grows with H is the chunks' keys and values and their
cotangents (2 L Hkv d values per step, times K + 1). What the method
cannot give is null: ``kl_max``, ``kl_steps``, ``js_mean``, ``top1_flips``; ``noise_floor`` is 0 (no
batched-path rounding to measure; an estimate of exactly 0 means the entry is invisible to every query).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvdiag.core.errors import UserError
from kvdiag.core.schema import CHUNK
from kvdiag.label.config import (  # noqa: F401  (the methods' API)
    FAST,
    METHODS,
    FisherParams,
    method_params,
    resolve_method,
)
from kvdiag.label.engine import OracleEngine, Row
from kvdiag.model.adapters import LayerAttention, check_kwargs
from kvdiag.model.attention import attention_context
from kvdiag.model.load import LoadedModel

FISHER_ATTN = "kvdiag_fisher"


@dataclass
class _Pass:
    """What one forward (of one chunk) records. prefix[l] = (k, v) [Hkv, t, d]; past[l] = (k, v) [1, Hkv, c0, d] the
    earlier chunks' keys and values (none at c0 = 0); per layer: probs[l] [Hq, W, t] over the prefix, out[l]
    [1, W, Hq, d] (the attention output, kept in the graph), kv[l] = (k, v) [1, Hkv, W, d] the chunk's own."""

    prefix: list[tuple[torch.Tensor, torch.Tensor]]
    attention: list[LayerAttention]
    start: int  # absolute position of the first horizon token (= t)
    probs: dict[int, torch.Tensor]
    out: dict[int, torch.Tensor]
    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_PASS: ContextVar[_Pass | None] = ContextVar("kvdiag_fisher_pass", default=None)


def _fisher_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, Hq, W, d], key/value [1, Hkv, W, d] (the horizon tokens) over the shared prefix, dense and
    differentiable, with the layer's semantics -> [1, W, Hq, d]."""
    rec = _PASS.get()
    layer = module.layer_idx
    spec = rec.attention[layer]
    check_kwargs(module, spec, kwargs, "label --method fisher")
    pk, pv = rec.prefix[layer]
    n, hq, w, _ = query.shape
    g = hq // pk.shape[0]
    rec.kv[layer] = (key, value)
    past = [] if rec.past is None else [rec.past[layer]]
    k = torch.cat([pk[None].expand(n, -1, -1, -1), *(k for k, _ in past), key], 2).repeat_interleave(g, 1)
    v = torch.cat([pv[None].expand(n, -1, -1, -1), *(v for _, v in past), value], 2).repeat_interleave(g, 1)
    first = rec.start + (past[0][0].shape[2] if past else 0)  # absolute position of the chunk's first query
    qpos = torch.arange(first, first + w, device=query.device)  # k: [N, Hq, t + c0 + W, d]
    kpos = torch.arange(first + w, device=query.device)
    logits = spec.logits((query @ k.transpose(-1, -2)).float()).masked_fill(spec.hidden(qpos, kpos), float("-inf"))
    # every query sees itself, so no row is all -inf (LayerAttention.softmax's in-place fix-up would break autograd)
    p = torch.softmax(logits, -1) if spec.sinks is None else spec.softmax(logits, heads_dim=1)
    out = (p.to(v.dtype) @ v).transpose(1, 2)  # [N, W, Hq, d]
    rec.probs[layer] = p[0, :, :, : rec.start].detach()
    rec.out[layer] = out
    return out, None


AttentionInterface.register(FISHER_ATTN, _fisher_attention)
AttentionMaskInterface.register(FISHER_ATTN, lambda *args, **kwargs: None)


class FisherLabeler:
    """Labels every entry of one prompt's checkpoints with the ``fisher`` estimate; build once per prompt."""

    def __init__(self, lm: LoadedModel, token_ids: torch.Tensor, horizon: int | str, params: FisherParams,
                 seed: int = 0, chunk: int = CHUNK):
        params.validate()
        # the full-cache run, extended checkpoint by checkpoint; it also says H at each checkpoint (N, or rest) and
        # splits it into chunks of ``chunk`` steps (module docstring)
        self.golden_engine = OracleEngine(lm, token_ids, horizon, chunk=chunk)
        self.model, self.ids, self.horizon, self.params, self.seed = (
            lm.model, self.golden_engine.ids, horizon, params, seed,
        )
        self.attention = lm.attention
        self.num_layers, self.num_kv_heads = self.attention.num_layers, self.attention.num_kv_heads

    def golden(self, t: int):
        return self.golden_engine.golden(t)

    def steps(self, t: int) -> int:
        """H at checkpoint ``t`` (the fixed horizon, or T - t: rest)."""
        return self.golden_engine.steps(t)

    def effects(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linearized effects of evicting each entry [0, t) at each (layer, KV head): (a [K, L, Hkv, t] on the
        sampled log-likelihoods, n [L, Hkv, t] on the realized tokens' log-likelihood, summed over steps)."""
        prefix, logp_full = self.golden(t)
        K, W = self.params.samples, self.golden_engine.steps(t)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + t)
        y = torch.multinomial(logp_full.exp().cpu(), K, replacement=True, generator=gen).T.to(self.ids.device)  # [K, W]
        targets = self.ids[t + 1 : t + W + 1]  # realized next tokens (the last step may have none)
        spans = self.golden_engine.spans(t)
        # the chunks' own keys and values (no graph), which the later chunks read: none when one chunk holds H
        kv: list[list] = []
        for c0, c1 in spans[:-1]:
            kv.append(self._forward(t, prefix, c0, c1, self._past(kv))[1])
        kv_cot: list[list | None] = [None] * len(spans)  # per chunk, per layer: (dk, dv) [K + 1, 1, Hkv, W_c, d]
        out = torch.zeros(K + 1, self.num_layers, self.num_kv_heads, t, device=self.ids.device)
        for c in reversed(range(len(spans))):  # last chunk first: its cotangents reach the earlier chunks' k, v
            c0, c1 = spans[c]
            # cotangents of log P [W_c, V]: one-hot at y_{k, tau} (rows 0..K-1), at the realized tokens (row K)
            cot = torch.zeros(K + 1, c1 - c0, logp_full.shape[-1], device=self.ids.device)
            cot[:K].scatter_(-1, y[:, c0:c1, None], 1.0)
            real = targets[c0:c1]
            cot[K, torch.arange(len(real)), real] = 1.0
            past = None if c == 0 else [(k.requires_grad_(), v.requires_grad_()) for k, v in self._past(kv[:c])]
            with torch.enable_grad():
                logp, rec = self._forward(t, prefix, c0, c1, past, grad=True)
                layers = sorted(rec.out)
                outputs, cots = [logp], [cot]
                if kv_cot[c] is not None:  # what the later chunks read of this one's keys and values
                    for l in layers:
                        outputs += list(rec.kv[l])
                        cots += list(kv_cot[c][l])
                inputs = [rec.out[l] for l in layers] + ([x for l in layers for x in past[l]] if past else [])
                # one forward (every row's activations are the same), K + 1 backward passes batched (vmap)
                grads = torch.autograd.grad(outputs, inputs, grad_outputs=cots, is_grads_batched=True)
            for l, g in zip(layers, grads[: len(layers)], strict=True):
                out[:, l] += self._layer_effect(rec.probs[l], rec.out[l][0].detach(), prefix[l][1], g[:, 0])
            if past:  # split the earlier chunks' cotangents by chunk and add them up
                for l, (dk, dv) in zip(layers, zip(grads[len(layers) :: 2], grads[len(layers) + 1 :: 2],
                                                       strict=True), strict=True):
                    for e, (e0, e1) in enumerate(spans[:c]):
                        kv_cot[e] = kv_cot[e] or [[0, 0] for _ in range(self.num_layers)]
                        kv_cot[e][l][0] = kv_cot[e][l][0] + dk[..., e0:e1, :]
                        kv_cot[e][l][1] = kv_cot[e][l][1] + dv[..., e0:e1, :]
        return out[:K].cpu(), out[K].cpu()  # label() indexes them with CPU rows

    @staticmethod
    def _past(chunks: list[list]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The keys and values [1, Hkv, c0, d] per layer of ``chunks`` (the earlier chunks', each per layer (k, v)),
        joined along the steps; None before the first chunk."""
        if not chunks:
            return None
        return [tuple(torch.cat([c[l][i] for c in chunks], 2).detach() for i in (0, 1)) for l in range(len(chunks[0]))]

    def _forward(self, t: int, prefix, c0: int, c1: int, past, grad: bool = False):
        """Steps [c0, c1) of the horizon at checkpoint ``t`` over the prefix and ``past`` (:meth:`_past`): (log P
        [W_c, V] fp32, the pass's record), or, without ``grad``, (None, its keys and values per layer, detached)."""
        pos = torch.arange(t + c0, t + c1, device=self.ids.device)[None]
        rec = _Pass(prefix, self.attention.layers, t, {}, {}, past)
        with attention_context(self.model, FISHER_ATTN, _PASS, rec):
            if not grad:
                with torch.no_grad():
                    self.model(self.ids[None, t + c0 : t + c1], position_ids=pos, use_cache=False, logits_to_keep=1)
                return None, [tuple(x.detach() for x in rec.kv[l]) for l in sorted(rec.kv)]
            logits = self.model(self.ids[None, t + c0 : t + c1], position_ids=pos, use_cache=False).logits[0]
        return torch.log_softmax(logits.float(), -1), rec

    @staticmethod
    def _layer_effect(p: torch.Tensor, o: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """p [Hq, W, t], o [W, Hq, d], v [Hkv, t, d], g [N, W, Hq, d] -> sum over queries and query
        heads of g . do per (row, KV head, entry): [N, Hkv, t]; do = p_i (o - v_i) / (1 - p_i)."""
        hkv = v.shape[0]
        hq, w, t = p.shape
        # 1 - p_i is the mass left (sink included); a key holding all of it leaves nothing: clamp
        r = (p / (1 - p).clamp_min(1e-6)).view(hkv, hq // hkv, w, t)
        g = g.float().permute(0, 2, 1, 3).reshape(g.shape[0], hkv, hq // hkv, w, -1)  # [N, Hkv, G, W, d]
        o = o.float().permute(1, 0, 2).reshape(hkv, hq // hkv, w, -1)  # [Hkv, G, W, d]
        go = (g * o).sum(-1)  # [N, Hkv, G, W]
        gv = torch.einsum("nkgwd,kid->nkgwi", g, v.float())  # [N, Hkv, G, W, t]
        return torch.einsum("kgwi,nkgwi->nki", r, go[..., None] - gv)

    def label(self, t: int, rows: list[Row]) -> dict[str, torch.Tensor]:
        """Estimates for ``rows`` (any granularity; all from one pass): kl [N] (~ kl_mean), nll_delta [N]."""
        self.golden_engine.check_checkpoint(t)
        for r in rows:
            if not 0 <= r.position < t:
                raise UserError(f"candidate position {r.position} at checkpoint {t}: candidates must lie in [0, {t})")
        a, nll = self.effects(t)
        pos = torch.tensor([r.position for r in rows], dtype=torch.long)
        layer = torch.tensor([r.layer for r in rows], dtype=torch.long)
        head = torch.tensor([r.kv_head for r in rows], dtype=torch.long)
        # a row's effect: the sum over the (layer, KV head) cells it evicts from (first order: effects add)
        cells = ((layer[:, None] == -1) | (layer[:, None] == torch.arange(self.num_layers)))[:, :, None] & (
            (head[:, None] == -1) | (head[:, None] == torch.arange(self.num_kv_heads)))[:, None, :]  # [N, L, Hkv]
        row_a = torch.einsum("rlh,klhr->kr", cells.float(), a[..., pos])
        row_n = torch.einsum("rlh,lhr->r", cells.float(), nll[..., pos])
        H = self.golden_engine.steps(t)
        n_targets = len(self.ids[t + 1 : t + H + 1])
        return {"kl": row_a.double().pow(2).mean(0) / (2 * H), "nll_delta": -row_n.double() / n_targets}


# --------------------------------------------------------------------------- registry

# name -> (labeler class, params class); ``exact`` is the oracle engine itself
APPROXIMATE = {"fisher": (FisherLabeler, FisherParams)}
