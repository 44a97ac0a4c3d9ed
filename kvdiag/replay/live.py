"""Live scoring: what a real compressor sees at a checkpoint, and how it picks the entries to keep.

At a checkpoint ``t`` the cache of layer ``ℓ`` holds ``n`` entries at absolute positions ``[Hkv, n]`` (with
per-head selection the heads differ) and the compressor holds a *query window*: the last ``W_q`` post-RoPE
queries, recorded as the model computes them by a registered attention function (R-KV keeps the same
query cache). Scorers read a live :class:`~kvdiag.scorers.ScoreContext` (``positions`` + ``checkpoint``): window
attention over the cached keys, causal by absolute position, ages ``t - position``, no future.
"""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar

import torch
from scipy.stats import rankdata
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvdiag.adapters import LayerAttention, as_layer_attention, check_kwargs, model_attention
from kvdiag.attention import attention_context, group_size, model_eager_attention
from kvdiag.errors import UserError, check_choice
from kvdiag.scorers import SCORERS, ScoreContext, Scorer, get_scorer
from kvdiag.scorers.context import HistoryUnavailable

REPLAY_ATTN = "kvdiag_replay"
SELECTIONS = ("per-head", "per-token")
# fields that hold a scorer's observation window (the zoo's convention; --w-obs sets them)
WINDOW_FIELDS = ("window", "w_obs")
# size of the synthetic probe cache used to list the scorers a live cache supports
PROBE_ENTRIES = 64

_WINDOW: ContextVar["QueryWindow | None"] = ContextVar("kvdiag_query_window", default=None)


class QueryWindow:
    """The last ``size`` post-RoPE queries of every layer (batch row 0), ``[H, w, d]`` with ``w <= size``."""

    def __init__(self, num_layers: int, size: int):
        self.size = size
        self.rows: list[torch.Tensor | None] = [None] * num_layers

    def add(self, layer: int, query: torch.Tensor) -> None:
        """query [H, c, d]: the newest ``c`` queries of ``layer``."""
        rows = self.rows[layer]
        rows = query if rows is None else torch.cat([rows, query], dim=1)
        self.rows[layer] = rows[:, -self.size :].detach()

    def get(self, layer: int) -> torch.Tensor:
        return self.rows[layer]


def _observe(module, query, kwargs) -> None:
    check_kwargs(module, None, dict(kwargs), "replay")  # unknown attention arguments are refused
    window = _WINDOW.get()
    if window is not None:
        window.add(module.layer_idx, query[0])


def replay_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, q, d] -> records the queries, then the plain SDPA kernel (outputs unchanged)."""
    _observe(module, query, kwargs)
    kwargs.pop("output_attentions", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def replay_attention_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """As :func:`replay_attention`, through the model file's eager attention (softcap, sinks)."""
    _observe(module, query, kwargs)
    return model_eager_attention(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(REPLAY_ATTN, replay_attention)
AttentionMaskInterface.register(REPLAY_ATTN, sdpa_mask)  # without it SDPA mis-slices q > 1 over a cache
AttentionInterface.register(REPLAY_ATTN + "_eager", replay_attention_eager)
AttentionMaskInterface.register(REPLAY_ATTN + "_eager", eager_mask)


def observing(model, window: QueryWindow | None):
    """Run ``model`` through the recording attention function (the implementation that reproduces the model,
    from ``kvdiag.adapters``: SDPA or eager), filling ``window`` (None: record nothing)."""
    eager = model_attention(model).implementation == "eager"
    return attention_context(model, REPLAY_ATTN + "_eager" if eager else REPLAY_ATTN, _WINDOW, window)


# --------------------------------------------------------------------------- scorers in a live cache


def query_window_size(scorer: Scorer) -> int:
    """W_q: the queries the compressor keeps for ``scorer``, its largest observation window (at least 1)."""
    return max([int(getattr(scorer, f)) for f in WINDOW_FIELDS if getattr(scorer, f, None) is not None] + [1])


def make_scorer(name: str, params: dict | None = None, w_obs: int | None = None) -> Scorer:
    """The scorer ``name`` with ``params``; ``w_obs`` sets its observation-window fields unless ``params`` does."""
    if name not in SCORERS:
        get_scorer(name)  # the registry's error names the known scorers
    fields = {} if w_obs is None else {f.name: w_obs for f in dataclasses.fields(SCORERS[name]) if f.name in WINDOW_FIELDS}
    return get_scorer(name, **{**fields, **(params or {})})


def probe_scores(scorer: Scorer, n: int, group: int, head_dim: int, window: int, seed: int = 0) -> torch.Tensor:
    """[n] scores of ``scorer`` on a seeded random live cache of ``n`` entries (one KV head of ``group`` query
    heads, positions ``0..n-1``, checkpoint ``n``, the last ``window`` queries)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen) for shape in
               ((group, min(window, n), head_dim), (1, n, head_dim), (1, n, head_dim)))
    ctx = ScoreContext(q, k, v, head_dim**-0.5, prompt_len=n // 2, positions=torch.arange(n), checkpoint=n,
                       o_proj=torch.randn(8, group * head_dim, generator=gen))
    return scorer.scores(ctx)[0]


def live_scorer_names(group: int = 2, head_dim: int = 16) -> list[str]:
    """The registered scorers whose defaults run on a live cache (no feature of every past query)."""
    names = []
    for name, cls in SCORERS.items():
        try:
            scorer = cls()  # a rule that needs a setting (fitted's model path) has no default instance
            probe_scores(scorer, PROBE_ENTRIES, group, head_dim, query_window_size(scorer))
        except (UserError, ValueError):  # HistoryUnavailable, or a plugin that cannot score a live cache
            continue
        names.append(name)
    return names


def check_live_scorer(scorer: Scorer, budget: int | None = None, interval: int = 0, group: int = 2, head_dim: int = 16) -> int:
    """Refuse ``scorer`` unless it runs on a live cache and (with a ``budget``) its protected entries fit it.

    The protected entries are found by probing a cache of ``budget + interval`` entries (the most a
    compression ever sees): entries a rule keeps unconditionally share :func:`~kvdiag.scorers.protect`'s kept
    score, so they are the entries tied at the top of the probe's scores. Returns their number.
    """
    n = PROBE_ENTRIES if budget is None else budget + interval
    try:
        scores = probe_scores(scorer, n, group, head_dim, query_window_size(scorer))
    except HistoryUnavailable:
        raise UserError(
            f"--scorer {scorer.name} needs the attention of every past query, which a live cache does not keep; "
            f"replay supports {', '.join(live_scorer_names(group, head_dim))}") from None
    except ValueError as err:
        raise UserError(f"--scorer {scorer.name} cannot score a live cache ({err}); set its window with --w-obs or --param") from err
    top = scores == scores.max()
    protected = int(top.sum()) if int(top.sum()) > 1 else 0
    if budget is not None and protected > budget:
        raise UserError(
            f"--budget {budget} is smaller than the {protected} entries {scorer.name} always keeps (its protected windows "
            f"at {n} cached entries); use --budget >= {protected} or shrink its windows with --param/--w-obs")
    return protected


# --------------------------------------------------------------------------- scoring and selection


def score_layer(
    scorer: Scorer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, queries: torch.Tensor,
    checkpoint: int, scale: LayerAttention | float, prompt_len: int, layer: int, prompt_id: str, token_ids: torch.Tensor,
    selection: str, o_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Live scores [Hkv, n] of one layer's cache (fp32, CPU; higher = keep).

    keys, values [Hkv, n, d] at absolute ``positions [Hkv, n]`` (ascending per head); queries [H, w, d] at
    ``[checkpoint - w, checkpoint)``; token_ids [checkpoint]; ``scale``: the layer's ``LayerAttention`` (or a bare
    scale). ``per-token``: every head holds the same positions
    and one context scores the layer. ``per-head``: one context per KV head (its group of query heads), so each
    head's ages and windows follow its own positions; such a context's ``prompt_id`` is ``"<id>/kv<h>"`` so that
    seeded scorers draw per head, and a rule that pools over all query heads (TOVA) pools over the group.
    """
    keys, values, queries = keys.float().cpu(), values.float().cpu(), queries.float().cpu()
    Hkv = keys.shape[0]
    attn = as_layer_attention(scale)
    if selection == "per-token":
        pos = positions[0]
        ctx = ScoreContext(queries, keys, values, attn, prompt_len, layer, prompt_id, token_ids[pos],
                           o_proj=o_proj, positions=pos, checkpoint=checkpoint)
        return _checked(scorer, scorer.scores(ctx), ctx)
    g = group_size(queries.shape[0], Hkv)
    d = keys.shape[2]
    rows = []
    for h in range(Hkv):
        pos = positions[h]
        ctx = ScoreContext(queries[h * g : (h + 1) * g], keys[h : h + 1], values[h : h + 1],
                           attn.query_heads(h * g, (h + 1) * g), prompt_len, layer,
                           f"{prompt_id}/kv{h}", token_ids[pos],
                           o_proj=None if o_proj is None else o_proj[:, h * g * d : (h + 1) * g * d],
                           positions=pos, checkpoint=checkpoint)
        rows.append(_checked(scorer, scorer.scores(ctx), ctx))
    return torch.cat(rows)


def _checked(scorer: Scorer, scores: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
    if tuple(scores.shape) != (ctx.num_kv_heads, ctx.t) or not bool(torch.isfinite(scores).all()):
        raise UserError(f"scorer {scorer.name} returned {tuple(scores.shape)} scores (non-finite or not [Hkv, n] = "
                        f"[{ctx.num_kv_heads}, {ctx.t}]) at layer {ctx.layer}, checkpoint {ctx.checkpoint}; fix its scores()")
    return scores.float()


def top_slots(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The ``budget`` highest-scored slots of each row of ``scores [..., n]``, ascending; ties keep the newer slot."""
    n = scores.shape[-1]
    # a stable descending sort of the reversed row puts the newer of tied entries first
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :budget]
    return (n - 1 - order).sort(dim=-1).values


def select_keep(scores: list[torch.Tensor], budget: int, selection: str) -> torch.Tensor:
    """Slots to keep [L, Hkv, budget] (ascending) from per-layer scores ``[Hkv, n]``; ties keep the newer entry.

    ``per-head``: each (layer, KV head) keeps its own top ``budget`` (R-KV). ``per-token``: one keep set for every
    layer and head, ranked by the mean over layers and heads of each row's percentile rank (``mean_rank``, the
    token aggregation of ``kvdiag score``).
    """
    check_choice(selection, SELECTIONS, "--selection")
    stacked = torch.stack(scores)  # [L, Hkv, n]
    if selection == "per-head":
        return top_slots(stacked, budget)
    L, Hkv, n = stacked.shape
    # every row ranks the same n entries, so the mean percentile rank orders entries as the sum of average
    # ranks, which is exact in fp64 (half-integers): float noise never breaks a tie
    ranks = rankdata(stacked.reshape(L * Hkv, n).double().numpy(), method="average", axis=-1).sum(axis=0)
    return top_slots(torch.from_numpy(ranks), budget).expand(L, Hkv, budget)
