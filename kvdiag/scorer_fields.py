"""The built-in scorers' parameters and declarations, importable without torch: the CLI checks ``--param`` names
and types, ``needs_history`` (replay) and the ``wo_l2`` payload (``score --model``) before torch loads.

A hand-kept table rather than torch-free scorer modules: the scorer classes, their base and ``ScoreContext`` use
torch in every method, and a lazy torch in some thirty modules would be easy to break by one top-level import.
tests/test_bad_input.py checks that the table is the registry's: every field's annotation and default, the class-level
``needs_history`` and the rules whose default instance runs on a live cache.
"""

from __future__ import annotations

import builtins

from kvdiag.errors import UserError
from kvdiag.parsing import coerce
from kvdiag.scorer_names import ENTRY_POINT_GROUP

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
