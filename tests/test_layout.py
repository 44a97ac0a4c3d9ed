"""The package's layout: no import circle inside ``kvdiag/`` (imports inside functions included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvdiag"


def module_graph() -> dict[str, set[str]]:
    """module -> the kvdiag modules it imports (anywhere in the file; ``from pkg import name`` counts ``pkg.name``
    when that is a module, else ``pkg``)."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles_inside_kvdiag():
    graph = module_graph()
    assert "kvdiag.scorers.registry" in graph and "kvdiag.core.registry" in graph["kvdiag.scorers.registry"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# The floors of the package, bottom up: the shared floor, the model layer, the stages in pipeline order, the tools,
# the CLI. A module may import its own package and the packages below its floor; never a package on its own floor or
# above it (floor 0, the shared floor, only itself). The CLI is the top floor and nothing else imports it.
FLOORS = {
    "kvdiag.core": 0,  # errors, io, parsing, schema, stats, tables, registry, guard, contracts, parts, plotting, ...
    "kvdiag.tasks": 1,  # prompts, suites, needed tokens
    "kvdiag.model": 2,  # specs, loading, families and adapters, attention, embedded weights, token counts
    "kvdiag.kernels": 3,
    "kvdiag.cache": 4,  # the positioned cache: the Trace records through it, replay decodes through it
    "kvdiag.trace": 5,
    "kvdiag.label": 6,
    "kvdiag.scorers": 7,
    "kvdiag.rankeval": 8,
    "kvdiag.fit": 9,
    "kvdiag.figures": 9,
    "kvdiag.generate": 9,  # the evicting cache and kvpress presses: replay decodes through them
    "kvdiag.decisions": 10,
    "kvdiag.replay": 10,
    "kvdiag.grade": 11,
    "kvdiag.report": 12,
    "kvdiag.bench": 13,
    "kvdiag.cli": 14,
    "kvdiag.__main__": 15,
}
# the modules at the top of kvdiag/ that are not packages: the package's entry points
ENTRY_POINTS = {"__init__.py", "__main__.py"}
MAX_ROOMS = 25


def unit(module: str) -> str:
    """The floor unit of ``module``: its stage package (``kvdiag.label.run`` -> ``kvdiag.label``) or itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def floor(module: str) -> int:
    return FLOORS[unit(module)] if module != "kvdiag" else 0


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a module into a later (or the same) floor than its own, outside its own unit."""
    bad = []
    for a, targets in graph.items():
        for b in targets:
            if unit(a) == unit(b) or "kvdiag" in (a, b):  # the root: the version and the moved-module aliases
                continue
            if floor(b) >= floor(a):
                bad.append(f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})")
    return sorted(bad)


def test_upward_imports_are_found():
    graph = {"kvdiag.label.run": {"kvdiag.cli.common", "kvdiag.core.stats", "kvdiag.trace.reader"},
             "kvdiag.core.stats": {"kvdiag.rankeval.evaluate"}, "kvdiag.decisions.run": {"kvdiag.replay.run"},
             "kvdiag.core.parts": {"kvdiag.tasks.prompts", "kvdiag.core.io"}}
    assert upward_imports(graph) == [
        "kvdiag.core.parts (floor 0) imports kvdiag.tasks.prompts (floor 1)",
        "kvdiag.core.stats (floor 0) imports kvdiag.rankeval.evaluate (floor 8)",
        "kvdiag.decisions.run (floor 10) imports kvdiag.replay.run (floor 10)",
        "kvdiag.label.run (floor 6) imports kvdiag.cli.common (floor 14)",
    ]


def test_no_module_imports_a_later_floor():
    """Labels come before rank-eval in the pipeline, so ``label/`` may not import ``rankeval/``; no library module
    imports ``kvdiag.cli``; the shared layer imports no stage."""
    graph = module_graph()
    assert {"kvdiag.core.parsing", "kvdiag.core.stats", "kvdiag.core.plotting"} <= set(graph)
    assert not (bad := upward_imports(graph)), "\n".join(bad)


def test_nothing_outside_the_cli_imports_it():
    graph = module_graph()
    users = sorted(a for a, targets in graph.items() for b in targets
                   if unit(b) == "kvdiag.cli" and unit(a) not in ("kvdiag.cli", "kvdiag.__main__"))
    assert not users, users


def cache_classes() -> dict[str, list[str]]:
    """Every class in ``kvdiag/`` that subclasses a transformers cache or cache layer (or one of those): name ->
    its module path. Bases are matched by name, so a second positioned cache (or a ``DynamicLayer`` subclass of
    the recorder's own, as before #44) shows up whatever it is called."""
    cache_bases = {"Cache", "DynamicCache", "DynamicLayer", "DynamicSlidingWindowLayer", "CacheLayerMixin",
                   "StaticLayer", "StaticCache", "QuantizedLayer", "SlidingWindowLayer"}
    found: dict[str, list[str]] = {}
    changed = True
    while changed:  # subclasses of subclasses (EvictingCache(PositionedCache))
        changed = False
        for path in ROOT.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef) or node.name in found:
                    continue
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                if bases & (cache_bases | set(found)):
                    found[node.name] = str(path.relative_to(ROOT.parent))
                    changed = True
    return found


def test_one_cache_with_positions():
    """One cache implementation in kvdiag (#44): the positioned layer and cache at floor 0, the evicting cache over
    it; the Trace recorder's ``PreallocatedLayer`` and replay's ``ReplayCache`` are gone."""
    assert cache_classes() == {
        "PositionedLayer": "kvdiag/cache/positioned.py", "PositionedCache": "kvdiag/cache/positioned.py",
        "EvictingCache": "kvdiag/generate/evicting.py",
    }
    assert floor("kvdiag.cache.positioned") < floor("kvdiag.trace.writer")


def test_the_top_of_kvdiag_is_packages():
    """``kvdiag/`` holds packages (each with a floor) and the entry points, nothing loose: a newcomer reads the
    layers from the directory listing. At most MAX_ROOMS rooms."""
    top = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__")
    loose = [name for name in top if name.endswith(".py") and name not in ENTRY_POINTS]
    assert not loose, f"loose modules at the top of kvdiag/: {loose}; move each into the package of its floor"
    packages = [name for name in top if (ROOT / name / "__init__.py").exists()]
    assert sorted(set(top) - set(packages) - ENTRY_POINTS) == [], "only packages and entry points at the top"
    assert sorted(f"kvdiag.{name}" for name in packages) == sorted(u for u in FLOORS if u != "kvdiag.__main__")
    assert len(packages) + len(ENTRY_POINTS) <= MAX_ROOMS


def test_every_module_has_a_floor():
    graph = module_graph()
    assert all(unit(m) in FLOORS or m == "kvdiag" for m in graph), sorted(
        m for m in graph if unit(m) not in FLOORS and m != "kvdiag")


def test_old_module_paths_still_import_with_a_warning():
    """Plugins written against the loose modules of 0.1 keep working: ``kvdiag.stats`` is ``kvdiag.core.stats``
    (one module object), with a DeprecationWarning naming the new path; every moved path exists."""
    import importlib
    import sys
    import warnings

    from kvdiag.core.moved import MOVED

    assert all((ROOT.parent / (new.replace(".", "/") + ".py")).exists() for new in MOVED.values())
    assert not any((ROOT.parent / (old.replace(".", "/") + ".py")).exists() for old in MOVED)
    for old in ("kvdiag.stats", "kvdiag.scorer_names"):
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(MOVED[old])
        assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
            f"{old} moved to {MOVED[old]}; import it from there"]


# A second parser of one value, by its telltales: "rest" compared by its spelling, a hand-written range check of a
# horizon or window, a budget's name ("keep:0.5") split by hand.
SECOND_PARSERS = {
    "a horizon compared with 'rest' by its spelling (use REST, parse_horizon)":
        (re.compile(r"""[=!]= *["']rest["']|["']rest["'] *[=!]="""), {"kvdiag/core/parsing.py"}),
    "a horizon or window range checked by hand (parse_horizon checks it)":
        (re.compile(r"\b(\w*horizon\w*|future_window)\b *(<|<=) *[01]\b"), set()),
    "a budget name split by hand (Budget.parse)":
        (re.compile(r"""\b(b|budget\w*|name)\.split\(["']:["']\)"""), set()),
}


def second_parsers(files: dict[str, str]) -> list[str]:
    return sorted(f"{path}:{n}: {what}" for what, (pattern, allowed) in SECOND_PARSERS.items()
                  for path, text in files.items() if path not in allowed
                  for n, line in enumerate(text.splitlines(), 1) if pattern.search(line))


def test_second_parsers_are_found():
    assert second_parsers({"kvdiag/a.py": 'if h == "rest":\n    pass\nif horizon < 1:\n    x = b.split(":")[1]\n',
                           "kvdiag/core/parsing.py": 'if text == "rest":\n'}) == [
        "kvdiag/a.py:1: a horizon compared with 'rest' by its spelling (use REST, parse_horizon)",
        "kvdiag/a.py:3: a horizon or window range checked by hand (parse_horizon checks it)",
        "kvdiag/a.py:4: a budget name split by hand (Budget.parse)",
    ]


def test_horizon_and_budget_are_parsed_in_one_place():
    """``kvdiag.core.parsing.parse_horizon`` is the one parser of every horizon and window of steps (``--horizon``,
    ``--future-window``, ``oracle_future.window``; declared once in ``kvdiag.cli.common.FLAGS``) and
    ``Budget.parse`` the one reader of a budget's name."""
    files = {str(p.relative_to(ROOT.parent)): p.read_text() for p in ROOT.rglob("*.py")}
    assert not (found := second_parsers(files)), "\n".join(found)
