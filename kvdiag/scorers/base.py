"""The scorer contract: a context per (prompt, checkpoint, layer), a Scorer dataclass, a registry by name,
percentile-rank normalization and the aggregations to token/layer/head granularity.

A scorer reads a :class:`ScoreContext` and returns one score per KV head and cached entry, ``[Hkv, t]``;
higher = keep. Entries a rule protects (sinks, recent windows, AvoKV-E's delay buffer) get :func:`protect`'s
finite "kept" score, strictly above every other entry of their row.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from scipy.stats import rankdata

from kvdiag import features as F
from kvdiag.adapters import LayerAttention, as_layer_attention
from kvdiag.attention import group_size
from kvdiag.errors import UserError


@dataclass
class ScoreContext:
    """Everything a scorer may read at one (prompt, checkpoint ``t``, layer): the cache ``[0, t)``.

    A *live* context (``positions`` given, as in ``kvdiag replay``) describes a compacted cache instead: it
    holds the ``t`` entries at absolute ``positions`` (ascending) of a checkpoint ``checkpoint``, and ``q``
    only the last ``w`` queries, at positions ``[checkpoint - w, checkpoint)`` (what a real compressor keeps).
    Causality, ages, recent windows and sinks then follow the absolute positions; features that need every
    past query (:meth:`column_sum`, :meth:`recurrence`, :meth:`sparsity`) raise :class:`HistoryUnavailable`.

    Parameters
    ----------
    q : [H, t, d] fp32 post-RoPE queries at positions ``< t`` only (a scorer never sees the future);
        live: [H, w, d], the queries at positions ``[checkpoint - w, checkpoint)``.
    k, v : [Hkv, t, d] fp32 cached keys and values.
    scale : the layer's attention semantics, a :class:`kvdiag.adapters.LayerAttention` (scale, sliding window,
        softcap, sinks), or a bare float: plain causal attention with that scale (1/√d for Llama/Qwen).
    prompt_len : prompt tokens; positions ``>= prompt_len`` were generated.
    layer, prompt_id : where this context sits (used by seeded scorers).
    token_ids : LongTensor [t] or None.
    candidates : LongTensor [C] of positions ``< t`` returned by ``Scorer.__call__`` (default: all).
    o_proj : the layer's output projection [hidden, H*d] (only for the ``wo_l2`` payload), or None.
    history : the layer's :class:`kvdiag.features.AttentionHistory` shared across checkpoints; built from
        ``q``/``k`` on first use when None.
    positions : LongTensor [t], ascending absolute positions of the cached entries (live context), or None:
        the full cache, ``arange(t)``.
    checkpoint : the absolute checkpoint (live: required, ``> positions[-1]``); None: ``t``.
    trace : the Trace being scored (None in replay): scorers that rerun its model read it (``kvpress:`` presses).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: LayerAttention | float
    prompt_len: int
    layer: int = 0
    prompt_id: str = ""
    token_ids: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    o_proj: torch.Tensor | None = None
    history: F.AttentionHistory | None = None
    cache: dict = field(default_factory=dict, repr=False)
    positions: torch.Tensor | None = None
    checkpoint: int | None = None
    trace: Any = field(default=None, repr=False)
    live: bool = field(init=False, repr=False)

    def __post_init__(self):
        self.q, self.k, self.v = self.q.float(), self.k.float(), self.v.float()
        self.live = self.positions is not None
        if self.v.shape[1] != self.t or (not self.live and self.q.shape[1] != self.t):
            raise ValueError(f"q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, v {tuple(self.v.shape)}: need the same t")
        if self.live:
            if self.checkpoint is None or self.positions.shape != (self.t,):
                raise ValueError(f"a live context needs positions [t={self.t}] and a checkpoint")
            if (self.t and int(self.positions[-1]) >= self.checkpoint) or self.q.shape[1] > self.checkpoint:
                raise ValueError(f"live context: entries and queries must precede the checkpoint {self.checkpoint}")
        else:
            self.positions, self.checkpoint = torch.arange(self.t), self.t
        group_size(self.num_heads, self.num_kv_heads)
        if self.candidates is None:
            self.candidates = torch.arange(self.t)
        elif len(self.candidates) and (self.candidates.min() < 0 or self.candidates.max() >= self.t):
            raise ValueError(f"candidates must be positions in [0, {self.t})")

    @property
    def attn(self) -> LayerAttention:
        """The layer's attention semantics (``scale`` as a :class:`kvdiag.adapters.LayerAttention`)."""
        return as_layer_attention(self.scale)

    @property
    def t(self) -> int:
        """Number of cached entries (the checkpoint, unless the context is live)."""
        return self.k.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def age(self) -> torch.Tensor:
        """[t] ``checkpoint - position`` of every cached entry (``t - i`` for the full cache)."""
        return self.checkpoint - self.positions

    def recent(self, window: int) -> torch.Tensor:
        """[t] bool: entries at positions ``>= checkpoint - window`` (the last ``window`` of the full cache)."""
        return self.positions >= self.checkpoint - window

    def sinks(self, n_sink: int) -> torch.Tensor:
        """[t] bool: entries at positions ``< n_sink`` (attention sinks, if still cached)."""
        return self.positions < n_sink

    def window_queries(self, window: int) -> torch.Tensor:
        """[H, w, d] the queries at positions ``[checkpoint - window, checkpoint)`` (clipped at 0)."""
        w = min(window, self.checkpoint)
        if w > self.q.shape[1]:
            raise ValueError(f"a window of {window} queries was asked, the live context holds {self.q.shape[1]}")
        return self.q[:, self.q.shape[1] - w :]

    def cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per context (features shared by the scorers of one checkpoint and layer)."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def window_attention(self, window: int) -> torch.Tensor:
        """[H, w, t] attention of the queries ``[t - window, t)`` (see ``features.window_attention``; live:
        :func:`live_attention` over the cached entries)."""
        wider = [key for key in self.cache if key[0] == "window" and key[1] >= window]
        if wider:  # the last rows of a wider window are this window
            rows = self.cache[min(wider)]
            return rows[:, rows.shape[1] - min(window, self.checkpoint) :]
        if not self.live:
            return self.cached(("window", window), lambda: F.window_attention(self.q, self.k, self.attn, window))
        return self.cached(("window", window), lambda: live_attention(
            self.window_queries(window), self.k, self.positions, self.checkpoint, self.attn))

    def _history(self) -> F.AttentionHistory:
        if self.live:
            raise HistoryUnavailable("this scorer needs the attention of every past query, which a live (compacted) cache does not keep")
        if self.history is None:
            self.history = F.AttentionHistory(self.q, self.k, self.attn)
        return self.history

    def column_sum(self) -> torch.Tensor:
        """[H, t] ``Σ_{tau < t} a_{tau, j}``: attention received from every past query (H2O)."""
        H, T = self.num_heads, self._history().q.shape[1]
        return self.cached(("colsum",), lambda: self._history().get(("colsum",), lambda: F.ColumnSum(H, T), self.t).snapshot(self.t))

    def recurrence(self, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        """LazyEviction's ``(TS, MRI)`` [H, t] replayed over the decode steps ``< t`` (see ``features.Recurrence``)."""
        H, T, P = self.num_heads, self._history().q.shape[1], self.prompt_len
        key = ("recurrence", alpha)
        return self.cached(key, lambda: self._history().get(key, lambda: F.Recurrence(H, T, P, alpha), self.t).snapshot(self.t))

    def sparsity(self, rel_threshold: float) -> torch.Tensor:
        """[H, t] ThinKV attention sparsity of the query at each position ``< t``."""
        H, T = self.num_heads, self._history().q.shape[1]
        key = ("sparsity", rel_threshold)
        return self.cached(key, lambda: self._history().get(key, lambda: F.Sparsity(H, T, rel_threshold, self.attn.window), self.t).snapshot(self.t))

    def payload(self, kind: str) -> torch.Tensor:
        """[Hkv, t] value payload (``features.value_payload``)."""
        return self.cached(("payload", kind), lambda: F.value_payload(self.v, kind, self.o_proj, self.num_heads))


class HistoryUnavailable(UserError):
    """A scorer asked a live context for a feature of every past query (cumulative attention, recurrence)."""


def live_attention(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, checkpoint: int,
                   attn: LayerAttention | float) -> torch.Tensor:
    """Exact fp32 attention of the queries at ``[checkpoint - w, checkpoint)`` over a compacted cache.

    q [H, w, d], k [Hkv, n, d] at absolute ``positions [n]``: query ``tau`` sees the cached entries at positions
    ``<= tau`` (and inside the layer's sliding window: causality and windows by absolute position, whatever was
    evicted); ``attn``: the layer's ``LayerAttention`` (softcap, sinks) or a bare scale. Returns [H, w, n].
    """
    attn = as_layer_attention(attn)
    H, w, d = q.shape
    Hkv, n, _ = k.shape
    g = group_size(H, Hkv)
    logits = attn.logits((q.reshape(Hkv, g * w, d) @ k.transpose(1, 2)).reshape(H, w, n))
    hidden = attn.hidden(torch.arange(checkpoint - w, checkpoint), positions)  # [w, n]
    # a query whose visible entries were all evicted reads nothing (instead of a NaN row)
    probs = attn.softmax(logits.masked_fill(hidden, float("-inf")), heads_dim=0)
    return torch.where(hidden.all(dim=-1)[None, :, None], 0.0, probs)


@dataclass
class Scorer:
    """Base of every scoring rule: a dataclass whose fields are its parameters (with official defaults).

    Subclasses implement :meth:`scores`; the registry name is set by :func:`register_scorer`.
    """

    name: ClassVar[str] = ""
    in_all: ClassVar[bool] = True  # part of `--scorers all` (False: needs a setting, e.g. fitted's model path)

    def scores(self, ctx: ScoreContext) -> torch.Tensor:
        """[Hkv, t]: one score per KV head and cached entry; higher = keep."""
        raise NotImplementedError

    def protected(self, age: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """[n] bool: the entries of ``age [n]`` (checkpoint − position) and ``position [n]`` that this rule never
        evicts on a full cache (sinks, recent windows, a delay buffer); they get :func:`protect`'s kept score.
        rank-eval's ``--eligible`` keeps the others. Default: none."""
        return torch.zeros_like(age, dtype=torch.bool)

    def __call__(self, ctx: ScoreContext) -> torch.Tensor:
        """[Hkv, C]: the scores of ``ctx.candidates``."""
        return self.scores(ctx)[:, ctx.candidates]

    @property
    def params(self) -> dict:
        """The parameters as a JSON-serializable dict (written into scores.parquet's metadata)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


# --------------------------------------------------------------------------- registry

SCORERS: dict[str, type[Scorer]] = {}


def register_scorer(name_or_cls: str | type[Scorer], name: str | None = None):
    """Register a Scorer class under a name: ``@register_scorer("mine")`` or ``register_scorer(Mine, "mine")``.

    Re-registering the same class is a no-op; another class under a taken name is an error.
    """

    def add(cls: type[Scorer], key: str) -> type[Scorer]:
        if not (isinstance(cls, type) and issubclass(cls, Scorer) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"scorer {key!r}: {cls!r} must be a @dataclass subclass of kvdiag.scorers.Scorer")
        if key in SCORERS and SCORERS[key] is not cls:
            raise UserError(f"scorer name {key!r} is taken by {SCORERS[key].__module__}.{SCORERS[key].__name__}; register under another name")
        cls.name = key
        SCORERS[key] = cls
        return cls

    if isinstance(name_or_cls, str):
        return lambda cls: add(cls, name_or_cls)
    return add(name_or_cls, name or name_or_cls.name or name_or_cls.__name__.lower())


def scorer_names() -> list[str]:
    """Every registered name (built-ins, then plugins, in registration order)."""
    return list(SCORERS)


def ensure_registered(name: str) -> None:
    """Register ``kvpress:<Press>`` (kvpress is optional and slow to import) and ``fitted:PATH`` (a model of
    ``kvdiag fit``) on first use; other names pass."""
    if name in SCORERS:
        return
    if name.startswith("kvpress:"):
        from kvdiag.scorers.kvpress_press import register_press

        register_press(name)
    elif name.startswith("fitted:"):
        from kvdiag.scorers.fitted import register_fitted

        register_fitted(name)


def get_scorer(name: str, **params) -> Scorer:
    """An instance of the scorer ``name`` with ``params`` (strings are converted to the field types)."""
    ensure_registered(name)
    if name not in SCORERS:
        raise UserError(f"unknown scorer {name!r}: use one of {', '.join(SCORERS)} (or load yours with --plugin)")
    cls = SCORERS[name]
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - fields)
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise UserError(f"scorer {name} has no parameter {unknown[0]!r}: its parameters are {valid}")
    kwargs = {key: coerce(value, hints[key], f"{name}.{key}") for key, value in params.items()}
    return cls(**kwargs)


def coerce(value: Any, hint: Any, what: str) -> Any:
    """Convert a ``--param`` string to the type ``hint`` (int, float, bool, str, tuples, ``X | None``)."""
    if not isinstance(value, str):
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null") and type(None) in args:
            return None
        return coerce(value, next(a for a in args if a is not type(None)), what)
    try:
        if origin is tuple:
            return tuple(coerce(part.strip(), args[0], what) for part in value.split(","))
        if hint is bool:
            if value.lower() in ("true", "1", "yes", "on"):
                return True
            if value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if hint in (int, float, str):
            return hint(value)
    except ValueError:
        raise UserError(f"--param {what}={value}: not a valid {getattr(hint, '__name__', hint)}") from None
    raise UserError(f"--param {what}: parameters of type {hint} cannot be set from the command line")


def parse_params(items: list[str] | None) -> dict[str, dict[str, str]]:
    """``["rkv.mix_lambda=0.2", ...]`` -> ``{"rkv": {"mix_lambda": "0.2"}}`` (values converted by get_scorer)."""
    out: dict[str, dict[str, str]] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        scorer, dot, param = key.partition(".")
        if not sep or not dot or not scorer or not param:
            raise UserError(f"--param {item!r}: write it as scorer.key=value, e.g. rkv.mix_lambda=0.1")
        out.setdefault(scorer.strip(), {})[param.strip()] = value.strip()
    return out


def check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    """A UserError naming ``what`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise UserError(f"{what}={value!r} is not valid: use one of {', '.join(choices)}")


def check_positive(what: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise UserError(f"{what}={value} must be at least {minimum}")


# --------------------------------------------------------------------------- normalization and protection


def percentile_rank(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The rank normalization ``N_t``: ``(rank - 1) / (n - 1)`` along the last axis, average ranks for ties.

    x [..., t]; mask [t] bool selects the set that is ranked (others get NaN). Values lie in [0, 1];
    a set of one entry gets 0.5 (the middle of [0, 1]).
    """
    mask = torch.ones(x.shape[-1], dtype=torch.bool) if mask is None else mask
    out = torch.full(x.shape, float("nan"))
    n = int(mask.sum())
    if n == 0:
        return out
    if n == 1:
        out[..., mask] = 0.5
        return out
    ranks = rankdata(x[..., mask].double().numpy(), method="average", axis=-1)
    out[..., mask] = torch.from_numpy(((ranks - 1.0) / (n - 1)).astype(np.float32))
    return out


def zscore(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries of the last axis (population std; 0 where std is 0)."""
    if not bool(mask.any()):
        return torch.full_like(x, float("nan"))
    sel = x[..., mask]
    mean = sel.mean(dim=-1, keepdim=True)
    std = sel.std(dim=-1, unbiased=False, keepdim=True)
    out = (x - mean) / torch.where(std > 0, std, torch.ones_like(std))
    return torch.where(mask, out, torch.full_like(out, float("nan")))


def protect(scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """Give the ``protected [t]`` entries of ``scores [Hkv, t]`` the "kept" score of their row.

    The kept score is ``m + 1 + |m|`` with ``m`` the row's highest unprotected score: finite (ranking metrics
    and percentile ranks stay defined) and strictly above every unprotected entry, also in fp32. All protected
    entries of a row tie. With nothing unprotected, ``m = 0``.
    """
    if not bool(protected.any()):
        return scores
    free = ~protected
    top = scores[:, free].amax(dim=1, keepdim=True) if bool(free.any()) else torch.zeros(scores.shape[0], 1)
    return torch.where(protected, top + 1.0 + top.abs(), scores)


def recent(t: int, window: int) -> torch.Tensor:
    """[t] bool: the last ``window`` positions of the cache."""
    return torch.arange(t) >= t - window


# --------------------------------------------------------------------------- aggregation over layers and heads

AGGREGATIONS = {
    "mean_rank": "each (layer, KV head)'s scores are percentile-ranked over the cache [0, t) (N_t); token rows take "
    "the mean over layers and KV heads, layer rows the mean over that layer's KV heads, head rows the rank itself",
    "mean_raw": "raw scores; token rows take the mean over layers and KV heads, layer rows the mean over that "
    "layer's KV heads, head rows the score itself",
}


def aggregation_values(scores: torch.Tensor, aggregation: str) -> torch.Tensor:
    """[Hkv, t] -> the per-(layer, head) values that ``aggregation`` averages (ranks or raw scores), fp64."""
    if aggregation == "mean_rank":
        return percentile_rank(scores).double()
    if aggregation == "mean_raw":
        return scores.double()
    raise UserError(f"aggregation {aggregation!r} is unknown: use one of {', '.join(AGGREGATIONS)}")
