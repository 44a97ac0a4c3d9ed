"""One registry type for everything kvdiag finds by name: scorers, metrics and figures.

A :class:`Registry` maps names to entries in registration order (the order of every output that lists them).
Re-registering the same entry under its name replaces it (a plugin loaded twice); another entry under a taken name is
refused in one line.
Names with a prefix (``kvpress:<Press>``, ``fitted:PATH``) are made on first use by the resolver registered for
that prefix, and a resolver may expand a group name (``kvpress:all``) into several. Third-party packages add
entries through the registry's entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TypeVar

from kvdiag.core.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Resolver:
    """How names ``<prefix><rest>`` are made: ``make(name)`` registers the entry and returns it; ``expand(name)``
    returns the names a group name stands for, or None when ``name`` is not a group."""

    prefix: str
    make: Callable[[str], object]
    expand: Callable[[str], list[str] | None] | None = None


class Registry(dict[str, T]):
    """Named entries of one ``kind`` (``"scorer"``, ``"metric"``, ``"figure"``), in registration order: a ``dict``
    whose :meth:`add` refuses a taken name and whose :meth:`resolve` makes prefixed names on first use."""

    def __init__(self, kind: str, entry_point_group: str | None = None, hint: str = ""):
        super().__init__()
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.hint = hint  # the end of the unknown-name message, e.g. "or load yours with --plugin"
        self._resolvers: dict[str, Resolver] = {}

    def names(self) -> list[str]:
        """Every registered name, in registration order."""
        return list(self)

    def reorder(self, first: Iterable[str]) -> None:
        """Put the names ``first`` (those registered) ahead of the rest, in that order; the rest keep theirs."""
        entries = dict(self)
        self.clear()
        self.update({name: entries.pop(name) for name in first if name in entries})
        self.update(entries)

    # ------------------------------------------------------------------ registration

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name``. The same entry again (the same class or function, by module and qualified
        name, e.g. a plugin file loaded twice) replaces it; another one is a ``UserError``."""
        taken = super().get(name)
        if taken is not None and not _same(taken, entry):
            raise UserError(f"{self.kind} name {name!r} is taken by {_describe(taken)}; register under another name")
        self[name] = entry
        return entry

    def add_resolver(self, prefix: str, make: Callable[[str], object],
                     expand: Callable[[str], list[str] | None] | None = None) -> None:
        """Make names starting with ``prefix`` on first use (see :class:`Resolver`)."""
        self._resolvers[prefix] = Resolver(prefix, make, expand)

    def prefixes(self) -> list[str]:
        return list(self._resolvers)

    def _resolver(self, name: str) -> Resolver | None:
        return next((r for p, r in self._resolvers.items() if name.startswith(p)), None)

    def expand(self, names: Iterable[str]) -> list[str]:
        """``names`` with every group name replaced by the names it stands for (order kept, duplicates dropped)."""
        out: list[str] = []
        for name in names:
            resolver = self._resolver(name)
            group = resolver.expand(name) if resolver is not None and resolver.expand is not None else None
            out += group if group is not None else [name]
        return list(dict.fromkeys(out))

    def resolve(self, name: str) -> T:
        """The entry ``name``, made by its prefix's resolver on first use; an unknown name is a ``UserError``."""
        if name not in self and (resolver := self._resolver(name)) is not None:
            resolver.make(name)
        if name not in self:
            more = [f"a name starting with {', '.join(self._resolvers)}"] if self._resolvers else []
            more += [self.hint] if self.hint else []
            raise UserError(f"unknown {self.kind} {name!r}: use one of {', '.join(self)}"
                            + (f" (or {'; or '.join(more)})" if more else ""))
        return self[name]

    def load_entry_points(self, register: Callable[[str, object], None] | None = None) -> list[str]:
        """Load every installed entry point of :attr:`entry_point_group` (an entry, or a module that registers on
        import); ``register(name, obj)`` decides what to do with what it loaded. Returns ``name = value`` of each."""
        if self.entry_point_group is None:
            return []
        loaded = []
        for ep in entry_points(group=self.entry_point_group):
            try:
                obj = ep.load()
            except Exception as err:  # a broken third-party plugin: name it
                raise UserError(f"{self.kind} plugin {ep.name} = {ep.value} failed to load "
                                f"({err.__class__.__name__}: {err}); fix or uninstall it") from err
            if register is not None:
                register(ep.name, obj)
            loaded.append(f"{ep.name} = {ep.value}")
        return loaded


def _same(a: object, b: object) -> bool:
    """The same entry: equal, or the same class or function by module and qualified name (a module loaded twice)."""
    if a is b or a == b:
        return True
    named = [x if isinstance(x, type) or callable(x) and hasattr(x, "__qualname__")
             else getattr(x, "compute", None) or getattr(x, "draw", None) for x in (a, b)]
    return all(n is not None and hasattr(n, "__qualname__") for n in named) and _describe(a) == _describe(b)


def _describe(entry: object) -> str:
    target = entry
    if not isinstance(entry, type):  # a Metric or Figure: name its function
        target = getattr(entry, "compute", None) or getattr(entry, "draw", None) or entry
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
