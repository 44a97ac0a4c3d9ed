"""The scorer contract and its registry: a :class:`Scorer` dataclass per rule, registered by name; instances
from names and ``--param`` strings (converted to the field types).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvdiag.errors import UserError, check_positive
from kvdiag.scorers.context import ScoreContext


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


@dataclass
class QueryWindowScorer(Scorer):
    """A rule that scores from its last ``window`` queries and keeps the last ``window`` entries (SnapKV, R-KV)."""

    window: int = 32

    def __post_init__(self):
        check_positive(f"{self.name}.window", self.window)

    def protected(self, age: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Never evicted: the last ``window`` entries (the query window)."""
        return age <= self.window


def needs_o_proj(scorer: Scorer) -> bool:
    """Whether ``scorer`` reads ‖W_O v‖₂ (the ``wo_l2`` payload), which needs the model's o_proj weights."""
    return "wo_l2" in (str(value) for value in scorer.params.values())


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


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
