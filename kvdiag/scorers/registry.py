"""The scorer registry: rules by name (:data:`SCORERS`, a :class:`kvdiag.core.registry.Registry`), plugins, and
instances
from names and ``--param`` strings (converted to the field types).

``kvpress:<Press>`` and ``fitted:PATH`` are made on first use by the resolvers their modules register
(``kvdiag.scorers.kvpress_press``, ``kvdiag.scorers.fitted``); plugins come from ``--plugin`` files or modules and
from the entry-point group ``kvdiag.scorers``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import typing
from collections.abc import Iterable
from pathlib import Path

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import coerce, parse_params  # noqa: F401  (parse_params: the registry's API)
from kvdiag.core.registry import Registry
from kvdiag.scorers.base import Scorer, blame, where
from kvdiag.scorers.fields import check_param_names
from kvdiag.scorers.names import ENTRY_POINT_GROUP
from kvdiag.scorers.plugin_check import check_plugin_files

SCORERS: Registry[type[Scorer]] = Registry("scorer", ENTRY_POINT_GROUP, "load yours with --plugin")


def register_scorer(name_or_cls: str | type[Scorer], name: str | None = None):
    """Register a Scorer class under a name: ``@register_scorer("mine")`` or ``register_scorer(Mine, "mine")``.

    The class implements ``score()`` (the raw score); ``Scorer.scores()`` applies its protection and checks, so a
    class that overrides ``scores()`` is refused. Re-registering the same class is a no-op; another class under a
    taken name is an error.
    """

    def add(cls: type[Scorer], key: str) -> type[Scorer]:
        if not (isinstance(cls, type) and issubclass(cls, Scorer) and dataclasses.is_dataclass(cls)):
            raise UserError(f"scorer {key!r}: {cls!r} must be a @dataclass subclass of kvdiag.scorers.Scorer")
        if cls.scores is not Scorer.scores:  # the old API: scores() returned the protected score
            raise UserError(f"scorer {key!r} ({where(cls)}) overrides scores(), the old scorer API: rename it to "
                            "score(ctx) (the raw score [Hkv, t]) and declare protected(age, position); "
                            "Scorer.scores() applies the protection")
        if cls.score is Scorer.score:
            raise UserError(f"scorer {key!r} ({where(cls)}) defines no score(ctx): add one returning the raw score "
                            "[Hkv, t], higher = keep")
        SCORERS.add(key, cls)
        cls.name = key
        return cls

    if isinstance(name_or_cls, str):
        return lambda cls: add(cls, name_or_cls)
    return add(name_or_cls, name or name_or_cls.name or name_or_cls.__name__.lower())


def load_builtins() -> None:
    """Import every built-in rule (``kvdiag.scorers.zoo``) once: a registry lookup sees the whole zoo, in order."""
    importlib.import_module("kvdiag.scorers.zoo")


def scorer_names() -> list[str]:
    """Every registered name (built-ins, then plugins, in registration order)."""
    load_builtins()
    return SCORERS.names()


def get_scorer(name: str, **params) -> Scorer:
    """An instance of the scorer ``name`` with ``params`` (strings are converted to the field types)."""
    load_builtins()
    cls = SCORERS.resolve(name)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    check_param_names(name, params, fields)
    kwargs = {key: coerce(value, hints[key], f"{name}.{key}") for key, value in params.items()}
    return cls(**kwargs)


# --------------------------------------------------------------------------- plugins


def load_plugins(modules: Iterable[str] = ()) -> list[str]:
    """Register plugin scorers: every installed entry point of group ``kvdiag.scorers`` (a Scorer class, or a
    module that registers on import), then each of ``modules`` (a module name importable from the current
    directory or ``PYTHONPATH``, or a ``.py`` file). Returns what was loaded."""
    load_builtins()

    def register(name: str, obj: object) -> None:
        if isinstance(obj, type) and issubclass(obj, Scorer):
            register_scorer(obj, name)

    loaded = SCORERS.load_entry_points(register)
    for module in modules:
        _import_plugin(module)
        loaded.append(module)
    return loaded


def load_plugin_rules(module: str) -> list[str]:
    """The scorer names that loading ``module`` (a ``.py`` file or module name) registered (in order)."""
    load_builtins()
    before = set(SCORERS.names())
    _import_plugin(module)
    return [name for name in SCORERS.names() if name not in before]


def _import_plugin(module: str) -> None:
    """Import a plugin; every fault of the plugin (missing, syntax, import, an exception or exit at import, a broken
    scorer contract, a taken name) is one ``UserError`` line naming the file (and line) and the fix."""
    path = Path(module)
    label = f"--plugin {module}"
    check_plugin_files([module])  # missing, and the faults its source shows: their own lines, before it runs
    try:
        with no_hard_exit():
            _exec_plugin(module, path)
    except SyntaxError as err:
        raise UserError(f"{label}: syntax error in {err.filename} line {err.lineno}: {err.msg}; fix the file"
                        ) from None
    except ImportError as err:
        raise UserError(f"{label}: cannot import it ({err}) at {blame(err, module)}; pass a module on PYTHONPATH "
                        "or a .py file whose imports are installed") from None
    except UserError as err:  # the scorer contract or a taken name, raised by register_scorer
        raise UserError(f"{label}: {err}") from None
    except SystemExit as err:
        raise UserError(f"{label}: it exits at import (SystemExit({err.code!r}) at {blame(err, module)}); a plugin "
                        "must only define and register scorers") from None
    except Exception as err:
        raise UserError(f"{label}: importing it raised {type(err).__name__}: {err} at {blame(err, module)}; fix "
                        "the plugin") from None


def _exec_plugin(module: str, path: Path) -> None:
    """Run the plugin: a ``.py`` file by its path, else a module importable from PYTHONPATH or the working directory."""
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"kvdiag_plugin_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[spec.name]  # a half-imported plugin must not be found by a retry
            raise
    else:
        if os.getcwd() not in sys.path:  # console scripts do not put the working directory on sys.path
            sys.path.append(os.getcwd())
        importlib.import_module(module)


@contextlib.contextmanager
def no_hard_exit():
    """While a plugin imports, ``os._exit`` and ``os.abort`` raise ``SystemExit`` instead of ending the process with
    nothing written and no word (exit 0 for ``os._exit(0)``): the import's guard then says so in one line. A plugin
    that binds them at import (``from os import _exit``) binds the guarded ones."""
    saved = os._exit, os.abort

    def hard_exit(code=0):
        raise SystemExit(code)

    def abort():
        raise SystemExit("abort")

    os._exit, os.abort = hard_exit, abort
    try:
        yield
    finally:
        os._exit, os.abort = saved


def resolve_scorers(names: str | Iterable[str] = "all", params: dict[str, dict] | None = None,
                    plugins: Iterable[str] = ()) -> dict[str, Scorer]:
    """Instances of the named scorers (``"all"``, ``"a,b"`` or a list; group names such as ``kvpress:all`` expand)
    with ``params[name]`` applied."""
    load_builtins()
    load_plugins(plugins)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    # "all": built-ins and plugins that need no setting (prefixed rules are named, or kvpress:all)
    every = [n for n in scorer_names() if ":" not in n and SCORERS[n].in_all]
    names = SCORERS.expand(m for n in names for m in (every if n == "all" else [n]))
    if not names:
        raise UserError(f"--scorers is empty: use all or some of {', '.join(SCORERS)}")
    params = params or {}
    for name in list(names) + list(params):
        SCORERS.resolve(name)  # unknown names: one line
    stray = [n for n in params if n not in names]
    if stray:
        raise UserError(f"--param {stray[0]}.…: scorer {stray[0]} is not in --scorers; add it or drop the parameter")
    return {name: get_scorer(name, **params.get(name, {})) for name in names}
