"""Live scoring: what a real compressor sees at a checkpoint, and how it picks the entries to keep.

At a checkpoint ``t`` the cache of layer ``ℓ`` holds ``n`` entries at absolute positions ``[Hkv, n]`` (with
per-head selection the heads differ) and the compressor holds a *query window*: the last ``W_q`` post-RoPE
queries, recorded as the model computes them by a registered attention function (R-KV keeps the same
query cache; ``kvdiag.cache.attend``). Scorers read a live :class:`~kvdiag.scorers.ScoreContext`
(``positions`` + ``checkpoint``): window attention over the cached keys, causal by absolute position, ages
``t - position``, no future.
"""

from __future__ import annotations

import math
import numbers
import re

import torch

from kvdiag.core.errors import UserError
from kvdiag.core.selection import SELECTIONS, Selection, select_keep, top_slots  # noqa: F401  (replay's API)
from kvdiag.model.adapters import LayerAttention, as_layer_attention, model_attention
from kvdiag.model.attention import group_size
from kvdiag.scorers import SCORERS, ScoreContext, Scorer, get_scorer
from kvdiag.scorers.context import HistoryUnavailable
from kvdiag.scorers.fields import check_budget_fits, history_refusal

# entries of the seeded live cache on which check_live_scorer runs a rule once
PROBE_ENTRIES = 64
# the largest budget or interval the Python API takes: a count of cache entries (positions are int64, kernels index
# int32); anything larger is no cache size, and nothing is ever allocated in proportion to it
MAX_ENTRIES = 2**31 - 1


# --------------------------------------------------------------------------- the Python API's argument checks


class ArgumentError(UserError, ValueError):
    """Bad input to kvdiag's Python API (``EvictingCache``, ``as_press``): a ``ValueError`` naming the Python argument.
    Still a ``UserError``, so a CLI that reaches it prints it on one line."""


class ArgumentTypeError(UserError, TypeError):
    """An argument of the wrong type: a ``TypeError`` naming it (and a ``UserError``, as :class:`ArgumentError`)."""


def check_count(name: str, value, low: int = 1, high: int = MAX_ENTRIES) -> int:
    """``value`` as an int in ``[low, high]``, else one error naming ``name``: TypeError for a non-number (a string,
    None, a bool), ValueError for a float (nan, inf and 2.5 are no count; 32.0 is refused too, rather than guessed)
    or a count out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}={value!r}: give an int (got {type(value).__name__})")
    if not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{name}={value!r}: give a whole number as an int (a float such as nan, inf or 2.5 is no "
                            "count of entries)")
    if not low <= int(value) <= high:
        raise ArgumentError(f"{name}={value!r} is out of range: use an int from {low} to {high}")
    return int(value)


def check_ratio(name: str, value) -> float:
    """``value`` as a float in ``[0, 1)`` (kvpress's ``compression_ratio``: the fraction of the entries removed), else
    one error naming ``name`` (TypeError for a non-number, ValueError for nan, inf or a value out of range)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}={value!r}: give a float in [0, 1) (got {type(value).__name__})")
    if not math.isfinite(value) or not 0 <= value < 1:
        raise ArgumentError(f"{name}={value!r} is out of range: use a finite number with 0 <= {name} < 1 (the "
                            "fraction of the entries removed)")
    return float(value)


def kept_entries(n: int, compression_ratio: float) -> int:
    """The entries kept of ``n`` under ``compression_ratio``, as kvpress's ``compute_n_kept`` counts them
    (``max(1, int(n * (1 - ratio)))``; the ratio is below 1)."""
    return max(1, int(n * (1 - compression_ratio)))


def check_choice_arg(name: str, value, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else one error naming ``name``."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name}={value!r}: give one of {', '.join(map(repr, choices))}")
    if value not in choices:
        raise ArgumentError(f"{name}={value!r} is not valid: use one of {', '.join(map(repr, choices))}")
    return value


def max_positions(model) -> int:
    """The most positions ``model`` takes (its config's ``max_position_embeddings``; :data:`MAX_ENTRIES` without):
    no cache of it holds more entries, so a budget check never measures a rule on more."""
    from kvdiag.model.adapters import text_config

    limit = getattr(text_config(model.config), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else MAX_ENTRIES


def check_model(model):
    """The :class:`~kvdiag.model.adapters.ModelAttention` of ``model``, a transformers causal LM (one error naming
    ``model`` otherwise: None, a tokenizer, a model kvdiag cannot hook)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ArgumentTypeError(f"model={type(model).__name__}: give a transformers causal LM (a PreTrainedModel, "
                                "e.g. kvdiag.model.load.load_model(...).model)")
    try:
        return model_attention(model)
    except UserError as err:
        raise ArgumentError(f"model {type(model).__name__}: {python_message(err)}") from None


def rule_scorer(rule, params: dict | None, name: str = "rule") -> Scorer:
    """The Scorer of ``rule`` (a Scorer, or a registered name with ``params``), else one error naming ``name``."""
    if params is not None and not isinstance(params, dict):
        raise ArgumentTypeError(f"params={params!r}: give a dict of the rule's fields, e.g. {{'window': 16}}")
    if isinstance(rule, Scorer):
        if params:
            raise ArgumentError(f"{name} {rule.name}: params apply to a rule given by name; set them on the instance")
        return rule
    if not isinstance(rule, str):
        raise ArgumentTypeError(f"{name}={rule!r}: give a rule's registered name (e.g. 'rkv') or a "
                                "kvdiag.scorers.Scorer instance")
    try:
        return make_scorer(rule, params)
    except UserError as err:
        raise ArgumentError(f"{name}={rule!r}: {python_message(err)}") from None


# CLI wording -> the Python API's (the checks below the API are shared with the commands, which name their flags)
_PYTHON_WORDS = (
    (r"--budget >= (\d+)", r"budget >= \1"),
    (r"--budget (\d+)", r"budget=\1"),
    (r"--selection ([\w.-]+(?::[\d.]+)?)", r"selection=\1"),
    (r"--scorers ([\w:./-]+)", r"rule='\1'"),
    (r"--param/--w-obs|--w-obs or --param", "params="),
    (r"--param [\w:./-]+\.(\w+)=([^\s:;,]+)", r"params={'\1': '\2'}"),
    (r"--plugin", "kvdiag.scorers.register_scorer"),
    (r"--w-obs|--param", "params"),
    (r"--([a-z][\w-]*)", lambda m: m.group(1).replace("-", "_")),  # any other flag: its Python name
)


def python_message(err: Exception | str) -> str:
    """A refusal worded for the Python API: the command-line flags of a shared check become argument names."""
    text = str(err)
    for pattern, repl in _PYTHON_WORDS:
        text = re.sub(pattern, repl, text)
    return text


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


def most_protected(scorer: Scorer, n: int) -> int:
    """The most entries ``scorer`` protects in a live cache of ``n`` entries: from its declaration (``protects``:
    ``Protected.most``, O(1), so a huge ``n`` allocates nothing) when its class keeps ``Scorer.protected``; else
    measured on its ``protected()`` (:func:`protected_count`, O(n): the caller bounds ``n``)."""
    from kvdiag.scorers.fields import protected_span

    span = protected_span(scorer.protects, scorer)
    if type(scorer).protected is Scorer.protected and span is not None:
        return span.most(n)
    return protected_count(scorer, n)


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
                      head_dim: int = 16, api: bool = False, limit: int | None = None) -> int:
    """Refuse ``scorer`` unless its declaration lets it run on a live cache and (with a ``budget``) its protected
    entries fit the budget at every compaction (a cache of ``budget + interval`` entries, the most one sees).
    Returns the number of entries it protects there.

    The declaration decides (``needs_history``, ``needs_model``, ``protected``); one scoring of a small seeded live
    cache then checks that the rule keeps it (a plugin whose declaration is wrong gets one line before any work).
    ``api``: worded for the Python API (an :class:`ArgumentError` naming ``rule`` and ``budget``, no CLI flags).
    ``limit``: the most entries a cache can hold (the model's positions): a rule whose ``protected()`` must be
    measured is measured on at most that many, so a huge budget allocates nothing.
    """
    rule = f"rule={scorer.name!r}" if api else f"--scorers {scorer.name}"
    error = ArgumentError if api else UserError
    if scorer.needs_history:
        if api:
            raise ArgumentError(f"{rule} needs every past query's attention (it declares needs_history), which a live "
                                f"cache does not keep; rules that run live: {', '.join(live_scorer_names())}")
        raise history_refusal(scorer.name, live_scorer_names())
    if scorer.needs_model:
        raise error(f"{rule} reads the Trace's model (it declares needs_model), which a live cache does not carry; "
                    "grade it with `kvdiag score`")
    n = PROBE_ENTRIES if budget is None else budget + interval
    try:
        _probe(scorer, min(n, PROBE_ENTRIES), group, head_dim)
    except HistoryUnavailable:
        raise error(f"{rule} reads the attention of every past query but does not declare needs_history; set "
                    "needs_history = True in its class") from None
    except ValueError as err:
        fix = "set its window in params= or declare its window_field" if api else \
            "set its window with --w-obs or --param, or declare its window_field"
        raise error(f"{rule} cannot score a live cache ({err}); {fix}") from err
    if budget is not None and limit is not None and budget >= limit:
        return most_protected(scorer, limit)  # no cache of this model reaches the budget: nothing is evicted
    protected = most_protected(scorer, n if limit is None else min(n, limit))
    if budget is not None:
        try:
            check_budget_fits(scorer.name, protected, budget, n)
        except UserError as err:
            raise (ArgumentError(python_message(err)) if api else err) from None
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
