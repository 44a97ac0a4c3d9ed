"""The built-in scorers' parameters and declarations, importable without torch: the CLI checks ``--param`` names
and types, ``needs_history`` (replay) and the ``wo_l2`` payload (``score --model``) before torch loads.

A hand-kept table rather than torch-free scorer modules: the scorer classes, their base and ``ScoreContext`` use
torch in every method, and a lazy torch in some thirty modules would be easy to break by one top-level import.
tests/test_bad_input.py checks that the table is the registry's: every field's annotation and default, the class-level
``needs_history`` and the rules whose default instance runs on a live cache.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import coerce
from kvdiag.scorers.names import ENTRY_POINT_GROUP

_AVOKV = {"w_obs": ("int", 32), "w_delay": ("int", 128), "lambda_p": ("float", 1.0), "lambda_r": ("float", 1.0),
          "lambda_b": ("float", 1.0), "payload": ("str", "l2"), "normalization": ("str", "rank")}
# name -> field -> (its annotation as written, its default), in field order
FIELDS: dict[str, dict[str, tuple[str, object]]] = {
    "attention": {"window": ("int", 32)},
    "attention_x_age": {"window": ("int", 32)},
    "h2o": {"normalize": ("bool", True), "recent_size": ("int", 0)},
    "snapkv": {"window": ("int", 32), "kernel_size": ("int", 5), "pooling": ("str", "avgpool")},
    "tova": {},
    "streamingllm": {"n_sink": ("int", 4)},
    "rkv": {"window": ("int", 8), "kernel_size": ("int", 7), "mix_lambda": ("float", 0.1), "pooling": ("str", "max"),
            "threshold": ("float", 0.5)},
    "lazyeviction": {"alpha": ("float", 0.0005), "window": ("int", 52)},
    "thinkv": {"segment_len": ("int", 128), "rel_threshold": ("float", 0.01),
               "thresholds": ("tuple[float, ...] | None", None), "quantiles": ("tuple[float, ...]", (1 / 3, 2 / 3)),
               "rho": ("tuple[float, ...]", (0.0, 2.0, 1.0)), "prompt_class": ("str", "R"), "max_level": ("int", 4),
               "w_level": ("float", 1.0), "w_rho": ("float", 0.25), "w_rep": ("float", 0.1)},
    "knorm": {},
    "value_norm": {"kind": ("str", "range"), "n_sink": ("int", 4)},
    "vatp": {"base": ("str", "h2o"), "window": ("int", 32), "n_sink": ("int", 4)},
    "random": {"seed": ("int", 0)},
    "avokv_e": _AVOKV,
    "avokv_e_no_payload": {**_AVOKV, "lambda_b": ("float", 0.0)},
    "avokv_e_no_delay": {**_AVOKV, "w_delay": ("int | None", None)},
    "avokv_e_raw": {**_AVOKV, "normalization": ("str", "zscore")},
    "avokv_e_no_redundancy": {**_AVOKV, "lambda_r": ("float", 0.0)},
    "vase": {"window": ("int", 64), "n_large": ("int", 256), "kind": ("str", "range"), "n_sink": ("int", 4),
             "kernel_size": ("int", 5), "temperature": ("float", 1.0)},
    "cake": {"window": ("int", 32), "gamma": ("float", 200.0), "kernel_size": ("int", 5)},
    "obcache": {"window": ("int", 32), "target": ("str", "kv"), "pooling": ("str", "none")},
    "longflow": {},
    "fitted": {"path": ("str", ""), "_model": ("dict", None)},
}
HISTORY = ("h2o", "lazyeviction", "thinkv")  # needs_history = True in the class: never on a live cache
HISTORY_BY_INSTANCE = ("vatp", "fitted")  # needs_history is a property of the instance (its base, its model)
# the built-ins whose default instance runs on a live cache (kvdiag.generate.live.live_scorer_names)
LIVE = tuple(n for n in FIELDS if n not in HISTORY + HISTORY_BY_INSTANCE)
IN_ALL = tuple(n for n in FIELDS if n != "fitted")  # `--scorers all` (fitted needs its model path)
# name -> the class's ``protects``: (the field W of the newest entries it never evicts, age <= W; the field S of the
# first ones, position < S); a built-in not named protects nothing
PROTECTS: dict[str, tuple[str | None, str | None]] = {
    "h2o": ("recent_size", None), "snapkv": ("window", None), "rkv": ("window", None),
    "streamingllm": (None, "n_sink"), "lazyeviction": ("window", None), "value_norm": (None, "n_sink"),
    "vatp": (None, "n_sink"), "vase": ("window", "n_sink"), "cake": ("window", None), "obcache": ("window", None),
    **{n: ("w_delay", None) for n in FIELDS if n.startswith("avokv_e")},
}
# name -> the class's ``window_field``: the field replay's --w-obs sets (kvdiag.generate.live.make_scorer)
WINDOW_FIELD = {**{n: "window" for n in ("attention", "attention_x_age", "snapkv", "rkv", "vatp", "vase", "cake",
                                         "obcache")}, **{n: "w_obs" for n in FIELDS if n.startswith("avokv_e")}}


@dataclass(frozen=True)
class Protected:
    """The entries a rule never evicts: the ``recent`` newest (age <= recent) and the ``sinks`` first (position <
    sinks). The one definition: ``Scorer.protected`` is its :meth:`mask`, replay's budget check its :meth:`most`."""

    recent: int = 0
    sinks: int = 0

    def mask(self, age, position):
        """[n] bool of ``age [n]`` (checkpoint - position, >= 1) and ``position [n]`` (tensors or arrays)."""
        return (age <= self.recent) | (position < self.sinks)

    def most(self, n: int) -> int:
        """The most entries protected in a cache of ``n`` entries, over every split of it into the oldest positions
        and the newest ages (``kvdiag.generate.live.protected_count`` measures it on any ``protected()``)."""
        return min(n, self.recent + self.sinks)


def protected_span(protects: tuple[str | None, str | None], values) -> Protected | None:
    """The :class:`Protected` entries of a rule declaring ``protects`` whose fields hold ``values`` (a dict, or the
    scorer itself); None when a field is not a number yet (avokv_e_no_delay's ``w_delay`` None follows ``w_obs`` in
    the class)."""
    get = values.get if isinstance(values, dict) else (lambda f: getattr(values, f))
    recent, sinks = (0 if f is None else get(f) for f in protects)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (recent, sinks)):
        return None
    return Protected(recent, sinks)


def live_protected(name: str, params: dict | None, w_obs: int | None, n: int) -> int | None:
    """The most entries the built-in ``name`` with ``params`` (``w_obs`` in its window field unless ``params`` set it)
    protects in a live cache of ``n`` entries, told without torch; None for a plugin, a prefixed name or a span only
    the class can tell."""
    values = builtin_params(name, params)
    if values is None:
        return None
    field = WINDOW_FIELD.get(name)
    if w_obs is not None and field is not None and field not in (params or {}):
        values[field] = w_obs
    span = protected_span(PROTECTS.get(name, (None, None)), values)
    return None if span is None else span.most(n)


def check_budget_fits(name: str, protected: int, budget: int, n: int) -> None:
    """Refuse a ``budget`` below the ``protected`` entries the rule ``name`` always keeps in a live cache of ``n``."""
    if protected > budget:
        raise UserError(
            f"--budget {budget} is smaller than the {protected} entries {name} always keeps (its protected windows at "
            f"{n} cached entries); use --budget >= {protected} or shrink its windows with --param/--w-obs")


def annotation(name: str, field: str):
    """The type of ``field`` of the built-in ``name`` (its annotation evaluated with builtins only)."""
    return eval(FIELDS[name][field][0], {"__builtins__": builtins})  # noqa: S307  (the table's own literals)


def check_param_names(name: str, params: dict, fields) -> None:
    """Refuse a ``--param`` of ``name`` that is none of its ``fields``."""
    unknown = sorted(set(params) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise UserError(f"scorer {name} has no parameter {unknown[0]!r}: its parameters are {valid}")


def builtin_params(name: str, params: dict | None) -> dict | None:
    """The parameters the built-in ``name`` would run with (its defaults, then ``params`` converted to the field
    types), or None when ``name`` is no built-in; a name or value the registry would refuse is its ``UserError``."""
    if name not in FIELDS:
        return None
    params = params or {}
    check_param_names(name, params, FIELDS[name])
    given = {key: coerce(value, annotation(name, key), f"{name}.{key}") for key, value in params.items()}
    return {**{key: default for key, (_, default) in FIELDS[name].items()}, **given}


def check_params(params: dict[str, dict]) -> None:
    """Refuse a ``--param`` name or value of a built-in scorer (plugins and prefixed names: when they load)."""
    for name, given in params.items():
        builtin_params(name, given)


def history_refusal(name: str, supported) -> UserError:
    """The one line for a rule that needs every past query's attention in replay."""
    return UserError(f"--scorers {name} needs the attention of every past query (it declares needs_history), which "
                     f"a live cache does not keep; replay supports {', '.join(supported)}")


def check_live_names(names) -> None:
    """Refuse, before torch, a built-in of ``names`` whose class needs every past query's attention."""
    for name in names:
        if name in HISTORY:
            raise history_refusal(name, LIVE)


def wo_l2_unused(names, params: dict[str, dict], plugins) -> bool:
    """True when no scorer of ``names`` (``all`` expands to the built-ins of ``--scorers all``) reads the ``wo_l2``
    payload, told from the table; False when one does or it cannot be told (a plugin, a prefixed name)."""
    from importlib.metadata import entry_points

    expanded = [m for n in names for m in (IN_ALL if n == "all" else [n])]
    if plugins or entry_points(group=ENTRY_POINT_GROUP) or any(n not in FIELDS or n == "fitted" for n in expanded):
        return False
    # kvdiag.scorers.base.needs_o_proj: "wo_l2" among the instance's parameter values
    return not any("wo_l2" in (str(v) for v in builtin_params(n, params.get(n)).values()) for n in expanded)


MODEL_UNUSED = "--model {model} does not apply: no selected scorer reads the wo_l2 payload (‖W_O v‖₂); drop it"
