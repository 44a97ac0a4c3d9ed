"""A ``--plugin`` ``.py`` file read as source, before it is imported (the import pulls in ``kvdiag.scorers``, hence
torch): the faults that show in its text are refused in one line naming the file, line and fix, each as
``kvdiag.scorers.registry`` words it when the import finds it.

Only what the text decides is refused here: a syntax error; a scorer class registered with ``@register_scorer``
that overrides ``scores()``, that subclasses ``Scorer`` alone and defines no ``score()``, or whose literal name is a
built-in's; a module-level import, in the file's leading run of imports, of a top-level module that is not installed;
a module-level statement that ends the process (``sys.exit``, ``exit``, ``quit``, ``os._exit``, ``os.abort``,
``raise SystemExit``, ``raise KeyboardInterrupt``), in the module's own blocks (if, try, with, for, while) but outside
``if __name__ == "__main__":`` and outside any def or class; a ``raise`` of anything directly in the module body (it
runs unconditionally: the module can never import). Anything that needs the code to run (an exception raised by a
call at import, an exit reached through another name, an import after other statements, which may have changed
``sys.path``, a fault in ``score()``) is left to the import (whose guard turns an exit into the same one line) and to
the first scoring, both before any model loads.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
from pathlib import Path

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_input
from kvdiag.scorers.names import BUILTIN_SCORERS


def check_plugin_files(plugins) -> None:
    """Refuse a ``--plugin`` ``.py`` file that does not exist or whose source breaks the plugin contract (module
    names are checked only by importing them)."""
    for module in plugins or ():
        if not str(module).endswith(".py"):
            continue
        if not Path(module).is_file():
            raise UserError(f"--plugin {module}: file not found; pass a .py file or an importable module name")
        check_plugin_source(str(module))


def check_plugin_source(module: str) -> None:
    """The static checks of the plugin file ``module`` (see the module docstring)."""
    label = f"--plugin {module}"
    path = Path(module)
    try:
        tree = ast.parse(read_input(path, "--plugin"), filename=str(path))
    except SyntaxError as err:
        raise UserError(f"{label}: syntax error in {err.filename} line {err.lineno}: {err.msg}; fix the file"
                        ) from None
    except ValueError as err:  # null bytes: not Python source
        raise UserError(f"{label}: not Python source ({err}); pass a .py file") from None
    _check_leading_imports(tree, label, path)
    _check_exits(tree.body, label, path)
    _check_top_raise(tree.body, label, path)
    scorer_names = _names_bound_to_scorer(tree)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and (key := _registered_name(node, scorer_names)) is not None:
            _check_scorer_class(node, key, scorer_names, label, path)


def _check_leading_imports(tree: ast.Module, label: str, path: Path) -> None:
    """A module that is not installed, imported in the leading run of module-level imports (nothing before them can
    have changed ``sys.path``): the ``ModuleNotFoundError`` the import would raise, as the registry words it."""
    body = tree.body[1:] if tree.body and _is_docstring(tree.body[0]) else tree.body
    for node in body:
        if isinstance(node, ast.Import):
            tops = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level or node.module == "__future__":
                continue
            tops = [node.module.split(".")[0]]
        else:
            return
        for top in tops:
            if not _installed(top):
                raise UserError(f"{label}: cannot import it (No module named {top!r}) at {path}:{node.lineno}; pass "
                                "a module on PYTHONPATH or a .py file whose imports are installed")


EXITS = {("sys", "exit"), (None, "exit"), (None, "quit"), ("os", "_exit"), ("os", "abort")}
EXIT_EXCEPTIONS = ("SystemExit", "KeyboardInterrupt")  # BaseExceptions: no `except Exception` in the loader stops them


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (its body does not run at import)."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def _exit_call(node: ast.stmt) -> str | None:
    """What a statement that ends the process at import is (``sys.exit(...)``, ``raise SystemExit``), else None."""
    if isinstance(node, ast.Raise) and node.exc is not None:
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        return f"raise {exc.id}" if isinstance(exc, ast.Name) and exc.id in EXIT_EXCEPTIONS else None
    call = node.value if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) else None
    func = call.func if call else None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        key = (func.value.id, func.attr)
    elif isinstance(func, ast.Name):
        key = (None, func.id)
    else:
        return None
    return f"{'.'.join(k for k in key if k)}()" if key in EXITS else None


def _check_exits(body: list[ast.stmt], label: str, path: Path) -> None:
    """A module-level statement (in the module's own blocks: if, try, with, for, while; not under the main guard,
    not in a def or class) that ends the process when the plugin is imported."""
    for node in body:
        if (what := _exit_call(node)) is not None:
            raise UserError(f"{label}: it exits at import ({what} at {path}:{node.lineno}); a plugin must only define "
                            "and register scorers")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or _is_main_guard(node):
            continue
        for field in ("body", "orelse", "finalbody"):
            _check_exits(getattr(node, field, None) or [], label, path)
        for handler in getattr(node, "handlers", None) or []:
            _check_exits(handler.body, label, path)


def _check_top_raise(body: list[ast.stmt], label: str, path: Path) -> None:
    """A ``raise`` directly in the module body (not in a block that may skip it): every import of the file raises."""
    for node in body:
        if isinstance(node, ast.Raise):
            what = "raise" if node.exc is None else f"raise {ast.unparse(node.exc)}"[:60]
            raise UserError(f"{label}: it raises at import ({what} at {path}:{node.lineno}), so it can never be "
                            "imported; remove the raise, or move it into a function")


def _installed(top: str) -> bool:
    """Whether the top-level module ``top`` can be imported here (the working directory too: the registry puts it
    on ``sys.path`` for module plugins); finding it imports nothing."""
    if importlib.util.find_spec(top) is not None:
        return True
    return importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _names_bound_to_scorer(tree: ast.Module) -> set[str]:
    """The names the file binds to ``kvdiag.scorers.Scorer`` at module level (``from kvdiag.scorers import Scorer
    [as S]``)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and not node.level and node.module in ("kvdiag.scorers",
                                                                                    "kvdiag.scorers.base"):
            names |= {alias.asname or alias.name for alias in node.names if alias.name == "Scorer"}
    return names


def _registered_name(node: ast.ClassDef, scorer_names: set[str]) -> str | None:
    """The name ``@register_scorer("name")`` (or a bare ``@register_scorer``) registers the class under, when the
    text tells it; None for a class not registered by a decorator, or one whose name is computed."""
    for deco in node.decorator_list:
        call = deco if isinstance(deco, ast.Call) else None
        func = call.func if call else deco
        if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) != "register_scorer":
            continue
        if call is None or not call.args:  # bare: the class's `name`, else its lower-cased class name
            if call is not None and call.keywords:
                return None
            declared = [s.value.value for s in node.body if isinstance(s, (ast.Assign, ast.AnnAssign))
                        and any(getattr(t, "id", None) == "name" for t in _targets(s))
                        and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)]
            if declared:
                return declared[-1] or node.name.lower()
            only_scorer = all(isinstance(b, ast.Name) and b.id in scorer_names for b in node.bases) and node.bases
            return node.name.lower() if only_scorer else None
        first = call.args[0]
        return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
    return None


def _targets(stmt: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]


def _check_scorer_class(node: ast.ClassDef, key: str, scorer_names: set[str], label: str, path: Path) -> None:
    """The registry's contract, in its order: no ``scores()`` override, a ``score()``, a name no built-in holds."""
    defined = {s.name for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {getattr(t, "id", None) for s in node.body if isinstance(s, (ast.Assign, ast.AnnAssign))
                for t in _targets(s)}
    line = min([node.lineno] + [d.lineno for d in node.decorator_list])  # where inspect puts a decorated class
    where = f"{path}:{line}"  # the path as given, as inspect names the imported class
    if "scores" in defined:
        raise UserError(f"{label}: scorer {key!r} ({where}) overrides scores(), the old scorer API: rename it to "
                        "score(ctx) (the raw score [Hkv, t]) and declare protected(age, position); Scorer.scores() "
                        "applies the protection")
    only_scorer = bool(node.bases) and all(isinstance(b, ast.Name) and b.id in scorer_names for b in node.bases)
    if only_scorer and "score" not in defined:
        raise UserError(f"{label}: scorer {key!r} ({where}) defines no score(ctx): add one returning the raw score "
                        "[Hkv, t], higher = keep")
    if key in BUILTIN_SCORERS:
        raise UserError(f"{label}: scorer name {key!r} is taken by the built-in scorer {key}; register under another "
                        "name")
