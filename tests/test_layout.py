"""The package's layout: no import circle inside ``kvdiag/`` (imports inside functions included)."""

from __future__ import annotations

import ast
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
    assert "kvdiag.scorers.registry" in graph and "kvdiag.registry" in graph["kvdiag.scorers.registry"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# The floors of the package, bottom up. Floor 0 is the shared layer (parsing, stats, plotting, io, models, kernels,
# ...): every module not named here. A module may import its own package, floor 0, and the stages below its floor;
# never a stage on its own floor or above it. The CLI is the top floor and nothing else imports it.
FLOORS = {
    "kvdiag.trace": 1,
    "kvdiag.label": 2,
    "kvdiag.scorers": 3,
    "kvdiag.rankeval": 4,
    "kvdiag.fit": 5,
    "kvdiag.figures": 5,
    "kvdiag.generate": 5,  # the positioned and evicting caches: replay decodes through them
    "kvdiag.decisions": 6,
    "kvdiag.replay": 6,
    "kvdiag.kvpress_export": 6,  # kvdiag rules as kvpress presses (over kvdiag.generate)
    "kvdiag.benchmark": 7,
    "kvdiag.grade": 8,
    "kvdiag.viewer": 9,
    "kvdiag.report": 10,
    "kvdiag.scale": 11,
    "kvdiag.gpu_check": 11,
    "kvdiag.cli": 12,
    "kvdiag.__main__": 13,
}


def unit(module: str) -> str:
    """The floor unit of ``module``: its stage package (``kvdiag.label.run`` -> ``kvdiag.label``) or itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def floor(module: str) -> int:
    return FLOORS.get(unit(module), 0)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a module into a later (or the same) floor than its own, outside its own unit."""
    bad = []
    for a, targets in graph.items():
        for b in targets:
            if unit(a) == unit(b) or b == "kvdiag":
                continue
            if floor(b) > floor(a) or (floor(b) == floor(a) and floor(a) > 0):
                bad.append(f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})")
    return sorted(bad)


def test_upward_imports_are_found():
    graph = {"kvdiag.label.run": {"kvdiag.cli.common", "kvdiag.stats", "kvdiag.trace.reader"},
             "kvdiag.stats": {"kvdiag.rankeval.evaluate"}, "kvdiag.decisions.run": {"kvdiag.replay.run"}}
    assert upward_imports(graph) == [
        "kvdiag.decisions.run (floor 6) imports kvdiag.replay.run (floor 6)",
        "kvdiag.label.run (floor 2) imports kvdiag.cli.common (floor 12)",
        "kvdiag.stats (floor 0) imports kvdiag.rankeval.evaluate (floor 4)",
    ]


def test_no_module_imports_a_later_floor():
    """Labels come before rank-eval in the pipeline, so ``label/`` may not import ``rankeval/``; no library module
    imports ``kvdiag.cli``; the shared layer imports no stage."""
    graph = module_graph()
    assert {"kvdiag.parsing", "kvdiag.stats", "kvdiag.plotting"} <= set(graph)
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
    assert floor("kvdiag.cache.positioned") == 0 < floor("kvdiag.trace.writer")
