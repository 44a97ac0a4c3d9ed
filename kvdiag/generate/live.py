"""Live scoring: what a real compressor sees at a checkpoint, and how it picks the entries to keep.

At a checkpoint ``t`` the cache of layer ``ℓ`` holds ``n`` entries at absolute positions ``[Hkv, n]`` (with
per-head selection the heads differ) and the compressor holds a *query window*: the last ``W_q`` post-RoPE
queries, recorded as the model computes them by a registered attention function (R-KV keeps the same
query cache; ``kvdiag.cache.attend``). Scorers read a live :class:`~kvdiag.scorers.ScoreContext`
(``positions`` + ``checkpoint``): window attention over the cached keys, causal by absolute position, ages
``t - position``, no future.
"""

from __future__ import annotations

import torch

from kvdiag.core.errors import UserError
from kvdiag.core.selection import SELECTIONS, Selection, select_keep, top_slots  # noqa: F401  (replay's API)
from kvdiag.model.adapters import LayerAttention, as_layer_attention
from kvdiag.model.attention import group_size
from kvdiag.scorers import SCORERS, ScoreContext, Scorer, get_scorer
from kvdiag.scorers.context import HistoryUnavailable
from kvdiag.scorers.fields import check_budget_fits, history_refusal

# entries of the seeded live cache on which check_live_scorer runs a rule once
PROBE_ENTRIES = 64


# --------------------------------------------------------------------------- scorers in a live cache


def make_scorer(name: str, params: dict | None = None, w_obs: int | None = None) -> Scorer:
    """The scorer ``name`` with ``params``; ``w_obs`` sets its observation window (the field its ``window_field``
    declares) unless ``params`` does."""
    cls = SCORERS.resolve(name)
    window = {} if w_obs is None or cls.window_field is None else {cls.window_field: w_obs}
    return get_scorer(name, **{**window, **(params or {})})


def live_scorer_names() -> list[str]:
    """The registered scorers whose defaults run on a live cache: they declare no need of every past query's
    attention (``needs_history``) or of the Trace's model (``needs_model``)."""
    names = []
    for name, cls in SCORERS.items():
        try:
            scorer = cls()  # a rule that needs a setting (fitted's model path) has no default instance
        except UserError:
            continue
        if not (scorer.needs_history or scorer.needs_model):
            names.append(name)
    return names


def protected_count(scorer: Scorer, n: int) -> int:
    """The most entries ``scorer`` declares protected in a live cache of ``n`` entries: over every split of the cache
    into the ``k`` oldest positions ``0..k-1`` (sinks) and the ``n - k`` newest entries (ages ``1..n-k``), the largest
    number its :meth:`~kvdiag.scorers.Scorer.protected` marks."""
    far = 1 << 40  # the two groups never meet: sinks are old, the newest entries sit at far positions
    oldest = scorer.protected(far - torch.arange(n), torch.arange(n)).long().cumsum(0)  # protected among the k oldest
    newest = scorer.protected(torch.arange(1, n + 1), far - torch.arange(1, n + 1)).long().cumsum(0)
    zero = torch.zeros(1, dtype=torch.long)
    a, b = torch.cat([zero, oldest]), torch.cat([zero, newest])  # a[k], b[m]: counts among k oldest, m newest
    return int((a + b.flip(0)).max())


def check_live_scorer(scorer: Scorer, budget: int | None = None, interval: int = 0, group: int = 2,
                      head_dim: int = 16) -> int:
    """Refuse ``scorer`` unless its declaration lets it run on a live cache and (with a ``budget``) its protected
    entries fit the budget at every compaction (a cache of ``budget + interval`` entries, the most one sees).
    Returns the number of entries it protects there.

    The declaration decides (``needs_history``, ``needs_model``, ``protected``); one scoring of a small seeded live
    cache then checks that the rule keeps it (a plugin whose declaration is wrong gets one line before any work).
    """
    if scorer.needs_history:
        raise history_refusal(scorer.name, live_scorer_names())
    if scorer.needs_model:
        raise UserError(f"--scorers {scorer.name} reads the Trace's model (it declares needs_model), which a live "
                        "cache does not carry; grade it with `kvdiag score`")
    n = PROBE_ENTRIES if budget is None else budget + interval
    try:
        _probe(scorer, min(n, PROBE_ENTRIES), group, head_dim)
    except HistoryUnavailable:
        raise UserError(f"--scorers {scorer.name} reads the attention of every past query but does not declare "
                        "needs_history; set needs_history = True in its class") from None
    except ValueError as err:
        raise UserError(f"--scorers {scorer.name} cannot score a live cache ({err}); set its window with --w-obs or "
                        "--param, or declare its window_field") from err
    protected = protected_count(scorer, n)
    if budget is not None:
        check_budget_fits(scorer.name, protected, budget, n)
    return protected


def _probe(scorer: Scorer, n: int, group: int, head_dim: int) -> torch.Tensor:
    """[n] scores of ``scorer`` on a seeded random live cache of ``n`` entries (one KV head of ``group`` query heads,
    positions ``0..n-1``, checkpoint ``n``, the last ``query_window`` queries)."""
    gen = torch.Generator().manual_seed(0)
    w = min(max(scorer.query_window, 1), n)
    shapes = ((group, w, head_dim), (1, n, head_dim), (1, n, head_dim))
    q, k, v = (torch.randn(*shape, generator=gen) for shape in shapes)
    ctx = ScoreContext(q, k, v, head_dim**-0.5, prompt_len=n // 2, positions=torch.arange(n), checkpoint=n,
                       o_proj=torch.randn(8, group * head_dim, generator=gen))
    return scorer.scores(ctx)[0]


# --------------------------------------------------------------------------- scoring and selection


def score_layer(
    scorer: Scorer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, queries: torch.Tensor,
    checkpoint: int, scale: LayerAttention | float, prompt_len: int, layer: int, prompt_id: str,
    token_ids: torch.Tensor | None, selection: Selection | str, o_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Live scores [Hkv, n] of one layer's cache (fp32, CPU; higher = keep).

    keys, values [Hkv, n, d] at absolute ``positions [Hkv, n]`` (ascending per head); queries [H, w, d] at
    ``[checkpoint - w, checkpoint)``; token_ids [checkpoint] (None under ``model.generate``: the cache never sees
    the tokens); ``scale``: the layer's ``LayerAttention`` (or a bare
    scale). ``per-token``: every head holds the same positions and one context scores the layer. ``per-head``: one
    context per KV head (its group of query heads), so each head's ages and windows follow its own positions; such a
    context's ``prompt_id`` is ``"<id>/kv<h>"`` so that seeded scorers draw per head, and a rule that pools over all
    query heads (TOVA) pools over the group.
    """
    keys, values, queries = keys.float().cpu(), values.float().cpu(), queries.float().cpu()
    Hkv = keys.shape[0]
    attn = as_layer_attention(scale)
    if Selection.parse(selection).per_token:
        pos = positions[0]
        ctx = ScoreContext(queries, keys, values, attn, prompt_len, layer, prompt_id,
                           None if token_ids is None else token_ids[pos], o_proj=o_proj, positions=pos,
                           checkpoint=checkpoint)
        return scorer.scores(ctx)  # checked and protected by the Scorer base
    g = group_size(queries.shape[0], Hkv)
    d = keys.shape[2]
    rows = []
    for h in range(Hkv):
        pos = positions[h]
        ctx = ScoreContext(queries[h * g : (h + 1) * g], keys[h : h + 1], values[h : h + 1],
                           attn.query_heads(h * g, (h + 1) * g), prompt_len, layer,
                           f"{prompt_id}/kv{h}", None if token_ids is None else token_ids[pos],
                           o_proj=None if o_proj is None else o_proj[:, h * g * d : (h + 1) * g * d],
                           positions=pos, checkpoint=checkpoint)
        rows.append(scorer.scores(ctx))
    return torch.cat(rows)
